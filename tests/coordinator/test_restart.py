"""A coordinator that restarts on its data directory and database: nodes keep their assignments through the
outage, the reports they buffered are taken, and its DHT peer comes back as the same peer at the same address.

Real aiohttp apps over real HTTP, on every database backend of the `database_url` fixture; the second app is a
new process's worth of state (a new `create_app`) on the first one's files.
"""

from __future__ import annotations

import asyncio
import socket
import time
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer
from gpuswarm.client.api import CoordinatorClient
from gpuswarm.coordinator.app import answering, create_app
from gpuswarm.coordinator.config import DHT_PEERS, CoordinatorConfig
from test_api import (
    claim,
    new_owner_token,
    register,
    round_report,
    signed,
    submit,
    wait_for_assignment,
)

TIMEOUT = 3.0  # node_timeout: short, so that the test can sit through one


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    return tmp_path / "coordinator"


@asynccontextmanager
async def coordinator(data_dir: Path, database_url: str | None, token: str | None = None, **overrides):
    config = CoordinatorConfig(data_dir=data_dir, database_url=database_url, loop_interval=0.2,
                               node_timeout=TIMEOUT, **{"start_dht": False, **overrides})
    app = create_app(config)
    async with TestServer(app) as server:
        token = token or await new_owner_token(server, app)
        async with TestClient(server, headers={"Authorization": f"Bearer {token}"}) as client:
            yield client, token


async def heartbeat(client: TestClient, node) -> None:
    body = signed(node, "heartbeat", {"node_id": node.node_id, "state": "training"})
    response = await client.post("/v1/nodes/heartbeat", json=body)
    assert response.status == 200, await response.text()


async def assignment_states(client: TestClient, job_id: str) -> dict[str, str]:
    job = await (await client.get(f"/v1/jobs/{job_id}")).json()
    return {a["node_id"]: a["state"] for a in job["assignments"]}


async def test_nodes_that_trained_through_an_outage_keep_their_assignments(data_dir, database_url):
    async with coordinator(data_dir, database_url) as (client, token):
        a, b = await register(client), await register(client)
        job_id = await submit(client, min_nodes=2, max_nodes=2)
        for node in (a, b):
            await wait_for_assignment(client, node, job_id)
    down_at = time.time()
    await asyncio.sleep(TIMEOUT + 0.5)  # down for longer than the node timeout; the nodes train on meanwhile

    async with coordinator(data_dir, database_url, token) as (client, _):
        # Several ticks, all within the grace of one node timeout after the start: nobody is lost.
        await asyncio.sleep(TIMEOUT / 2)
        assert await assignment_states(client, job_id) == {a.node_id: "active", b.node_id: "active"}
        # a comes back now, within that grace (under load, the round reports below once took longer than the rest
        # of it, and a was lost with b before its first heartbeat).
        await heartbeat(client, a)
        # The round the nodes finished while the coordinator was down, buffered and sent now, is taken.
        window = {"window_start": down_at + 0.5, "window_end": down_at + TIMEOUT}
        ca, cb = claim(a, job_id, 0, **window), claim(b, job_id, 0, **window)
        for node, claims in ((a, [ca, cb]), (b, [cb, ca])):  # each attests the other's claim
            response = await client.post("/v1/rounds", json=round_report(node, job_id, claims))
            assert response.status == 201, await response.text()
        assert [c["status"] for c in (await response.json())["claims"]] == ["credited", "credited"]
        # a keeps beating; b never comes back, and is lost a node timeout after the start.
        deadline = time.monotonic() + TIMEOUT * 2
        while (states := await assignment_states(client, job_id))[b.node_id] == "active":
            assert time.monotonic() < deadline, "the coordinator never lost the silent node"
            await heartbeat(client, a)
            await asyncio.sleep(0.2)
        assert states == {a.node_id: "active", b.node_id: "lost"}


async def test_the_dht_peer_comes_back_with_the_same_identity_and_address(data_dir):
    async with coordinator(data_dir, None, start_dht=True) as (client, token):
        before = client.server.app[DHT_PEERS]
    async with coordinator(data_dir, None, token, start_dht=True) as (client, _):
        after = client.server.app[DHT_PEERS]
        assert (await (await client.get("/v1/dht")).json())["initial_peers"][:len(after)] == after
    assert before and after == before


def test_remembered_dht_peers_that_stay_silent_are_left_out_not_waited_for(data_dir):
    """p2pd waits about 15 s on a bootstrap peer whose host has gone (silence, not a refusal), during which the
    coordinator cannot serve. A listening socket whose accept queue is full stays silent like that host."""
    peer_id = "12D3KooWHzMeEA8BjM4MXzkpvoB6DThn43fTWURip1W9mC3hzqo9"
    with socket.create_server(("127.0.0.1", 0)) as alive, socket.create_server(("127.0.0.1", 0), backlog=0) as gone, \
            socket.create_connection(gone.getsockname(), timeout=1):  # fills the one place in `gone`'s queue
        refusing = socket.create_server(("127.0.0.1", 0))
        refusing_port = refusing.getsockname()[1]
        refusing.close()
        maddrs = [f"/ip4/127.0.0.1/tcp/{gone.getsockname()[1]}/p2p/{peer_id}",
                  f"/ip4/127.0.0.1/tcp/{alive.getsockname()[1]}/p2p/{peer_id}",
                  f"/ip4/127.0.0.1/tcp/{refusing_port}/p2p/{peer_id}",
                  f"/dns4/example.org/tcp/4001/p2p/{peer_id}"]  # not an address to probe: kept, p2pd resolves it
        assert answering(maddrs, timeout=0.5) == maddrs[1::2]


async def test_one_of_two_coordinators_on_postgresql_leads_and_the_other_takes_over(tmp_path, postgres_url):
    async with coordinator(tmp_path / "a", postgres_url) as (a, token):
        async with coordinator(tmp_path / "b", postgres_url, token) as (b, _):
            deadline = time.monotonic() + 10
            while sorted([(await x.get("/v1/health")).status for x in (a, b)]) != [200, 200] or \
                    sum([(await (await x.get("/v1/health")).json())["leader"] for x in (a, b)]) != 1:
                assert time.monotonic() < deadline, "not exactly one leader"
                await asyncio.sleep(0.1)
            first_leads = (await (await a.get("/v1/health")).json())["leader"]
            follower = b if first_leads else a
            leader = a if first_leads else b
            await leader.server.close()  # its cleanup ends its database session, and the lock with it
            deadline = time.monotonic() + 5
            while not (await (await follower.get("/v1/health")).json())["leader"]:
                assert time.monotonic() < deadline, "the other coordinator never took over"
                await asyncio.sleep(0.1)


async def test_a_client_given_several_coordinators_moves_past_one_that_is_down(data_dir, unused_tcp_port):
    async with coordinator(data_dir, None) as (client, _):
        live = str(client.make_url("")).rstrip("/")
        api = CoordinatorClient(f"http://127.0.0.1:{unused_tcp_port},{live}")
        assert (await api.health()).ok and api.base_url == live
