"""A mesh swarm lab: the real coordinator and node daemons (mesh on) in network namespaces built by netlab.

Namespace 0 runs `gpuswarm coordinator serve`, namespaces 1..N run `gpuswarm node start` with wireguard-go.
Used by tests/netns and scripts/bench/mesh.py; needs root and wireguard-go.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import netlab

PORT = 8470


class MeshSwarm:
    def __init__(self, lab: netlab.NetLab, root: Path):
        self.lab, self.root = lab, root
        self.url = f"http://{lab.addresses[0]}:{PORT}"
        self.procs: dict[int, subprocess.Popen] = {}

    def _spawn(self, i: int, name: str, *args: str, **popen) -> subprocess.Popen:
        env = os.environ | {"GPUSWARM_TORCH_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / f"{name}.log", "ab") as log:
            return self.lab.popen(i, [sys.executable, "-m", "gpuswarm.cli", *args], stdout=log,
                                  stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True,
                                  **popen)

    def start_coordinator(self) -> None:
        a0 = self.lab.addresses[0]
        self.procs[0] = self._spawn(0, "coordinator", "coordinator", "serve", "--host", a0, "--port", str(PORT),
                                    "--data-dir", str(self.root / "coordinator"), "--dht-host", a0,
                                    "--node-timeout", "6", "--settle-grace", "10")
        wait_for(lambda: self.cli(0, "nodes", check=False) is not None, 60, "the coordinator")
        owner = self.lab.exec(0, [sys.executable, "-m", "gpuswarm.cli", "coordinator", "create-owner", "mesh-owner",
                                  "--credits", "1000", "--data-dir", str(self.root / "coordinator"), "--json"],
                              check=True, timeout=60)
        self.token = json.loads(owner.stdout)["token"]

    def start_node(self, i: int, price: float = 0.0, *extra: str, **popen) -> None:
        """Start node i's daemon; `popen` goes to subprocess.Popen (e.g. a preexec_fn that joins a cgroup)."""
        self.procs[i] = self._spawn(i, f"node-{i}", "node", "start", "-c", self.url, "--state-dir",
                                    str(self.state_dir(i)), "--cpu", "--listen-port", "51820", "--price", str(price),
                                    *extra, **popen)

    def submit_file(self, path: Path) -> dict:
        """Submit a job file as its owner would, from the coordinator's namespace (`job submit` packs and uploads)."""
        return self.cli(0, "job", "submit", str(path), "--token", self.token)

    def stop(self, i: int) -> None:
        proc = self.procs.pop(i)
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(40)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def state_dir(self, i: int) -> Path:
        return self.root / f"node-{i}"

    def mesh_state(self, i: int) -> dict | None:
        try:
            return json.loads((self.state_dir(i) / "mesh.json").read_text())
        except (OSError, ValueError):
            return None

    def peers_of(self, i: int) -> dict:
        state = self.mesh_state(i)
        return state["peers"] if state else {}

    def wg_key(self, i: int) -> str:
        from gpuswarm.mesh.keys import load_or_create_private_key

        return load_or_create_private_key(self.state_dir(i) / "wireguard.key").public_key

    def cli(self, i: int, *args: str, check: bool = True):
        result = self.lab.exec(i, [sys.executable, "-m", "gpuswarm.cli", *args, "-c", self.url, "--json"],
                               check=False, timeout=60)
        if result.returncode != 0:
            if check:
                raise AssertionError(f"gpuswarm {' '.join(args)} failed: {result.stderr}")
            return None
        return json.loads(result.stdout)

    def pings(self, i: int, address: str, attempts: int = 5) -> bool:
        return any(self.lab.ping(i, address, wait_s=1.0) for _ in range(attempts))

    def log(self, name: str) -> str:
        return (self.root / f"{name}.log").read_text(errors="replace")

    def log_tail(self, name: str, lines: int = 30) -> str:
        try:
            return "\n".join(self.log(name).splitlines()[-lines:])
        except OSError:
            return ""

    @property
    def client(self) -> CliClient:
        return CliClient(self)

    def follow_job(self, job_id: str, interval: float = 0.5, unreachable_s: float = 60.0) -> Iterator[dict]:
        """The job's detail at every look until it has ended (the last one), from one `gpuswarm job status --follow
        --json` in the coordinator's namespace. A CLI process per look (`client.job`) costs about 0.9 CPU-s: at a
        look a second, half a core taken from the nodes that a benchmark or the demo is timing. The looks stop early
        when the coordinator stays unreachable for `unreachable_s`; the watcher says why in follow.log."""
        argv = [sys.executable, "-m", "gpuswarm.cli", "job", "status", job_id, "--follow", "--json", "--interval",
                str(interval), "--timeout", str(unreachable_s), "-c", self.url, "--token", self.token]
        with open(self.root / "follow.log", "ab") as log:
            process = self.lab.popen(0, argv, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)
        try:
            for line in process.stdout:
                yield json.loads(line)
        finally:
            if process.poll() is None:
                process.kill()
            process.wait()

    def wait_for_nodes(self, count: int, timeout: float = 120.0) -> list[dict]:
        return wait_for(lambda: len(n := [x for x in self.cli(0, "nodes") if x["online"]]) >= count and n,
                        timeout, f"{count} nodes to register", interval=1.0)

    def stop_all(self) -> None:
        for i in sorted(self.procs, reverse=True):  # nodes first, the coordinator (0) last
            self.stop(i)


def wait_for(condition, timeout: float, what: str, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


class CliClient:
    """The coordinator API as the demo uses it, through the product's CLI inside the coordinator's namespace
    (the host's own namespace has no route into the lab)."""

    def __init__(self, swarm: MeshSwarm):
        self.swarm = swarm

    def submit_job(self, spec: dict) -> dict:
        path = self.swarm.root / "job.toml"
        path.write_text(to_toml(spec))
        return self.swarm.cli(0, "job", "submit", str(path), "--token", self.swarm.token)

    def job(self, job_id: str) -> dict:
        return self.swarm.cli(0, "job", "status", job_id, "--token", self.swarm.token)

    def job_statement(self, job_id: str) -> dict:
        return self.swarm.cli(0, "job", "statement", job_id, "--token", self.swarm.token)

    def nodes(self) -> list[dict]:
        return self.swarm.cli(0, "nodes")

    def download_artifact(self, job_id: str, name: str, dest: Path) -> str:
        return self.swarm.cli(0, "job", "download", job_id, "-o", str(dest), "--token", self.swarm.token)["sha256"]


def to_toml(spec: dict) -> str:
    """The flat job specs the demo writes: scalars at the top, one level of tables."""
    def value(v) -> str:
        return json.dumps(v) if isinstance(v, str) else str(v).lower() if isinstance(v, bool) else str(v)

    lines = [f"{k} = {value(v)}" for k, v in spec.items() if not isinstance(v, dict)]
    for k, table in spec.items():
        if isinstance(table, dict):
            lines += ["", f"[{k}]", *(f"{kk} = {value(vv)}" for kk, vv in table.items())]
    return "\n".join(lines) + "\n"
