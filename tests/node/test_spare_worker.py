"""The warm spare worker (`JobRunner.keep_spare`, `worker.wait_as_spare`): a real worker process started before its
job, handed one, and replaced or dropped as the node's jobs come and go."""

from __future__ import annotations

import asyncio

import psutil
import pytest
from gpuswarm.node import runner as runner_module
from gpuswarm.node.runner import JobRunner
from gpuswarm.node.trainer_link import Settings
from gpuswarm.node.worker import THREADS_ENV
from gpuswarm.proto.models import Assignment


def assignment(number: int) -> Assignment:
    """A built-in job with no DHT ticket: its worker trains up to the point where it asks the daemon to bind its
    DHT key, which this runner (no binder) refuses, and then fails."""
    return Assignment.model_validate({
        "assignment_id": number, "job_id": f"j-{number:012d}", "node_id": "b" * 16, "state": "active",
        "job_state": "running", "run_id": "run", "shard_index": 0, "num_shards": 1, "initial_peers": [],
        "spec": {"workload": "digits-mlp"}})


def spares() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True) if p.cmdline()[-1:] == ["--spare"]]


@pytest.mark.timeout(180)
def test_a_job_starts_in_the_warm_spare_with_its_own_log_and_environment(tmp_path, monkeypatch):
    events = []
    runner = JobRunner(tmp_path / "jobs", "127.0.0.1", lambda job, event: events.append(event["event"]),
                       signer=lambda payload: None, settings=Settings(sandboxed=False), spare=True)

    async def scenario():
        await runner.keep_spare()
        spare = runner.spare
        assert spare is not None and [p.pid for p in spares()] == [spare.pid]
        await runner.keep_spare()
        assert runner.spare is spare  # one at a time
        monkeypatch.setenv(THREADS_ENV, "3")  # set after the spare started: it comes with the job
        job = await runner.start(assignment(1))
        assert job.process is spare and runner.spare is None
        await runner.keep_spare()
        assert runner.spare is None  # not while a job runs
        await asyncio.wait_for(spare.wait(), 120)
        log = (job.workdir / "worker.log").read_text()
        assert "training digits-mlp on cpu" in log and "3 torch threads" in log  # the job's stderr and env
        assert "ready" in events  # its events came through the spare's stdout
        assert "no DHT ticket" in log  # it asked the runner to bind its DHT key, over the spare's stdin
        assert [j for j, _ in runner.exited()] == [job]
        # Idle again: a new spare. A dead spare is never handed a job: the job gets a fresh process.
        await runner.keep_spare()
        second = runner.spare
        assert second is not None and second.pid != spare.pid
        second.kill()
        await second.wait()
        job = await runner.start(assignment(2))
        assert job.process is not second and job.process.returncode is None
        await runner.stop_all(timeout=5)
        assert [j for j, _ in runner.exited()] == [job]
        await runner.keep_spare()  # the node is idle: a spare for the next job
        assert len(spares()) == 1
        await runner.stop_all(timeout=5)  # the node stops: the spare goes with it
        assert runner.spare is None and spares() == []

    asyncio.run(scenario())


@pytest.mark.timeout(120)
def test_a_spare_that_cannot_start_is_given_up_after_a_few_tries(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(runner_module, "SPARE_FLAG", "--no-such-flag")  # the worker refuses it and exits with 2
    runner = JobRunner(tmp_path / "jobs", "127.0.0.1", lambda job, event: None, signer=lambda payload: None,
                       settings=Settings(sandboxed=False), spare=True)

    async def scenario():
        started = []
        for _ in range(runner_module.SPARE_DEATHS + 2):
            await runner.keep_spare()
            if runner.spare is not None:
                started.append(runner.spare)
                assert await asyncio.wait_for(runner.spare.wait(), 60) == 2
        assert len(started) == runner_module.SPARE_DEATHS and not runner.keeps_spare
        assert "jobs' workers start cold from now on" in caplog.text
        job = await runner.start(assignment(1))  # a job still starts, cold
        assert job.process not in started
        await runner.stop_all(timeout=5)

    asyncio.run(scenario())
