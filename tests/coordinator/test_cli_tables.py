"""`gpuswarm nodes` and `gpuswarm job list` at 120 nodes and 105 jobs, read by a person in a narrow terminal.

The real coordinator app over real HTTP, populated through its API with signed registrations and heartbeats, and the
real CLI in a subprocess whose output is a pipe (not a TTY) with COLUMNS set, as a terminal or CI would set it.
SQLite only: what is under test is the CLI's rendering; the API beneath runs on both databases in test_api.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio
from aiohttp.test_utils import TestServer
from gpuswarm.coordinator.app import create_app
from gpuswarm.coordinator.config import ADMIN_TOKEN, SESSIONS, CoordinatorConfig
from gpuswarm.coordinator.db import Node
from sqlalchemy import update
from test_api import SharedServerClient, new_identity, new_owner_token, registration, signed, submit

pytestmark = pytest.mark.asyncio(loop_scope="module")

ROOT = Path(__file__).resolve().parents[2]
NODES, JOBS = 120, 105
TRAINING, OFFLINE, REVOKED, VERIFIED, RUNNING, CANCELLED = 3, 20, 2, 4, 2, 5
LONG_GPU = {"model": "NVIDIA GeForce RTX 4090 Laptop GPU with a long marketing name", "memory_gb": 16, "count": 2}
NODE_ROW = re.compile(r"^([0-9a-f]{16})  ")
JOB_ROW = re.compile(r"^(j-[0-9a-f]{12})  ")
# Jobs no node can take: they stay pending for the whole module.
UNMATCHABLE = {"requirements": {"min_gpu_memory_gb": 4000, "allow_cpu": False}}


@dataclass
class Swarm:
    url: str
    token: str
    node_ids: list[str]  # registration order
    training: set[str]
    offline: set[str]
    revoked: set[str]
    verified: set[str]
    client: SharedServerClient


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def swarm(tmp_path_factory):
    """120 nodes (3 training, 20 offline, 2 revoked, 4 verified, distinct prices, some with a GPU name too long for
    any column) and 105 jobs (2 running, 5 cancelled, the rest pending, some with names too long to show)."""
    config = CoordinatorConfig(data_dir=tmp_path_factory.mktemp("coordinator"), start_dht=False, loop_interval=0.2,
                               node_timeout=3600)  # no node goes offline by itself while the module runs
    app = create_app(config)
    async with TestServer(app) as server:
        token = await new_owner_token(server, app, credits=0.0)
        async with SharedServerClient(server, headers={"Authorization": f"Bearer {token}"}) as client:
            identities = []
            for i in range(NODES):
                identity = new_identity()
                resources = {"gpus": [LONG_GPU] if i % 10 == 0 else [], "cpu_cores": 4 + i % 8, "ram_gb": 16.0}
                body = registration(identity, resources=resources, price_per_gpu_hour=(i * 37 % NODES) / 10)
                response = await client.post("/v1/nodes/register", json=signed(identity, "register", body))
                assert response.status == 200, await response.text()
                identities.append(identity)
            ids = [n.node_id for n in identities]
            offline, training = identities[10:10 + OFFLINE], identities[40:40 + TRAINING]
            revoked, verified = ids[100:100 + REVOKED], ids[50:50 + VERIFIED]
            for state, group in (("offline", offline), ("training", training)):  # training last: seen latest
                for node in group:
                    response = await client.post("/v1/nodes/heartbeat", json=signed(
                        node, "heartbeat", {"node_id": node.node_id, "state": state}))
                    assert response.status == 200, await response.text()
            async with SharedServerClient(server, headers={"Authorization": f"Bearer {app[ADMIN_TOKEN]}"}) as admin:
                for node_id in revoked:
                    assert (await admin.post(f"/v1/nodes/{node_id}/revoke", json={})).status == 200
            # Verification comes from passing the GPU challenge, which needs a GPU; the flag is set directly.
            async with app[SESSIONS].begin() as session:
                await session.execute(update(Node).where(Node.id.in_(verified)).values(verified=True))

            for i in range(JOBS - RUNNING):
                name = f"a job with a name far too long for any terminal column, number {i}" if i % 7 == 0 \
                    else f"job {i}"
                job_id = await submit(client, name=name, **UNMATCHABLE)
                if i < CANCELLED:
                    assert (await client.post(f"/v1/jobs/{job_id}/cancel")).status == 200
            for i in range(RUNNING):
                await submit(client, name=f"running {i}")
            deadline = time.monotonic() + 10
            while len((await (await client.get("/v1/jobs?state=running")).json())["jobs"]) < RUNNING:
                assert time.monotonic() < deadline, "the matcher did not start the matchable jobs"
                await asyncio.sleep(0.1)
            yield Swarm(str(server.make_url("")).rstrip("/"), token, ids, {n.node_id for n in training},
                        {n.node_id for n in offline}, set(revoked), set(verified), client)


async def cli(swarm: Swarm, *args: str, columns: int = 100) -> str:
    """Run `gpuswarm ARGS` with stdout a pipe and COLUMNS set; return its stdout (it must succeed)."""
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE")}
    env |= {"COLUMNS": str(columns), "GPUSWARM_COORDINATOR": swarm.url, "GPUSWARM_TOKEN": swarm.token}
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "gpuswarm.cli", *args, cwd=ROOT, env=env,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, errors = await proc.communicate()
    assert proc.returncode == 0, errors.decode()
    text = out.decode()
    assert "\x1b[" not in text, "ANSI escapes in piped output"
    return text


def rows(text: str, pattern: re.Pattern) -> list[str]:
    return [m.group(1) for line in text.splitlines() if (m := pattern.match(line))]


def column(text: str, header: str) -> list[str]:
    """One column of a listing's rows (cells are separated by two or more spaces; values hold single ones)."""
    lines = text.splitlines()
    index = re.split(r" {2,}", lines[0].strip()).index(header)
    return [re.split(r" {2,}", line.strip())[index] for line in lines if NODE_ROW.match(line) or JOB_ROW.match(line)]


async def api(swarm: Swarm, path: str) -> dict:
    response = await swarm.client.get(path)
    assert response.status == 200, await response.text()
    return await response.json()


# ---------------------------------------------------------------------------------------------------- nodes


async def test_nodes_at_100_columns_one_line_per_node_and_a_summary(swarm: Swarm):
    text = await cli(swarm, "nodes")
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 100, "\n".join(line for line in lines if len(line) > 100)
    assert rows(text, NODE_ROW) == swarm.node_ids  # registration order, every node on exactly one line
    for node_id in swarm.node_ids:
        assert text.count(node_id) == 1
    assert lines[0].split()[:3] == ["NODE", "STATE", "GPUS"]
    summary = (f"{NODES} nodes: {NODES - OFFLINE - REVOKED} online ({TRAINING} training), {OFFLINE} offline, "
               f"{REVOKED} revoked; {VERIFIED} verified")
    assert summary in lines
    assert any(line.startswith("hidden to fit 100 columns: ") for line in lines), text
    # A value too long for its column ends in an ellipsis instead of wrapping onto a second line.
    assert sum("2x NVIDIA" in line and "…" in line for line in lines) == NODES // 10
    by_id = {line[:16]: line for line in lines if NODE_ROW.match(line)}
    assert all(" training " in by_id[n] for n in swarm.training)
    assert all(" offline " in by_id[n] for n in swarm.offline)
    assert all(" revoked " in by_id[n] for n in swarm.revoked)


async def test_nodes_at_200_columns_shows_every_column(swarm: Swarm):
    text = await cli(swarm, "nodes", columns=200)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 200
    assert lines[0].split() == ["NODE", "STATE", "GPUS", "CPU/RAM", "PRICE", "REP", "VERIFIED", "JOB", "LAST", "SEEN",
                                "MESH", "ADVERT"]
    assert not any(line.startswith("hidden to fit") for line in lines)
    assert rows(text, NODE_ROW) == swarm.node_ids


@pytest.mark.parametrize("sort", ["price", "reputation", "last-seen", "state"])
async def test_nodes_sort(swarm: Swarm, sort: str):
    text = await cli(swarm, "nodes", "--sort", sort)
    order = rows(text, NODE_ROW)
    assert sorted(order) == sorted(swarm.node_ids) and order != swarm.node_ids
    if sort == "price":
        prices = [float(v) for v in column(text, "PRICE")]
        assert prices == sorted(prices) and len(set(prices)) == NODES
    elif sort == "reputation":  # computed at each request, from uptime: the table's own figures
        reputations = [float(v) for v in column(text, "REP")]
        assert reputations == sorted(reputations, reverse=True) and len(set(reputations)) > 1
    elif sort == "last-seen":
        assert set(order[:TRAINING]) == swarm.training  # heart-beaten last
    else:
        assert set(order[:TRAINING]) == swarm.training
        assert set(order[-REVOKED:]) == swarm.revoked
        assert set(order[-REVOKED - OFFLINE:-REVOKED]) == swarm.offline
    as_json = json.loads(await cli(swarm, "nodes", "--sort", sort, "--json"))
    if sort == "reputation":
        assert [n["reputation"] for n in as_json] == sorted((n["reputation"] for n in as_json), reverse=True)
    else:
        assert [n["id"] for n in as_json] == order


async def test_nodes_limit(swarm: Swarm):
    text = await cli(swarm, "nodes", "--sort", "price", "--limit", "10")
    listed = (await api(swarm, "/v1/nodes"))["nodes"]
    cheapest = [n["id"] for n in sorted(listed, key=lambda n: n["price_per_gpu_hour"])]
    assert rows(text, NODE_ROW) == cheapest[:10]
    assert text.splitlines()[-2].endswith("; showing 10")  # the summary still counts every node


async def test_nodes_json_is_the_api_list(swarm: Swarm):
    printed = json.loads(await cli(swarm, "nodes", "--json"))
    listed = (await api(swarm, "/v1/nodes"))["nodes"]
    changing = {"reputation", "advert"}  # reputation is computed at request time
    assert [{k: v for k, v in n.items() if k not in changing} for n in printed] == \
        [{k: v for k, v in n.items() if k not in changing} for n in listed]
    assert all(set(a) == set(b) for a, b in zip(printed, listed, strict=True))


# ---------------------------------------------------------------------------------------------------- jobs


async def test_job_list_at_100_columns_one_line_per_job_and_a_summary(swarm: Swarm):
    text = await cli(swarm, "job", "list")
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 100, "\n".join(line for line in lines if len(line) > 100)
    listed = [j["id"] for j in (await api(swarm, "/v1/jobs"))["jobs"]]
    assert rows(text, JOB_ROW) == listed and len(listed) == JOBS  # newest first, one line each
    for job_id in listed:
        assert text.count(job_id) == 1
    assert f"{JOBS} jobs: {JOBS - RUNNING - CANCELLED} pending, {RUNNING} running, {CANCELLED} cancelled" in lines
    assert sum("a job with a" in line and "…" in line for line in lines) == len(range(0, JOBS - RUNNING, 7))


async def test_job_list_at_200_columns(swarm: Swarm):
    lines = (await cli(swarm, "job", "list", columns=200)).splitlines()
    assert max(len(line) for line in lines) <= 200
    assert lines[0].split() == ["ID", "NAME", "WORKLOAD", "STATE", "NODES", "EPOCH", "ACCURACY", "SUBMITTED"]
    assert len([line for line in lines if JOB_ROW.match(line)]) == JOBS


async def test_job_list_state_filter_and_limit(swarm: Swarm):
    text = await cli(swarm, "job", "list", "--state", "cancelled")
    assert len(rows(text, JOB_ROW)) == CANCELLED
    assert f"{CANCELLED} jobs: {CANCELLED} cancelled" in text.splitlines()
    listed = [j["id"] for j in (await api(swarm, "/v1/jobs"))["jobs"]]
    text = await cli(swarm, "job", "list", "--limit", "7")
    assert rows(text, JOB_ROW) == listed[:7]
    assert text.splitlines()[-1].endswith("; showing the newest 7")


async def test_job_list_json_is_the_api_list(swarm: Swarm):
    printed = json.loads(await cli(swarm, "job", "list", "--json"))
    assert printed == (await api(swarm, "/v1/jobs"))["jobs"]
