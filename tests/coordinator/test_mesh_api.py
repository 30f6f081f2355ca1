"""The coordinator's mesh API over real HTTP: addresses from IPAM, peer lists, the long-poll push, revocation.

No root needed: this is the coordinator's side only (tests/netns runs real WireGuard).
"""

from __future__ import annotations

import asyncio
import ipaddress

import pytest
from aiohttp.test_utils import TestClient, TestServer
from gpuswarm.coordinator.app import create_app
from gpuswarm.coordinator.config import CoordinatorConfig
from gpuswarm.mesh.keys import KeyPair
from test_api import error_of, new_identity, registration, rejected, signed

CIDR = "10.77.0.0/16"


@pytest.fixture
async def client(tmp_path, database_url):
    app = create_app(CoordinatorConfig(data_dir=tmp_path / "coordinator", database_url=database_url,
                                       start_dht=False, loop_interval=0.2, mesh_poll_timeout=5.0))
    async with TestServer(app) as server, TestClient(server) as client:
        yield client


class MeshNode:
    def __init__(self, port: int = 51820):
        self.identity, self.wg, self.port = new_identity(), KeyPair.generate(), port

    def registration(self) -> dict:
        mesh = {"public_key": self.wg.public_key, "listen_port": self.port, "endpoints": [f"192.0.2.9:{self.port}"]}
        return signed(self.identity, "register", registration(self.identity, mesh=mesh))

    async def register(self, client: TestClient) -> dict:
        response = await client.post("/v1/nodes/register", json=self.registration())
        assert response.status == 200, await response.text()
        return (await response.json())["mesh"]

    async def poll(self, client: TestClient, since: int):
        payload = {"node_id": self.identity.node_id, "since": since}
        return await client.post("/v1/mesh/peers", json=signed(self.identity, "mesh_poll", payload))


async def test_registration_assigns_a_stable_address_and_lists_peers(client):
    a, b = MeshNode(), MeshNode()
    mesh_a = await a.register(client)
    assert ipaddress.ip_address(mesh_a["address"]) in ipaddress.ip_network(CIDR)
    assert mesh_a["cidr"] == CIDR and mesh_a["peers"] == []
    mesh_b = await b.register(client)
    assert mesh_b["address"] != mesh_a["address"]
    [peer] = mesh_b["peers"]
    assert (peer["node_id"], peer["public_key"], peer["address"]) == (a.identity.node_id, a.wg.public_key,
                                                                       mesh_a["address"])
    # The node's own candidate first, then the address the coordinator saw it come from.
    assert peer["endpoints"][0] == "192.0.2.9:51820" and peer["endpoints"][1].startswith("127.0.0.1:")
    assert (await a.register(client))["address"] == mesh_a["address"]  # a restart keeps the address


async def test_long_poll_is_answered_when_a_peer_joins(client):
    a, b = MeshNode(), MeshNode()
    version = (await a.register(client))["version"]
    waiting = asyncio.create_task(a.poll(client, version))
    await asyncio.sleep(0.3)
    assert not waiting.done(), "the long-poll answered before anything changed"
    await b.register(client)
    response = await asyncio.wait_for(waiting, 2.0)
    body = await response.json()
    assert body["version"] > version
    assert [p["node_id"] for p in body["peers"]] == [b.identity.node_id]


async def test_long_poll_with_nothing_new_returns_after_its_timeout(client):
    a = MeshNode()
    version = (await a.register(client))["version"]
    response = await a.poll(client, version)
    assert (await response.json())["version"] == version


async def test_revocation_needs_the_admin_token_then_drops_the_node_everywhere(client, tmp_path):
    a, b = MeshNode(), MeshNode()
    await a.register(client)
    await b.register(client)
    victim = b.identity.node_id
    await rejected(client, "POST", f"/v1/nodes/{victim}/revoke", 401, "admin_only")
    await rejected(client, "POST", f"/v1/nodes/{victim}/revoke", 401, "admin_only",
                   headers={"Authorization": "Bearer wrong"})
    token = (tmp_path / "coordinator" / "admin.token").read_text().strip()
    response = await client.post(f"/v1/nodes/{victim}/revoke", headers={"Authorization": f"Bearer {token}"})
    assert response.status == 200, await response.text()

    body = await (await a.poll(client, -1)).json()
    assert body["peers"] == []
    heartbeat = signed(b.identity, "heartbeat", {"node_id": victim, "state": "idle"})
    await error_of(await client.post("/v1/nodes/heartbeat", json=heartbeat), 403, "revoked")
    await error_of(await client.post("/v1/nodes/register", json=b.registration()), 403, "revoked")
    await error_of(await b.poll(client, -1), 403, "revoked")


async def test_poll_from_a_node_without_mesh_is_refused(client):
    identity = new_identity()
    response = await client.post("/v1/nodes/register", json=signed(identity, "register", registration(identity)))
    assert (await response.json())["mesh"] is None
    payload = {"node_id": identity.node_id, "since": -1}
    await error_of(await client.post("/v1/mesh/peers", json=signed(identity, "mesh_poll", payload)), 409, "no_mesh")


@pytest.mark.parametrize("mesh", [
    {"public_key": "not-a-key", "listen_port": 51820},
    {"public_key": KeyPair.generate().public_key, "listen_port": 0},
    {"public_key": KeyPair.generate().public_key, "listen_port": 51820, "endpoints": ["x" * 100]},
])
async def test_bad_mesh_registration_is_refused_and_changes_nothing(client, mesh):
    identity = new_identity()
    await rejected(client, "POST", "/v1/nodes/register", 422, "invalid",
                   json=signed(identity, "register", registration(identity, mesh=mesh)))


async def test_a_pair_reported_unreachable_gets_a_relay_that_both_ends_and_the_relay_are_told(client):
    a, b, r = MeshNode(), MeshNode(), MeshNode()
    versions = {}
    for n in (a, b, r):
        versions[n] = (await n.register(client))["version"]

    async def heartbeat(node: MeshNode, **fields) -> None:
        payload = {"node_id": node.identity.node_id, "state": "idle", **fields}
        response = await client.post("/v1/nodes/heartbeat", json=signed(node.identity, "heartbeat", payload))
        assert response.status == 200, await response.text()

    async def config_of(node: MeshNode, want) -> dict:
        for _ in range(50):  # the leader's tick plans relays within a loop interval (0.2 s)
            body = await (await node.poll(client, -1)).json()
            if want(body):
                return body
            await asyncio.sleep(0.1)
        raise AssertionError(f"no such mesh config: {body}")

    ids = {n: n.identity.node_id for n in (a, b, r)}
    await heartbeat(a, peer_rtt_ms={ids[r]: 4.0}, unreachable_peers=[ids[b]])
    await heartbeat(b, peer_rtt_ms={ids[r]: 6.0}, unreachable_peers=[ids[a]])

    def via(body: dict, node: MeshNode) -> str | None:
        return {p["node_id"]: p.get("via") for p in body["peers"]}[ids[node]]

    body_a = await config_of(a, lambda body: via(body, b) == ids[r])
    assert via(body_a, r) is None and not body_a["forward"]
    body_b = await config_of(b, lambda body: via(body, a) == ids[r])
    assert not body_b["forward"]
    body_r = await config_of(r, lambda body: body["forward"])
    assert via(body_r, a) is None and via(body_r, b) is None

    # The direct path works again: the relay goes, and the relay stops forwarding.
    await heartbeat(a, peer_rtt_ms={ids[r]: 4.0, ids[b]: 2.0})
    await heartbeat(b, peer_rtt_ms={ids[r]: 6.0, ids[a]: 2.0})
    await config_of(a, lambda body: via(body, b) is None)
    await config_of(r, lambda body: not body["forward"])


async def test_unreachable_peers_are_bounded_and_typed(client):
    a = MeshNode()
    await a.register(client)
    node = a.identity.node_id
    for bad in (["x"], ["0" * 16] * 257, "0" * 16, [1]):
        payload = {"node_id": node, "state": "idle", "unreachable_peers": bad}
        await rejected(client, "POST", "/v1/nodes/heartbeat", 422, None, json=signed(a.identity, "heartbeat", payload))
