"""One definition of an authentic node request (coordinator/auth.py), checked on every node route of the real app.

A node that is registered, a member of a running job, mid-way through a GPU challenge and on the mesh is revoked by
the admin; then each node route, found in the app's router by its `describe(auth="node")` metadata so that a new
route cannot be left out, gets a freshly signed, otherwise valid request from it. Each must be refused with 403
`revoked` and leave the database (every row of every table) and the artifact directory as they were.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer
from gpuswarm.coordinator.app import create_app
from gpuswarm.coordinator.config import ADMIN_TOKEN, CoordinatorConfig
from gpuswarm.mesh.keys import KeyPair
from gpuswarm.node.identity import Identity
from test_api import (
    ENVELOPE_HEADER,
    artifact_request,
    claim,
    new_identity,
    new_owner_token,
    registration,
    rejected,
    round_report,
    signed,
    submit,
    wait_for_assignment,
)


@pytest.fixture
async def client(tmp_path: Path, database_url: str | None):
    app = create_app(CoordinatorConfig(data_dir=tmp_path / "coordinator", database_url=database_url,
                                       start_dht=False, loop_interval=0.2))
    async with TestServer(app) as server:
        token = await new_owner_token(server, app)
        async with TestClient(server, headers={"Authorization": f"Bearer {token}"}) as client:
            yield client


def node_routes(client: TestClient) -> set[tuple[str, str]]:
    """(method, path template) of every route whose handler is described as called by nodes."""
    return {(route.method, route.resource.canonical) for route in client.app.router.routes()
            if getattr(route.handler, "__openapi__", {}).get("auth") == "node"}


# A freshly signed, otherwise valid request per node route: (node, job id, challenge id) -> (path, request kwargs).
Request = Callable[[Identity, str, str], tuple[str, dict]]
MESH = {"public_key": KeyPair.generate().public_key, "listen_port": 51820}
AUDIT = "a-0123456789ab"
REQUESTS: dict[tuple[str, str], Request] = {
    ("POST", "/v1/nodes/register"): lambda node, job, ch: (
        "/v1/nodes/register", {"json": signed(node, "register", registration(node, mesh=MESH))}),
    ("POST", "/v1/nodes/heartbeat"): lambda node, job, ch: (
        "/v1/nodes/heartbeat", {"json": signed(node, "heartbeat", {
            "node_id": node.node_id, "state": "training",
            "failures": [{"job_id": job, "reason": "crashed"}]})}),
    ("POST", "/v1/mesh/peers"): lambda node, job, ch: (
        "/v1/mesh/peers", {"json": signed(node, "mesh_poll", {"node_id": node.node_id, "since": 0})}),
    ("POST", "/v1/nodes/assignments"): lambda node, job, ch: (
        "/v1/nodes/assignments", {"json": signed(node, "poll", {"node_id": node.node_id})}),
    ("POST", "/v1/rounds"): lambda node, job, ch: (
        "/v1/rounds", {"json": round_report(node, job, [claim(node, job)], solo=True)}),
    ("PUT", "/v1/jobs/{job_id}/artifacts/{name}"): lambda node, job, ch: (
        f"/v1/jobs/{job}/artifacts/model.pt", artifact_request(node, job, b"final weights", final=True,
                                                                accuracy=0.99)),
    ("GET", "/v1/jobs/{job_id}/blobs/{sha256}"): lambda node, job, ch: (
        f"/v1/jobs/{job}/blobs/{'0' * 64}", {"headers": {ENVELOPE_HEADER: json.dumps(signed(node, "fetch", {
            "job_id": job, "node_id": node.node_id, "sha256": "0" * 64}))}}),
    ("PUT", "/v1/audits/{audit_id}/evidence"): lambda node, job, ch: (
        f"/v1/audits/{AUDIT}/evidence", {"data": b"evidence", "headers": {ENVELOPE_HEADER: json.dumps(signed(
            node, "evidence", {"audit_id": AUDIT, "node_id": node.node_id, "size": 8,
                               "sha256": hashlib.sha256(b"evidence").hexdigest()}))}}),
    ("GET", "/v1/audits/{audit_id}/evidence"): lambda node, job, ch: (
        f"/v1/audits/{AUDIT}/evidence", {"headers": {ENVELOPE_HEADER: json.dumps(signed(
            node, "fetch_evidence", {"audit_id": AUDIT, "node_id": node.node_id}))}}),
    ("POST", "/v1/audits/{audit_id}/verdict"): lambda node, job, ch: (
        f"/v1/audits/{AUDIT}/verdict", {"json": signed(node, "verdict", {
            "audit_id": AUDIT, "node_id": node.node_id, "steps": 1, "samples": 1, "passed": False})}),
    ("POST", "/v1/challenges"): lambda node, job, ch: (
        "/v1/challenges", {"json": signed(node, "challenge_start", {"node_id": node.node_id})}),
    ("POST", "/v1/challenges/{challenge_id}/commit"): lambda node, job, ch: (
        f"/v1/challenges/{ch}/commit", {"json": signed(node, "challenge_commit", {
            "challenge_id": ch, "node_id": node.node_id, "root": hashlib.sha256(b"root").hexdigest()})}),
    ("POST", "/v1/challenges/{challenge_id}/proof"): lambda node, job, ch: (
        f"/v1/challenges/{ch}/proof", {"json": signed(node, "challenge_proof", {
            "challenge_id": ch, "node_id": node.node_id, "product": "", "rows": []})}),
}


def test_every_node_route_has_a_request_here(tmp_path: Path):
    """A new node route fails this test until the walk below sends it a request."""
    app = create_app(CoordinatorConfig(data_dir=tmp_path, start_dht=False))
    routes = {(route.method, route.resource.canonical) for route in app.router.routes()
              if getattr(route.handler, "__openapi__", {}).get("auth") == "node"}
    assert routes == set(REQUESTS)


async def test_a_revoked_node_is_refused_on_every_node_route(client: TestClient, tmp_path: Path):
    assert node_routes(client) == set(REQUESTS)
    node = new_identity()
    response = await client.post("/v1/nodes/register",
                                 json=signed(node, "register", registration(node, mesh=MESH)))
    assert response.status == 200, await response.text()
    job_id = await submit(client)
    await wait_for_assignment(client, node, job_id)
    response = await client.post("/v1/challenges", json=signed(node, "challenge_start", {"node_id": node.node_id}))
    assert response.status == 201, await response.text()
    challenge_id = (await response.json())["challenge_id"]
    path, kwargs = REQUESTS[("POST", "/v1/challenges/{challenge_id}/commit")](node, job_id, challenge_id)
    response = await client.post(path, **kwargs)
    assert response.status == 200, await response.text()
    assert (await response.json())["reveal"] is not None  # in time: the proof route is the next step

    response = await client.post(f"/v1/nodes/{node.node_id}/revoke",
                                 headers={"Authorization": f"Bearer {client.app[ADMIN_TOKEN]}"})
    assert response.status == 200, await response.text()

    artifacts = tmp_path / "coordinator" / "blobs"
    files = sorted(artifacts.rglob("*"))
    for (method, template), build in REQUESTS.items():
        path, kwargs = build(node, job_id, challenge_id)  # signed now: fresh timestamp and nonce
        error = await rejected(client, method, path, 403, "revoked", **kwargs)
        assert node.node_id in error["message"], (template, error)
        assert sorted(artifacts.rglob("*")) == files, template
    job = await (await client.get(f"/v1/jobs/{job_id}")).json()
    assert job["state"] == "running" and job["artifacts"] == [] and job["final_accuracy"] is None
