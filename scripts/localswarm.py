"""A local swarm lab: one real coordinator process and N real node daemons on this machine.

Used by scripts/demo and by the integration tests. Each process runs in its own session (process group), so a
node can be killed whole, with its training process and p2p daemons, as if its machine died; and `stop()` takes
every group down, politely first, even after a failure or Ctrl-C.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from gpuswarm.client.api import ApiError, SyncClient
from gpuswarm.proto.api import JobInfo, NodeInfo


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (from /proc: no psutil in the product's dependencies)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


class LocalSwarm:
    def __init__(self, root: Path, *, python: str = sys.executable, node_timeout: float = 10.0,
                 settle_grace: float = 10.0):
        self.root = root
        self.python = python
        self.node_timeout = node_timeout
        self.settle_grace = settle_grace
        self.ports = [free_port()]
        self.url = f"http://127.0.0.1:{self.ports[0]}"  # after add_coordinator: every coordinator's, comma-separated
        self.coordinators: dict[int, subprocess.Popen] = {}
        self._dht_peers: list[str] = []
        self.client = SyncClient(self.url)
        self.logs = root / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.nodes: dict[int, subprocess.Popen] = {}

    def _spawn(self, name: str, *args: str, env: dict | None = None) -> subprocess.Popen:
        env = os.environ | {"GPUSWARM_TORCH_THREADS": "1", "PYTHONUNBUFFERED": "1"} | (env or {})
        with open(self.logs / f"{name}.log", "ab") as log:
            return subprocess.Popen([self.python, "-m", "gpuswarm.cli", *args], stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=env, start_new_session=True)

    def start_coordinator(self, *extra: str, timeout: float = 60.0) -> None:
        self._coordinator_args = extra
        self.restart_coordinator(timeout=timeout)
        self.admin = SyncClient(self.url, token=(self.root / "coordinator" / "admin.token").read_text().strip())
        self.client = self.new_owner("swarm-owner")

    def restart_coordinator(self, index: int = 0, timeout: float = 60.0) -> None:
        """(Re)start coordinator `index` on its port, data directory and arguments."""
        data_dir = self.root / ("coordinator" if index == 0 else f"coordinator-{index}")
        extra = () if index == 0 else ("--blob-dir", str(self.root / "coordinator" / "blobs"),
                                       *(f"--dht-initial-peer={m}" for m in self._dht_peers[:1]))
        process = self._spawn(f"coordinator-{index}" if index else "coordinator", "coordinator", "serve",
                              "--port", str(self.ports[index]), "--data-dir", str(data_dir),
                              "--node-timeout", str(self.node_timeout), "--settle-grace", str(self.settle_grace),
                              *self._coordinator_args, *extra)
        self.coordinators[index] = process
        api = SyncClient(f"http://127.0.0.1:{self.ports[index]}")
        self.wait(lambda: self._healthy(api), timeout, f"coordinator {index} to answer", process)

    def add_coordinator(self, timeout: float = 60.0) -> int:
        """Another coordinator of the same database (PostgreSQL: give start_coordinator a --database-url), sharing
        the first one's blob store, admin token and DHT. Every client and node started afterwards is given all
        the coordinators' URLs and fails over between them."""
        index = len(self.ports)
        self.ports.append(free_port())
        self._dht_peers = SyncClient(self.url.split(",")[0]).dht().initial_peers
        data_dir = self.root / f"coordinator-{index}"
        data_dir.mkdir(parents=True, exist_ok=True)
        (data_dir / "admin.token").write_text((self.root / "coordinator" / "admin.token").read_text())
        self.restart_coordinator(index, timeout)
        self.url = ",".join(f"http://127.0.0.1:{port}" for port in self.ports)
        self.admin = SyncClient(self.url, token=self.admin.api.token)
        self.client = SyncClient(self.url, token=self.client.api.token)
        return index

    def leader(self) -> int | None:
        """The index of the coordinator that says it leads, if one does."""
        for index, port in enumerate(self.ports):
            with contextlib.suppress(ApiError):
                if self.coordinators.get(index) and SyncClient(f"http://127.0.0.1:{port}", timeout=2).health().leader:
                    return index
        return None

    def kill_coordinator(self, index: int = 0, sig: int = signal.SIGKILL) -> None:
        """Kill a coordinator's process group (its DHT's p2p daemon included), as if its machine died."""
        process = self.coordinators.pop(index)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        process.wait(timeout=30)

    @property
    def coordinator(self) -> subprocess.Popen | None:
        return self.coordinators.get(0)

    def new_owner(self, name: str, credits: float = 1000.0) -> SyncClient:
        """A job owner's account (through the admin API) and a client that acts as that owner."""
        owner = self.admin.create_owner(name, credits)
        return SyncClient(self.url, token=owner.token)

    @staticmethod
    def _healthy(api: SyncClient) -> bool:
        with contextlib.suppress(ApiError):
            return api.health().ok
        return False

    def start_node(self, index: int, price: float = 0.0, *extra: str, env: dict | None = None) -> subprocess.Popen:
        self.nodes[index] = self._spawn(f"node-{index}", "node", "start", "--coordinator", self.url,
                                        "--state-dir", str(self.root / f"node-{index}"), "--cpu", "--no-mesh",
                                        "--price", str(price), *extra, env=env)
        return self.nodes[index]

    def submit_file(self, path: Path) -> JobInfo:
        """Submit a job file as its owner would: `gpuswarm job submit` packs and uploads its code and data."""
        result = subprocess.run([self.python, "-m", "gpuswarm.cli", "job", "submit", str(path), "-c", self.url,
                                 "--token", self.client.token, "--json"], capture_output=True, text=True, timeout=600)
        if result.returncode != 0:
            raise RuntimeError(f"job submit {path} failed:\n{result.stdout}{result.stderr}")
        return JobInfo.model_validate_json(result.stdout)

    def node_id(self, index: int) -> str:
        from gpuswarm.node.identity import load_or_create

        return load_or_create(self.root / f"node-{index}").node_id

    def wait_for_nodes(self, count: int, timeout: float = 90.0) -> list[NodeInfo]:
        nodes: list[NodeInfo] = []

        def enough() -> bool:
            nonlocal nodes
            nodes = [n for n in self.client.nodes() if n.online]
            return len(nodes) >= count

        self.wait(enough, timeout, f"{count} nodes to register")
        return nodes

    def kill_node(self, index: int, sig: int = signal.SIGKILL) -> None:
        """Signal a node's process groups: the daemon's, and its training processes' (each leads its own). With
        SIGKILL that is the machine dying; with SIGTERM, what systemd does to a service's control group."""
        leader = self.nodes[index].pid
        for pgid in [leader, *{os.getpgid(p) for p in descendants(leader)} - {leader}]:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, sig)
        self.nodes[index].wait(timeout=30)

    def wait(self, condition, timeout: float, what: str, process: subprocess.Popen | None = None) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if condition():
                return
            if process is not None and process.poll() is not None:
                raise RuntimeError(f"process exited with {process.returncode} while waiting for {what}; "
                                   f"see {self.logs}")
            time.sleep(0.5)
        raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}; see {self.logs}")

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM the nodes (so they can say goodbye while the coordinator still listens), then the coordinator;
        SIGKILL every group afterwards, since a group may outlive its leader (a p2p daemon)."""
        for group in (list(self.nodes.values()), list(self.coordinators.values())):
            for p in group:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
            deadline = time.monotonic() + timeout
            for p in group:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=max(0.1, deadline - time.monotonic()))
        for p in [*self.nodes.values(), *self.coordinators.values()]:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=5)

    stop_all = stop

    def __enter__(self) -> LocalSwarm:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def log_tail(self, name: str, lines: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join((self.logs / f"{name}.log").read_text(errors="replace").splitlines()[-lines:])
        return ""

    def worker_log(self, index: int, job_id: str) -> str:
        """What node `index`'s training processes for the job logged (every assignment's)."""
        return "".join(p.read_text(errors="replace") for p in (self.root / f"node-{index}" / "jobs").glob(
            f"{job_id}-*/worker.log"))
