"""Heartbeat load on a real coordinator process: throughput, latency percentiles and the CPU each side spends, for
scripts/bench/market.py.

Starts `gpuswarm coordinator serve` (its own process, with the given database; on PostgreSQL optionally several
coordinators on the one database, as a deployment scales out), registers `nodes` signed nodes, pre-signs every
heartbeat (fresh nonce each, so none is a replay) and pre-builds each whole HTTP request, then keeps `concurrency`
keep-alive connections busy for `seconds`, one request in flight on each (spread evenly over the coordinators),
and records each latency.

The load client shares the machine's cores with the coordinator, so it is kept lean: a bare asyncio protocol that
writes ready-made request bytes and reads just the status line and Content-Length of each answer (no HTTP client
library, no JSON, no signing while timed). Both sides' CPU time over the timed window is reported (the coordinator's
whole process group, its DHT child included; all of them when there are several), per heartbeat, and the PostgreSQL
server's processes' (`db_cpu_us`; 0 on SQLite, which runs inside the coordinator): on a shared machine those are
steadier than the rate.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from gpuswarm.node.identity import Identity

TICKS = os.sysconf("SC_CLK_TCK")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _flag(name: str, value: bool | None) -> list[str]:
    return [] if value is None else [f"--{'' if value else 'no-'}{name}"]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _cpu(session_ids: set[int], command: bytes) -> tuple[float, float]:
    """CPU seconds (user + system) of every live process in the sessions `session_ids` (the coordinators' groups),
    and of every live process named `command` (the database server's)."""
    in_sessions = named = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                name, fields = f.read().rsplit(b")", 1)
        except OSError:
            continue
        fields = fields.split()  # from the state on: state ppid pgrp session ... utime stime
        ticks = int(fields[11]) + int(fields[12])
        if int(fields[3]) in session_ids:
            in_sessions += ticks
        elif name.split(b"(", 1)[-1] == command:
            named += ticks
    return in_sessions / TICKS, named / TICKS


class _Connection(asyncio.Protocol):
    """One keep-alive connection: sends the next ready request as soon as the answer to the last one is in."""

    def __init__(self, load: _Load):
        self.load, self.buffer, self.started = load, b"", 0.0
        self.transport: asyncio.Transport | None = None
        self.closed = load.loop.create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def send(self) -> None:
        request = self.load.next_request()
        if request is None:
            self.transport.close()
            return
        self.started = time.perf_counter()
        self.transport.write(request)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            return
        head = self.buffer[:end].lower()
        at = head.find(b"\r\ncontent-length:")
        if at < 0:
            raise RuntimeError(f"an answer without Content-Length: {head[:200]!r}")
        line_end = head.find(b"\r\n", at + 2)
        length = int(head[at + 17:line_end if line_end > 0 else len(head)])
        if len(self.buffer) < end + 4 + length:
            return
        self.load.done(time.perf_counter() - self.started, head[9:12] == b"200")
        self.buffer = self.buffer[end + 4 + length:]
        self.send()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(exc)


class _Load:
    def __init__(self, requests: list[bytes], deadline: float):
        self.loop = asyncio.get_running_loop()
        self.requests, self.cursor, self.deadline = requests, 0, deadline
        self.latencies: list[float] = []
        self.errors = 0

    def next_request(self) -> bytes | None:
        if self.cursor >= len(self.requests) or time.perf_counter() >= self.deadline:
            return None
        self.cursor += 1
        return self.requests[self.cursor - 1]

    def done(self, latency: float, ok: bool) -> None:
        self.latencies.append(latency)
        if not ok:
            self.errors += 1


async def _register(url: str, identities: list[Identity]) -> None:
    async with aiohttp.ClientSession() as session:
        for ident in identities:
            reg = {"node_id": ident.node_id, "resources": {"gpus": [], "cpu_cores": 4, "ram_gb": 8.0},
                   "software_version": "bench"}
            async with session.post(url + "/v1/nodes/register",
                                    json=ident.sign("register", reg).model_dump(mode="json")) as r:
                if r.status != 200:
                    raise RuntimeError(f"registration failed: {r.status} {await r.text()}")


async def _load(ports: list[int], nodes: int, seconds: float, concurrency: int, session_ids: set[int]) -> dict:
    identities = [Identity(Ed25519PrivateKey.generate()) for _ in range(nodes)]
    port = ports[0]
    await _register(f"http://127.0.0.1:{port}", identities)
    budget = int(seconds * 8000) + concurrency  # more than the coordinator can take in `seconds`
    head = (f"POST /v1/nodes/heartbeat HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            "Content-Length: {}\r\n\r\n")
    requests = []
    for i in range(budget):
        ident = identities[i % nodes]
        body = json.dumps(ident.sign("heartbeat", {"node_id": ident.node_id, "state": "idle"})
                          .model_dump(mode="json")).encode()
        requests.append(head.format(len(body)).encode() + body)
    loop = asyncio.get_running_loop()
    load = _Load(requests, deadline=0.0)
    connections = [(await loop.create_connection(lambda: _Connection(load), "127.0.0.1", ports[k % len(ports)]))[1]
                   for k in range(concurrency)]
    (server_cpu, db_cpu), client_cpu = _cpu(session_ids, b"postgres"), time.process_time()
    started = time.perf_counter()
    load.deadline = started + seconds
    for conn in connections:
        conn.send()
    await asyncio.gather(*(c.closed for c in connections))
    elapsed = time.perf_counter() - started
    (server_after, db_after), client_cpu = _cpu(session_ids, b"postgres"), time.process_time() - client_cpu
    server_cpu, db_cpu = server_after - server_cpu, db_after - db_cpu
    n = len(load.latencies)
    if load.cursor == budget:
        raise RuntimeError(f"all {budget} pre-built heartbeats were sent before the deadline: raise the budget")
    return {"requests": n, "errors": load.errors, "per_second": n / elapsed,
            "p50_ms": 1000 * statistics.median(load.latencies), "p99_ms": 1000 * _percentile(load.latencies, 0.99),
            "server_cpu_us": 1e6 * server_cpu / n, "client_cpu_us": 1e6 * client_cpu / n, "db_cpu_us": 1e6 * db_cpu / n,
            "server_cores": server_cpu / elapsed, "client_cores": client_cpu / elapsed, "db_cores": db_cpu / elapsed}


# Runs the CLI with another coordinator/heartbeats.py in place of the installed one (an older version, to compare).
_WITH_HEARTBEATS = """
import sys, types
path = sys.argv.pop(1)
module = sys.modules["gpuswarm.coordinator.heartbeats"] = types.ModuleType("gpuswarm.coordinator.heartbeats")
module.__file__ = path
exec(compile(open(path).read(), path, "exec"), module.__dict__)
from gpuswarm.cli import main
sys.argv[0] = "gpuswarm"
main()
"""


def run(database_url: str | None, *, nodes: int = 200, seconds: float = 10.0, concurrency: int = 32,
        event_loop: str = "auto", heartbeats_module: Path | None = None, coordinators: int = 1,
        signature_process: bool | None = None) -> dict:
    """Start `coordinators` coordinators on `database_url` (None: SQLite in a temporary dir, which takes one
    only), load them, stop them.

    `event_loop` is `coordinator serve --event-loop`, `signature_process` its `--[no-]signature-process` (None: its
    default); `heartbeats_module` a file that replaces coordinator/heartbeats.py in the coordinators' processes
    (None: the installed one)."""
    if coordinators > 1 and not database_url:
        raise ValueError("several coordinators share a PostgreSQL database; SQLite takes one")
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
        if database_url:
            env["DATABASE_URL"] = database_url
        launcher = (["-m", "gpuswarm.cli"] if heartbeats_module is None
                    else ["-c", _WITH_HEARTBEATS, str(heartbeats_module)])
        ports, procs = [], []
        for k in range(coordinators):
            port, data = _free_port(), Path(tmp) / f"data{k}"
            log = stack.enter_context(open(Path(tmp) / f"coordinator{k}.log", "wb"))
            proc = subprocess.Popen([sys.executable, *launcher, "coordinator", "serve", "--port", str(port),
                                     "--data-dir", str(data), "--log-level", "warning", "--event-loop", event_loop,
                                     *_flag("signature-process", signature_process)],
                                    stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            stack.callback(_stop, proc)
            _wait_listening(proc, port, log.name)
            ports.append(port)
            procs.append(proc)
        return asyncio.run(_load(ports, nodes, seconds, concurrency, {p.pid for p in procs}))


def _wait_listening(proc: subprocess.Popen, port: int, log: str) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = Path(log).read_text(errors="replace")[-2000:]  # the file goes with the temporary dir
                raise RuntimeError(f"coordinator did not start; its log ends:\n{tail}") from None
            time.sleep(0.2)


def _stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


if __name__ == "__main__":
    print(run(sys.argv[1] if len(sys.argv) > 1 else None, seconds=5.0))
