"""`gpuswarm coordinator serve` stops promptly on SIGTERM while mesh nodes hold their peer-list long-polls open:
the polls are answered (not cut off), and the stop waits out neither them nor the DHT process's slow exit.

A real coordinator process (its DHT peer and p2pd included) and real HTTP.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
from gpuswarm.mesh.keys import KeyPair
from test_api import new_identity, registration, signed

STOP_BOUND = 4.0  # seconds; before: 13 s with two long-polls (5 s shutdown timeout, 3 s DHT grace, the rest)


async def wait_listening(proc: subprocess.Popen, port: int, log: Path) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            await asyncio.sleep(0.2)


async def test_sigterm_answers_the_mesh_long_polls_and_stops_within_the_bound(tmp_path: Path, unused_tcp_port: int):
    port, log = unused_tcp_port, tmp_path / "coordinator.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "gpuswarm.cli", "coordinator", "serve", "--port", str(port),
                                 "--data-dir", str(tmp_path / "data"), "--log-level", "info"],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        await wait_listening(proc, port, log)
        url = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
            polls = []
            for _ in range(2):
                identity, wg = new_identity(), KeyPair.generate()
                mesh = {"public_key": wg.public_key, "listen_port": 51820}
                async with http.post(url + "/v1/nodes/register",
                                     json=signed(identity, "register", registration(identity, mesh=mesh))) as r:
                    assert r.status == 200, await r.text()
                    version = (await r.json())["mesh"]["version"]
                # A `since` far ahead: nothing will pass it, so only the stop can answer this poll.
                body = signed(identity, "mesh_poll", {"node_id": identity.node_id, "since": version + 10**9})
                polls.append(asyncio.create_task(http.post(url + "/v1/mesh/peers", json=body)))
            await asyncio.sleep(1.0)
            assert not any(p.done() for p in polls)
            started = time.monotonic()
            os.killpg(proc.pid, signal.SIGTERM)
            while proc.poll() is None and time.monotonic() - started < 30:
                await asyncio.sleep(0.05)
            took = time.monotonic() - started
            answers = await asyncio.gather(*polls)
        assert proc.returncode == 0, log.read_text()[-3000:]
        assert took < STOP_BOUND, f"stopped in {took:.1f} s\n{log.read_text()[-3000:]}"
        for answer in answers:
            assert answer.status == 200
            assert version <= (await answer.json())["version"] < version + 10**9  # the current one, not the awaited
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
