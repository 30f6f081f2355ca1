"""Heartbeat load on a real coordinator process: throughput and latency percentiles, for scripts/bench/market.py.

Starts `gpuswarm coordinator serve` (its own process, with the given database), registers `nodes` signed nodes,
pre-signs every heartbeat (fresh nonce each, so none is a replay) so that the load generator spends its time on
HTTP rather than Ed25519, then keeps `concurrency` requests in flight for `seconds` and records each latency.
"""

from __future__ import annotations

import asyncio
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _load(url: str, nodes: int, seconds: float, concurrency: int) -> dict:
    identities = [Identity(Ed25519PrivateKey.generate()) for _ in range(nodes)]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:
        for ident in identities:
            reg = {"node_id": ident.node_id, "resources": {"gpus": [], "cpu_cores": 4, "ram_gb": 8.0},
                   "software_version": "bench"}
            async with session.post(url + "/v1/nodes/register",
                                    json=ident.sign("register", reg).model_dump(mode="json")) as r:
                if r.status != 200:
                    raise RuntimeError(f"registration failed: {r.status} {await r.text()}")
        budget = int(seconds * 6000) + concurrency  # more than the coordinator can take in `seconds`
        bodies = [json.dumps(ident.sign("heartbeat", {"node_id": ident.node_id, "state": "idle"})
                             .model_dump(mode="json")).encode()
                  for i in range(budget) for ident in (identities[i % nodes],)]
        latencies: list[float] = []
        errors = 0
        cursor = 0
        deadline = time.perf_counter() + seconds

        async def worker() -> None:
            nonlocal cursor, errors
            while time.perf_counter() < deadline and cursor < len(bodies):
                body = bodies[cursor]
                cursor += 1
                t0 = time.perf_counter()
                async with session.post(url + "/v1/nodes/heartbeat", data=body,
                                        headers={"Content-Type": "application/json"}) as r:
                    await r.read()
                    if r.status != 200:
                        errors += 1
                latencies.append(time.perf_counter() - t0)

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    return {"requests": len(latencies), "errors": errors, "per_second": len(latencies) / elapsed,
            "p50_ms": 1000 * statistics.median(latencies), "p99_ms": 1000 * _percentile(latencies, 0.99)}


def run(database_url: str | None, *, nodes: int = 200, seconds: float = 10.0, concurrency: int = 32) -> dict:
    """Start a coordinator on `database_url` (None: SQLite in a temporary dir), load it, stop it."""
    with tempfile.TemporaryDirectory() as tmp:
        port = _free_port()
        env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
        if database_url:
            env["DATABASE_URL"] = database_url
        log = open(Path(tmp) / "coordinator.log", "wb")
        proc = subprocess.Popen([sys.executable, "-m", "gpuswarm.cli", "coordinator", "serve", "--port", str(port),
                                 "--data-dir", str(Path(tmp) / "data"), "--log-level", "warning"],
                                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 60
            while True:
                try:
                    with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                        break
                except OSError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"coordinator did not start; see {log.name}") from None
                    time.sleep(0.2)
            return asyncio.run(_load(url, nodes, seconds, concurrency))
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
            log.close()


if __name__ == "__main__":
    print(run(sys.argv[1] if len(sys.argv) > 1 else None, seconds=5.0))
