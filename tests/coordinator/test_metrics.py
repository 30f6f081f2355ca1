"""The coordinator's /metrics: the real app over real HTTP, on SQLite and PostgreSQL, parsed with prometheus_client's
own parser. The gauges must match what was done to the swarm, the request histogram must carry route templates and
final statuses (errors included), and two apps in one process must keep separate registries."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer
from gpuswarm.coordinator.app import create_app
from gpuswarm.coordinator.config import ADMIN_TOKEN, CoordinatorConfig
from gpuswarm.proto.models import JobState
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families
from test_api import (
    SharedServerClient,
    new_identity,
    new_owner_token,
    register,
    signed,
    submit,
    wait_for_assignment,
)

from gpuswarm import __version__

REQUESTS = "gpuswarm_coordinator_http_request_duration_seconds"
SUPERVISOR_WAIT = 10.0  # seconds to wait for the background loop (interval 0.2 s) to record a matching pass


@pytest.fixture
async def client(tmp_path: Path, database_url: str | None):
    app = create_app(CoordinatorConfig(data_dir=tmp_path / "coordinator", database_url=database_url,
                                       start_dht=False, loop_interval=0.2))
    async with TestServer(app) as server:
        token = await new_owner_token(server, app)
        async with SharedServerClient(server, headers={"Authorization": f"Bearer {token}"}) as client:
            yield client


Samples = list[tuple[str, dict[str, str], float]]


async def scrape(client: TestClient) -> Samples:
    response = await client.get("/metrics")
    assert response.status == 200, await response.text()
    assert response.headers["Content-Type"] == CONTENT_TYPE_LATEST
    return [(s.name, s.labels, s.value)
            for family in text_string_to_metric_families(await response.text()) for s in family.samples]


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sum of the samples called `name` whose labels include `labels`; KeyError when there is none."""
    found = [v for n, lab, v in samples if n == name and labels.items() <= lab.items()]
    if not found:
        raise KeyError(f"no sample {name}{labels}")
    return sum(found)


async def scrape_until(client: TestClient, name: str, minimum: float) -> Samples:
    """Scrape until the supervisor's counter `name` reaches `minimum` (it counts after its transaction commits)."""
    deadline = time.monotonic() + SUPERVISOR_WAIT
    while True:
        samples = await scrape(client)
        if value(samples, name) >= minimum or time.monotonic() > deadline:
            return samples
        await asyncio.sleep(0.1)


async def heartbeat(client: TestClient, envelope: dict, status: int) -> None:
    response = await client.post("/v1/nodes/heartbeat", json=envelope)
    assert response.status == status, await response.text()


async def test_metrics_count_jobs_nodes_requests_heartbeats_and_matching(client: TestClient):
    busy = await register(client)
    running = await submit(client, min_nodes=1, max_nodes=1)
    await wait_for_assignment(client, busy, running)
    idle = await register(client)
    pending = await submit(client, min_nodes=3, max_nodes=3)  # two nodes, one busy: it stays pending

    # Heartbeats through the batcher: two applied, two refused (an unknown node, a replayed nonce).
    beat = signed(idle, "heartbeat", {"node_id": idle.node_id, "state": "idle"})
    await heartbeat(client, beat, 200)
    await heartbeat(client, signed(busy, "heartbeat", {"node_id": busy.node_id, "state": "training"}), 200)
    await heartbeat(client, beat, 409)
    stranger = new_identity()
    await heartbeat(client, signed(stranger, "heartbeat", {"node_id": stranger.node_id, "state": "idle"}), 404)

    assert (await client.get(f"/v1/jobs/{pending}")).status == 200
    bad = await client.post("/v1/jobs", data=b"{not json", headers={"Content-Type": "application/json"})
    assert bad.status == 400, await bad.text()
    assert (await client.get(f"/no/such/{pending}")).status == 404

    samples = await scrape_until(client, "gpuswarm_coordinator_assignments_made_total", 1)
    assert value(samples, "gpuswarm_coordinator_info", version=__version__) == 1
    assert value(samples, "gpuswarm_coordinator_jobs", state="pending") == 1
    assert value(samples, "gpuswarm_coordinator_jobs", state="running") == 1
    for state in (JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED):
        assert value(samples, "gpuswarm_coordinator_jobs", state=state.value) == 0  # present, at zero
    assert value(samples, "gpuswarm_coordinator_nodes") == 2
    assert value(samples, "gpuswarm_coordinator_nodes_online") == 2
    assert value(samples, "gpuswarm_coordinator_nodes_revoked") == 0
    assert value(samples, "gpuswarm_coordinator_nodes_verified") == 0
    assert value(samples, "gpuswarm_coordinator_assignments_active") == 1
    assert value(samples, "gpuswarm_coordinator_assignments_made_total") == 1
    assert value(samples, "gpuswarm_coordinator_matching_duration_seconds_count") > 0
    assert value(samples, "gpuswarm_coordinator_supervisor_tick_failures_total") == 0

    assert value(samples, "gpuswarm_coordinator_heartbeats_total", result="applied") == 2
    assert value(samples, "gpuswarm_coordinator_heartbeats_total", result="rejected") == 2
    assert value(samples, "gpuswarm_coordinator_heartbeats_total", result="failed") == 0
    assert value(samples, "gpuswarm_coordinator_heartbeat_batch_size_sum") == 4
    assert value(samples, "gpuswarm_coordinator_heartbeat_batch_size_count") >= 1

    count = REQUESTS + "_count"
    assert value(samples, count, method="GET", route="/v1/jobs/{job_id}", status="200") == 1
    assert value(samples, count, method="POST", route="/v1/jobs", status="400") == 1
    assert value(samples, count, method="POST", route="/v1/jobs", status="201") == 2
    assert value(samples, count, method="POST", route="/v1/nodes/heartbeat", status="409") == 1
    assert value(samples, count, method="GET", route="unmatched", status="404") == 1
    routes = {lab["route"] for name, lab, _ in samples if name == count}
    assert not [r for r in routes if pending in r or running in r], routes  # templates only, never raw paths
    assert "/metrics" not in routes  # scrapes are not timed


async def test_metrics_follow_a_revocation(client: TestClient):
    node = await register(client)
    admin = {"Authorization": f"Bearer {client.app[ADMIN_TOKEN]}"}
    response = await client.post(f"/v1/nodes/{node.node_id}/revoke", headers=admin)
    assert response.status == 200, await response.text()
    samples = await scrape(client)
    assert value(samples, "gpuswarm_coordinator_nodes") == 1
    assert value(samples, "gpuswarm_coordinator_nodes_revoked") == 1
    assert value(samples, "gpuswarm_coordinator_nodes_online") == 0


async def test_two_apps_in_one_process_keep_their_own_metrics(tmp_path: Path):
    apps = [create_app(CoordinatorConfig(data_dir=tmp_path / name, start_dht=False)) for name in ("a", "b")]
    async with TestServer(apps[0]) as server_a, TestServer(apps[1]) as server_b:
        async with TestClient(server_a) as a, TestClient(server_b) as b:
            assert (await a.get("/v1/health")).status == 200
            health = {"method": "GET", "route": "/v1/health", "status": "200"}
            assert value(await scrape(a), REQUESTS + "_count", **health) == 1
            with pytest.raises(KeyError):
                value(await scrape(b), REQUESTS + "_count", **health)
