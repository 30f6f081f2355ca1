"""The sweep routes (coordinator/views/sweeps.py) and the supervisor's part (coordinator/sweeps.py) on a real
coordinator, on SQLite and PostgreSQL: a refused sweep changes nothing, a sweep starts `parallel` trials as the
owner's jobs (with the space's values in their params), a pruned or cancelled trial's job is cancelled, and only the
owner sees a sweep."""

from __future__ import annotations

import asyncio
import time

import pytest
from aiohttp.test_utils import TestServer
from gpuswarm.coordinator import sweeps
from gpuswarm.coordinator.app import create_app
from gpuswarm.coordinator.config import SESSIONS, CoordinatorConfig
from gpuswarm.coordinator.db import Job, JobProgress, Sweep
from test_api import SharedServerClient, error_of, new_owner_token, snapshot

SPACE = {"learning_rate": {"type": "float", "low": 1e-4, "high": 0.3, "log": True},
         "hidden": {"type": "int", "low": 16, "high": 256, "log": True},
         "batch_size": {"type": "categorical", "choices": [16, 32, 64]}}
SWEEP = {"name": "search", "trials": 3, "parallel": 2, "space": SPACE,
         "pruner": {"kind": "asha", "unit": "step", "min_resource": 1},
         "job": {"workload": "digits-mlp", "budget": 2.0, "hyperparameters": {"target_batch_size": 64}}}


@pytest.fixture
async def server(tmp_path, database_url):
    app = create_app(CoordinatorConfig(data_dir=tmp_path / "coordinator", database_url=database_url,
                                       start_dht=False, loop_interval=0.2))
    async with TestServer(app) as server:
        yield server


async def owner_client(server, name: str, credits: float = 100.0) -> SharedServerClient:
    token = await new_owner_token(server, server.app, name, credits)
    return SharedServerClient(server, headers={"Authorization": f"Bearer {token}"})


async def wait_for(client, sweep_id: str, condition, what: str, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        detail = await (await client.get(f"/v1/sweeps/{sweep_id}")).json()
        if condition(detail):
            return detail
        assert time.monotonic() < deadline, f"{what}: {detail}"
        await asyncio.sleep(0.1)


@pytest.mark.parametrize(("change", "status", "code"), [
    ({"space": {"hidden": {"type": "int", "low": 2, "high": 64}}}, 422, "invalid"),  # below the schema's 8
    ({"trials": 0}, 422, "invalid"),
    ({"pruner": {"kind": "hyperband"}}, 422, "invalid"),
    ({"budgett": 1}, 422, "invalid"),
    ({"job": {"workload": "digits-mlp", "budget": 60.0}}, 402, "insufficient_funds"),  # 2 trials x 60 > 100
])
async def test_a_refused_sweep_changes_nothing(server, change, status, code):
    async with await owner_client(server, "owner") as client:
        before = await snapshot(server.app)
        await error_of(await client.post("/v1/sweeps", json=SWEEP | change), status, code)
        assert await snapshot(server.app) == before


async def test_a_sweep_runs_its_trials_as_the_owners_jobs(server):
    async with await owner_client(server, "owner") as client, await owner_client(server, "other") as other:
        response = await client.post("/v1/sweeps", json=SWEEP)
        assert response.status == 201, await response.text()
        sweep = await response.json()
        assert (sweep["state"], sweep["trials"], sweep["trials_done"]) == ("running", 3, 0)

        detail = await wait_for(client, sweep["id"], lambda d: len(d["trials"]) == 2, "two trials started")
        jobs = []
        for trial in detail["trials"]:
            job = await (await client.get(f"/v1/jobs/{trial['job_id']}")).json()
            assert job["state"] == "pending" and trial["state"] == "running"
            params = job["spec"]["hyperparameters"]
            assert {k: params[k] for k in SPACE} == trial["params"] and params["target_batch_size"] == 64
            assert 1e-4 <= params["learning_rate"] <= 0.3 and 16 <= params["hidden"] <= 256
            jobs.append(job)
        assert detail["trials_planned"] == 3 and detail["best"] is None

        # Another owner sees neither the sweep nor its jobs.
        await error_of(await other.get(f"/v1/sweeps/{sweep['id']}"), 403, "not_your_sweep")
        assert (await (await other.get("/v1/sweeps")).json())["sweeps"] == []
        await error_of(await other.post(f"/v1/sweeps/{sweep['id']}/cancel"), 403, "not_your_sweep")
        await error_of(await client.get("/v1/sweeps/s-000000000000"), 404, "unknown_sweep")
        await error_of(await client.get("/v1/sweeps/nonsense"), 404, "unknown_sweep")

        response = await client.post(f"/v1/sweeps/{sweep['id']}/cancel")
        assert response.status == 200 and (await response.json())["state"] == "cancelled"
        for job in jobs:
            assert (await (await client.get(f"/v1/jobs/{job['id']}")).json())["state"] == "cancelled"
        detail = await (await client.get(f"/v1/sweeps/{sweep['id']}")).json()
        assert [t["state"] for t in detail["trials"]] == ["cancelled", "cancelled"]
        await error_of(await client.post(f"/v1/sweeps/{sweep['id']}/cancel"), 409, "sweep_final")
        listed = (await (await client.get("/v1/sweeps")).json())["sweeps"]
        assert [(s["id"], s["state"], s["trials_done"]) for s in listed] == [(sweep["id"], "cancelled", 2)]


async def test_a_trial_behind_the_others_is_pruned_and_its_job_cancelled(server):
    """The supervisor reads each trial's progress points as its job reports them. Here the points are written as
    the heartbeats would, for two trials whose jobs are (made) running: trial 0 at 0.9, trial 1 at 0.1; ASHA with
    reduction factor 3 keeps the best third at each rung, so trial 1 stops at its first rung and its job is
    cancelled, and a third trial starts in its place."""
    async with await owner_client(server, "owner") as client:
        sweep = await (await client.post("/v1/sweeps", json=SWEEP)).json()
        detail = await wait_for(client, sweep["id"], lambda d: len(d["trials"]) == 2, "two trials started")
        job_ids = [t["job_id"] for t in detail["trials"]]
        async with server.app[SESSIONS].begin() as session:
            for job_id in job_ids:
                (await session.get(Job, job_id)).state = "running"
        for step in (1, 2):
            async with server.app[SESSIONS].begin() as session:
                for job_id, accuracy in zip(job_ids, (0.9, 0.1), strict=True):
                    session.add(JobProgress(job_id=job_id, at=time.time(), epoch=step / 10, global_step=step,
                                            accuracy=accuracy, samples_per_second=1.0, peers=1))
            await asyncio.sleep(0.5)
        detail = await wait_for(client, sweep["id"], lambda d: d["trials"][1]["state"] == "pruned", "trial 1 pruned")
        pruned = detail["trials"][1]
        assert pruned["value"] == 0.1 and pruned["pruned_at_step"] >= 1 and "pruned at step" in pruned["reason"]
        assert pruned["curve"][0] == [1, 0.1]
        assert (await (await client.get(f"/v1/jobs/{job_ids[1]}")).json())["state"] == "cancelled"
        assert detail["trials"][0]["state"] == "running"
        detail = await wait_for(client, sweep["id"], lambda d: len(d["trials"]) == 3, "a third trial started")
        async with server.app[SESSIONS]() as session:
            row = await session.get(Sweep, sweep["id"])
            assert [t.state for t in await sweeps.trials_of(session, row.id)] == ["running", "pruned", "running"]
