"""The systemd units in packaging/systemd: `systemd-analyze verify` finds nothing to say about them (with
ExecStart pointed at this checkout's real `gpuswarm`), their hardening is what docs/operations.md promises, and the
command lines they run are ones the CLI accepts."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
UNITS = ROOT / "packaging" / "systemd"
INSTALLED = "/opt/gpuswarm/bin/gpuswarm"
GPUSWARM = Path(sys.executable).with_name("gpuswarm")


@pytest.fixture(autouse=True)
def systemd_analyze() -> None:
    """Skipped where systemd-analyze is missing, with the reason; CI sets GPUSWARM_REQUIRE_SYSTEMD, so there the
    tests fail instead of silently not running."""
    if shutil.which("systemd-analyze") is None:
        if os.environ.get("GPUSWARM_REQUIRE_SYSTEMD"):
            pytest.fail("GPUSWARM_REQUIRE_SYSTEMD is set, but systemd-analyze is not installed", pytrace=False)
        pytest.skip("systemd-analyze is not installed (.ci/run installs systemd)")


def verify(unit: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    local = tmp_path / unit.name
    local.write_text(unit.read_text().replace(INSTALLED, str(GPUSWARM)))
    return subprocess.run(["systemd-analyze", "verify", str(local)], capture_output=True, text=True, timeout=60)


def service(unit: Path) -> dict[str, list[str]]:
    """The [Service] section's settings (a key may repeat, as DeviceAllow does)."""
    values: dict[str, list[str]] = {}
    for line in unit.read_text().split("[Service]", 1)[1].split("[Install]", 1)[0].splitlines():
        if "=" in line and not line.lstrip().startswith("#"):
            key, value = line.split("=", 1)
            values.setdefault(key.strip(), []).append(value.strip())
    return values


@pytest.mark.parametrize("name", ["gpuswarm-node.service", "gpuswarm-coordinator.service"])
def test_each_unit_verifies_cleanly(name, tmp_path):
    result = verify(UNITS / name, tmp_path)
    assert result.returncode == 0 and result.stdout == "" and result.stderr == "", result


def test_a_unit_with_a_mistake_does_not_verify_cleanly(tmp_path):
    broken = tmp_path / "broken" / "gpuswarm-node.service"
    broken.parent.mkdir()
    broken.write_text((UNITS / "gpuswarm-node.service").read_text().replace("ProtectSystem=", "ProtectSystm="))
    assert "Unknown key" in verify(broken, tmp_path).stderr


def test_the_units_are_hardened_as_documented():
    node, coordinator = service(UNITS / "gpuswarm-node.service"), service(UNITS / "gpuswarm-coordinator.service")
    for unit in (node, coordinator):
        assert unit["NoNewPrivileges"] == ["yes"] and unit["ProtectSystem"] == ["strict"]
        assert unit["ProtectHome"] == ["yes"] and unit["PrivateTmp"] == ["yes"]
    assert node["User"] == ["gpuswarm"] and coordinator["DynamicUser"] == ["yes"]
    # The node: CAP_NET_ADMIN for the WireGuard mesh and nothing more; the TUN device and the GPUs only.
    assert node["CapabilityBoundingSet"] == node["AmbientCapabilities"] == ["CAP_NET_ADMIN"]
    assert node["DevicePolicy"] == ["closed"] and "/dev/net/tun rw" in node["DeviceAllow"]
    assert coordinator["CapabilityBoundingSet"] == [""] and coordinator["PrivateDevices"] == ["yes"]


@pytest.mark.parametrize("name", ["gpuswarm-node.service", "gpuswarm-coordinator.service"])
def test_the_command_each_unit_runs_is_one_the_cli_accepts(name):
    (command,) = service(UNITS / name)["ExecStart"]
    argv = shlex.split(command)
    assert argv[0] == INSTALLED
    result = subprocess.run([str(GPUSWARM), *argv[1:], "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr  # an unknown option would fail before --help is handled
