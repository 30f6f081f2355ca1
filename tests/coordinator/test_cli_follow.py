"""`gpuswarm job status ID --follow` against the real coordinator app over real HTTP.

A registered test identity plays the node: its signed heartbeats move the job's progress, and its signed final
artifact completes the job (or the owner cancels it). The real CLI runs in a subprocess with its output in a pipe,
so it prints one plain line per change; the test reads those lines as they come. SQLite only: the API beneath runs
on both databases in test_api.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import sys
import time
from pathlib import Path

import pytest
from aiohttp.test_utils import TestServer
from gpuswarm.coordinator.app import create_app
from gpuswarm.coordinator.config import CoordinatorConfig
from test_api import (
    SharedServerClient,
    artifact_request,
    claim,
    new_owner_token,
    register,
    round_report,
    signed,
    submit,
    wait_for_assignment,
)

ROOT = Path(__file__).resolve().parents[2]
LINE_WAIT = 60.0  # only a guard against a hang: a line that never comes fails the test instead of stalling it
PROGRESS = re.compile(r"^\d\d:\d\d:\d\d (\w+) ")


@pytest.fixture
async def coordinator(tmp_path):
    """(owner's client, base URL, owner token) of a running coordinator app."""
    app = create_app(CoordinatorConfig(data_dir=tmp_path / "coordinator", start_dht=False, loop_interval=0.2,
                                       node_timeout=3600))
    async with TestServer(app) as server:
        token = await new_owner_token(server, app)
        async with SharedServerClient(server, headers={"Authorization": f"Bearer {token}"}) as client:
            yield client, str(server.make_url("")).rstrip("/"), token


class Follower:
    """`gpuswarm job status JOB --follow` in a subprocess, stdout and stderr pipes; collects what it prints."""

    def __init__(self, proc: asyncio.subprocess.Process):
        self.proc, self.lines = proc, []

    @classmethod
    async def start(cls, url: str, token: str, job_id: str, *extra: str) -> Follower:
        env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "TTY_COMPATIBLE")}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gpuswarm.cli", "job", "status", job_id, "--follow", "--interval", "0.2",
            "--coordinator", url, "--token", token, *extra, cwd=ROOT, env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        return cls(proc)

    async def until(self, predicate) -> str:
        """Read lines until one matches; return it."""
        while True:
            raw = await asyncio.wait_for(self.proc.stdout.readline(), LINE_WAIT)
            if not raw:
                raise AssertionError(f"follower ended before the expected line; it printed:\n{self.text()}\n"
                                     f"stderr: {(await self.proc.stderr.read()).decode()}")
            line = raw.decode().rstrip("\n")
            self.lines.append(line)
            if predicate(line):
                return line

    async def until_stderr(self, text: str) -> None:
        while text not in (await asyncio.wait_for(self.proc.stderr.readline(), LINE_WAIT)).decode():
            pass

    async def finish(self) -> tuple[int, str]:
        """Wait for the exit; return (exit code, stderr). Reads the rest of stdout into `lines`."""
        out, errors = await asyncio.wait_for(self.proc.communicate(), LINE_WAIT)
        self.lines += out.decode().splitlines()
        return self.proc.returncode, errors.decode()

    def text(self) -> str:
        return "\n".join(self.lines)

    def progress(self) -> list[str]:
        return [line for line in self.lines if PROGRESS.match(line) and " event: " not in line]


async def heartbeat(client, node, job_id: str, step: int, accuracy: float) -> None:
    progress = {"job_id": job_id, "epoch": step / 10, "global_step": step, "loss": 1 - accuracy,
                "accuracy": accuracy, "samples_per_second": 100.0 + step, "peers": 1}
    response = await client.post("/v1/nodes/heartbeat", json=signed(
        node, "heartbeat", {"node_id": node.node_id, "state": "training", "progress": [progress]}))
    assert response.status == 200, await response.text()


async def running_job(client, **spec) -> tuple[object, str]:
    node = await register(client)
    job_id = await submit(client, **spec)
    await wait_for_assignment(client, node, job_id)
    return node, job_id


async def test_follow_prints_each_step_and_exits_0_when_the_job_completes(coordinator):
    client, url, token = coordinator
    node, job_id = await running_job(client, stop={"max_epochs": 4})
    follower = await Follower.start(url, token, job_id)
    first = await follower.until(lambda line: PROGRESS.match(line) and " event: " not in line)
    assert first.split()[1:3] == ["running", "0%"] and " step 0 " in first and "epoch 0.00/4" in first
    for step, accuracy in ((3, 0.5), (6, 0.7), (9, 0.8)):  # a step moves at most 5 past the job's (no claims)
        await heartbeat(client, node, job_id, step, accuracy)
        line = await follower.until(lambda line, step=step: f" step {step} " in line)
        assert f"{step / 40:.0%}  epoch {step / 10:.2f}/4" in line and f"accuracy {accuracy:.4f}" in line
        assert f"samples/s {100 + step}" in line and "peers 1" in line and "nodes 1" in line
    # A solo round: the claim is credited, and the follower shows the samples.
    now = time.time()
    response = await client.post("/v1/rounds", json=round_report(
        node, job_id, [claim(node, job_id, 0, samples=640, window_start=now - 2, window_end=now)], solo=True))
    assert response.status == 201, await response.text()
    line = await follower.until(lambda line: "samples credited " in line)
    contributions = (await (await client.get(f"/v1/jobs/{job_id}")).json())["contributions"]
    assert contributions[0]["samples"] > 0  # capped at one round's worth, but credited
    assert f"samples credited {contributions[0]['samples']} " in line
    response = await client.put(f"/v1/jobs/{job_id}/artifacts/model.pt",
                                **artifact_request(node, job_id, b"weights", final=True, accuracy=0.93))
    assert response.status == 201, await response.text()
    code, errors = await follower.finish()
    assert code == 0, (follower.text(), errors)
    steps = [int(re.search(r" step (\d+) ", line).group(1)) for line in follower.progress()]
    assert steps[0] == 0 and steps[-1] == 9 and steps == sorted(steps) and {3, 6, 9} <= set(steps)
    assert follower.progress()[-1].split()[1:3] == ["completed", "100%"]
    assert any(line.endswith(f" event: completed: node {node.node_id} saved the final model (accuracy 0.93)")
               for line in follower.lines)
    assert follower.lines[-1] == f"job {job_id} completed: final accuracy 0.9300"
    assert "\x1b[" not in follower.text()
    # One line per change: no two progress lines in a row are the same apart from the clock and elapsed time.
    bodies = [re.sub(r"  elapsed \S+$", "", line.split(" ", 1)[1]) for line in follower.progress()]
    assert all(a != b for a, b in zip(bodies, bodies[1:], strict=False))


async def test_follow_exits_1_when_the_job_is_cancelled(coordinator):
    client, url, token = coordinator
    node, job_id = await running_job(client, stop={"target_accuracy": 0.9, "max_epochs": None})
    follower = await Follower.start(url, token, job_id)
    await heartbeat(client, node, job_id, 5, 0.45)
    line = await follower.until(lambda line: " step 5 " in line)
    assert "50%  accuracy 0.4500 >= 0.9" in line  # the stop rule is the accuracy target
    assert (await client.post(f"/v1/jobs/{job_id}/cancel")).status == 200
    code, errors = await follower.finish()
    assert code == 1, (follower.text(), errors)
    assert follower.lines[-1] == f"job {job_id} cancelled: final accuracy -"
    assert any(line.endswith(" event: cancelled by its owner") for line in follower.lines)


async def test_follow_json_prints_one_object_per_poll(coordinator):
    client, url, token = coordinator
    node, job_id = await running_job(client)
    follower = await Follower.start(url, token, job_id, "--json")
    await follower.until(lambda line: True)
    await heartbeat(client, node, job_id, 4, 0.6)
    await follower.until(lambda line: json.loads(line)["progress"]["global_step"] == 4)
    assert (await client.post(f"/v1/jobs/{job_id}/cancel")).status == 200
    code, errors = await follower.finish()
    assert code == 1, errors
    polls = [json.loads(line) for line in follower.lines]  # every line is one whole job object
    assert all(p["id"] == job_id and "assignments" in p for p in polls)
    assert [p["state"] for p in polls][-1] == "cancelled" and polls[0]["state"] == "running"


async def test_ctrl_c_stops_following_and_leaves_the_job_running(coordinator):
    client, url, token = coordinator
    _, job_id = await running_job(client)
    follower = await Follower.start(url, token, job_id)
    await follower.until(lambda line: PROGRESS.match(line) and " event: " not in line)
    follower.proc.send_signal(signal.SIGINT)
    code, errors = await follower.finish()
    assert code == 130, (follower.text(), errors)
    assert "stopped following; the job keeps running" in errors and "Traceback" not in errors
    assert (await (await client.get(f"/v1/jobs/{job_id}")).json())["state"] == "running"


async def test_follow_rides_out_a_coordinator_restart(tmp_path):
    """The coordinator goes away mid-job and comes back (same database, same port): the follower warns, keeps
    polling, and picks the job up again."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = CoordinatorConfig(data_dir=tmp_path / "coordinator", start_dht=False, loop_interval=0.2,
                               node_timeout=3600)
    app = create_app(config)
    server = TestServer(app, port=port)
    await server.start_server()
    try:
        token = await new_owner_token(server, app)
        async with SharedServerClient(server, headers={"Authorization": f"Bearer {token}"}) as client:
            node, job_id = await running_job(client)
            follower = await Follower.start(str(server.make_url("")).rstrip("/"), token, job_id)
            await follower.until(lambda line: " step 0 " in line)
    finally:
        await server.close()
    await follower.until_stderr("warning: cannot reach the coordinator")
    async with TestServer(create_app(config), port=port) as server:
        async with SharedServerClient(server, headers={"Authorization": f"Bearer {token}"}) as client:
            await heartbeat(client, node, job_id, 4, 0.5)
            await follower.until_stderr("coordinator reachable again")
            await follower.until(lambda line: " step 4 " in line)
            assert (await client.post(f"/v1/jobs/{job_id}/cancel")).status == 200
            code, errors = await follower.finish()
    assert code == 1, (follower.text(), errors)


async def test_unreachable_coordinator_is_retried_then_given_up_after_timeout(coordinator):
    _, _, token = coordinator
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    follower = await Follower.start(url, token, "j-000000000000", "--timeout", "1")
    code, errors = await follower.finish()
    assert code == 3, (follower.text(), errors)
    assert errors.count("warning: cannot reach the coordinator") == 1  # once per outage, not once per retry
    assert "gave up: the coordinator was unreachable for 1s" in errors and "Traceback" not in errors


async def test_unknown_job_ends_at_once(coordinator):
    _, url, token = coordinator
    follower = await Follower.start(url, token, "j-000000000000")
    code, errors = await follower.finish()
    assert code == 1 and "error:" in errors and follower.lines == []
