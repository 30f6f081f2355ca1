"""`gpuswarm node self-test` and `node status` as an operator runs them (subprocesses), against a real coordinator
process and a real node daemon: every check gives a verdict, and a failed one makes the exit status 1; the status
shows what the coordinator and the state directory say."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from localswarm import LocalSwarm

ROOT = Path(__file__).resolve().parents[2]


def node(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpuswarm.cli", "node", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "COLUMNS": "200"})


def self_test(*args: str) -> tuple[int, dict]:
    result = node("self-test", "--json", *args)
    return result.returncode, json.loads(result.stdout)


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    lab = LocalSwarm(tmp_path_factory.mktemp("lab"))
    lab.start_coordinator()
    yield lab
    lab.stop()


@pytest.fixture(scope="module")
def coordinator(lab):
    return lab.url


def test_a_ready_cpu_node_passes_and_says_what_it_checked(coordinator, tmp_path):
    code, report = self_test("--coordinator", coordinator, "--state-dir", str(tmp_path / "node"), "--cpu",
                             "--no-mesh", "--builtin-only")
    verdicts = {c["name"]: c["verdict"] for c in report["checks"]}
    assert list(verdicts) == ["gpu", "challenge", "disk", "coordinator", "mesh", "sandbox"]
    assert code == 0 and report["ok"], report
    assert verdicts["gpu"] == verdicts["challenge"] == verdicts["disk"] == verdicts["coordinator"] == "pass"
    assert verdicts["mesh"] == "warn"  # off: unencrypted, said so
    details = {c["name"]: c["detail"] for c in report["checks"]}
    assert "s bound" in details["challenge"] and "version" in details["coordinator"]


def test_an_unreachable_coordinator_and_a_full_disk_fail_it(tmp_path):
    code, report = self_test("--coordinator", "http://127.0.0.1:9", "--state-dir", str(tmp_path / "node"), "--cpu",
                             "--no-mesh", "--builtin-only", "--cache-gb", "1000000")
    verdicts = {c["name"]: c["verdict"] for c in report["checks"]}
    assert code == 1 and not report["ok"]
    assert verdicts["coordinator"] == "fail" and verdicts["disk"] == "fail"
    assert verdicts["challenge"] == "pass"  # the others still ran


def test_status_shows_what_the_coordinator_and_the_state_directory_say(lab):
    lab.start_node(0, 0.7)
    lab.wait_for_nodes(1)
    state_dir = str(lab.root / "node-0")
    result = node("status", "--state-dir", state_dir, "--coordinator", lab.url, "--json")
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert info["node_id"] == lab.node_id(0)
    c = info["coordinator"]
    assert c["online"] and c["price_per_gpu_hour"] == 0.7 and c["jobs"] == []
    assert c["balance"] == 0.0 and c["earnings"] == []
    assert "no mesh.json" in info["mesh"]["error"] and info["gpus"] == []
    text = node("status", "--state-dir", state_dir, "--coordinator", lab.url)
    assert lab.node_id(0) in text.stdout and "online" in text.stdout and "balance: 0.000000 credits" in text.stdout

    elsewhere = node("status", "--state-dir", state_dir, "--coordinator", "http://127.0.0.1:9", "--json")
    assert json.loads(elsewhere.stdout)["coordinator"]["error"].startswith("cannot reach the coordinator")
    never = node("status", "--state-dir", str(lab.root / "never"))
    assert never.returncode == 1 and "never started there" in never.stderr
