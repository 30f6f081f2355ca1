"""A wheel built from this checkout installs into a fresh virtualenv, and its `gpuswarm node start` registers with
a real coordinator and stops cleanly on SIGTERM. Nothing of the checkout is on the path: the wheel must carry
every module, the static files and the migrations.

The fresh virtualenv gets the wheel alone (`--no-deps`, offline); its dependencies come from this test's own
environment through a .pth line (torch and hivemind would otherwise be gigabytes of downloads per run). A path
line adds the directory without running the .pth files in it, so this checkout's editable install stays out."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from localswarm import LocalSwarm

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    where = tmp_path_factory.mktemp("wheel")
    # From a copy of the tracked files: setuptools builds in the source tree, and a stale build/ there would
    # put modules deleted since into the wheel.
    shutil.copytree(ROOT, where / "src", ignore=shutil.ignore_patterns(
        ".git", ".venv", ".device", "var", "build", "dist", "*.egg-info", "__pycache__", "test-artifacts", "data"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(where / "dist"), str(where / "src")], check=True, timeout=300, capture_output=True)
    (wheel,) = (where / "dist").glob("gpuswarm-*.whl")
    env = where / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(env)], check=True, timeout=120)
    subprocess.run([env / "bin" / "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True,
                   timeout=300, capture_output=True)
    purelib = subprocess.run([env / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             check=True, capture_output=True, text=True).stdout.strip()
    Path(purelib, "deps-from-the-test.pth").write_text(sysconfig.get_path("purelib") + "\n")
    return env


def test_the_wheel_carries_the_package_its_files_and_its_migrations(venv, tmp_path):
    code = ("import json, gpuswarm, gpuswarm.node.daemon, gpuswarm.coordinator.app, gpuswarm.coordinator.migrations"
            " as m\nfrom importlib.resources import files\nprint(json.dumps({'file': gpuswarm.__file__, "
            "'static': sorted(p.name for p in files('gpuswarm.coordinator.static').iterdir()), "
            "'vendor': sorted(p.name for p in files('gpuswarm.coordinator.static').joinpath('vendor').iterdir()), "
            "'migrations': len(list(files('gpuswarm.coordinator.migrations').joinpath('versions').iterdir()))}))")
    out = json.loads(subprocess.run([venv / "bin" / "python", "-c", code], cwd=tmp_path, check=True, timeout=120,
                                    capture_output=True, text=True).stdout)
    assert out["file"].startswith(str(venv))
    assert out["static"] == sorted(p.name for p in (ROOT / "coordinator" / "static").iterdir())
    assert out["vendor"] == sorted(p.name for p in (ROOT / "coordinator" / "static" / "vendor").iterdir())
    assert out["migrations"] >= len(list((ROOT / "coordinator" / "migrations" / "versions").glob("2*.py")))


def test_the_installed_node_starts_registers_and_stops(venv, tmp_path):
    lab = LocalSwarm(tmp_path / "lab")
    try:
        lab.start_coordinator()
        node = subprocess.Popen([venv / "bin" / "gpuswarm", "node", "start", "--coordinator", lab.url, "--state-dir",
                                 str(tmp_path / "node"), "--cpu", "--no-mesh"], cwd=tmp_path,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            lab.wait_for_nodes(1, timeout=120)
        finally:
            node.send_signal(signal.SIGTERM)
            _, stderr = node.communicate(timeout=60)
        assert node.returncode == 0, stderr[-2000:]
        assert "registered as" in stderr
    finally:
        lab.stop()
