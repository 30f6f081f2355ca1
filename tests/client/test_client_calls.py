"""The client (client/api.py) against the real coordinator app over real HTTP: typed answers, the error split the node
daemon relies on (CoordinatorUnavailable: retry later; Rejected: the coordinator said no), the sentence for a
coordinator that cannot be reached, downloads checked against their SHA-256, and the blocking facade.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import socket
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from gpuswarm.client.api import (
    ENVELOPE_HEADER,
    ApiError,
    CoordinatorClient,
    CoordinatorUnavailable,
    Rejected,
    SyncClient,
)
from gpuswarm.coordinator.app import create_app
from gpuswarm.coordinator.config import ADMIN_TOKEN, CoordinatorConfig
from gpuswarm.node.identity import Identity
from gpuswarm.proto.api import Health, JobDetail, JobInfo, OwnerCreated
from gpuswarm.proto.models import Heartbeat, NodeRegistration, NodeState, Resources


@pytest.fixture
async def coordinator(tmp_path: Path):
    """(base URL, admin token) of a running coordinator app."""
    app = create_app(CoordinatorConfig(data_dir=tmp_path / "coordinator", start_dht=False, loop_interval=0.2))
    async with TestServer(app) as server:
        yield str(server.make_url("")).rstrip("/"), app[ADMIN_TOKEN]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_owner_calls_return_models_and_refusals_are_rejected(coordinator):
    url, admin_token = coordinator
    async with CoordinatorClient(url, token=admin_token) as admin:
        owner = await admin.create_owner("carol", 10.0)
        assert isinstance(owner, OwnerCreated) and owner.balance == 10.0 and owner.token
    client = CoordinatorClient(url, token=owner.token)  # not entered: each call has its own connection
    assert isinstance(await client.health(), Health)
    job = await client.submit_job({"workload": "digits-mlp", "stop": {"max_epochs": 1}})
    assert isinstance(job, JobInfo) and job.state == "pending" and job.spec.workload == "digits-mlp"
    detail = await client.job(job.id)
    assert isinstance(detail, JobDetail) and detail.events[0].message.startswith("submitted")
    assert [j.id for j in await client.jobs()] == [job.id] and await client.jobs("running") == []

    with pytest.raises(Rejected) as refused:
        await client.job("j-000000000000")
    assert (refused.value.status, refused.value.code) == (404, "unknown_job")
    assert str(refused.value).startswith("404 unknown_job: ")
    with pytest.raises(Rejected) as refused:
        await CoordinatorClient(url, token="gso_wrong").jobs()
    assert refused.value.status == 401
    with pytest.raises(Rejected) as refused:  # the coordinator validates what the client sends
        await client.submit_job({"workload": "digits-mlp", "min_nodes": 3, "max_nodes": 1})
    assert refused.value.status == 422 and "min_nodes" in refused.value.message


async def test_node_calls_are_signed_by_the_signer(coordinator):
    url, _ = coordinator
    identity = Identity(Ed25519PrivateKey.generate())
    async with CoordinatorClient(url, identity) as node:
        registered = await node.register(NodeRegistration(
            node_id=identity.node_id, resources=Resources(cpu_cores=2, ram_gb=4), software_version="test"))
        assert registered.node_id == identity.node_id and registered.mesh is None
        answer = await node.heartbeat(Heartbeat(node_id=identity.node_id, state=NodeState.IDLE))
        assert answer.ok and answer.challenge is True  # a first registration makes the GPU challenge due
        assert await node.assignments() == []
    with pytest.raises(TypeError, match="signer"):
        await CoordinatorClient(url).assignments()
    stranger = Identity(Ed25519PrivateKey.generate())
    with pytest.raises(Rejected) as refused:
        await CoordinatorClient(url, stranger).heartbeat(Heartbeat(node_id=stranger.node_id, state=NodeState.IDLE))
    assert refused.value.code == "unknown_node"  # the daemon registers again on this code


async def test_an_unreachable_coordinator_is_unavailable_with_a_clear_sentence():
    url = f"http://127.0.0.1:{closed_port()}"
    with pytest.raises(CoordinatorUnavailable) as down:
        await CoordinatorClient(url).health()
    assert str(down.value) == f"cannot reach the coordinator at {url}: Connection refused"
    assert down.value.status is None


async def test_a_5xx_or_an_answer_that_does_not_parse_is_unavailable():
    async def broken(request: web.Request) -> web.Response:
        return web.json_response({"error": {"code": "internal", "message": "internal server error"}}, status=500)

    async def garbled(request: web.Request) -> web.Response:
        return web.json_response({"ok": "maybe"})

    app = web.Application()
    app.router.add_get("/v1/jobs", broken)
    app.router.add_get("/v1/health", garbled)
    async with TestServer(app) as server:
        client = CoordinatorClient(str(server.make_url("")))
        with pytest.raises(CoordinatorUnavailable) as failed:
            await client.jobs()
        assert (failed.value.status, failed.value.code) == (500, "internal")
        assert str(failed.value).endswith("answered HTTP 500 to GET /v1/jobs: internal server error")
        with pytest.raises(CoordinatorUnavailable, match="cannot read"):
            await client.health()


async def test_a_4xx_that_is_not_the_apis_error_body_is_unavailable_not_rejected():
    """A proxy's HTML 413 or 404 says nothing about the request: the node must keep its report or model and retry,
    as it did before the clients were merged; the coordinator's own 4xx stays a Rejected."""

    async def proxy(request: web.Request) -> web.Response:
        return web.Response(text="<html><body>413 Request Entity Too Large</body></html>", status=413,
                            content_type="text/html")

    async def refused(request: web.Request) -> web.Response:
        return web.json_response({"error": {"code": "unknown_job", "message": "no job"}}, status=404)

    app = web.Application()
    app.router.add_get("/v1/jobs", proxy)
    app.router.add_get("/v1/health", refused)
    async with TestServer(app) as server:
        client = CoordinatorClient(str(server.make_url("")))
        with pytest.raises(CoordinatorUnavailable) as failed:
            await client.jobs()
        assert failed.value.status == 413 and "proxy" in failed.value.message
        with pytest.raises(Rejected) as refusal:
            await client.health()
        assert (refusal.value.status, refusal.value.code) == (404, "unknown_job")


async def test_downloads_are_checked_against_their_sha256(coordinator, tmp_path):
    url, admin_token = coordinator
    owner = await CoordinatorClient(url, token=admin_token).create_owner("dave", 10.0)
    client = CoordinatorClient(url, token=owner.token)
    job = await client.submit_job({"workload": "digits-mlp", "stop": {"max_epochs": 1}})
    path, digest = await client.download_tensorboard(job.id, tmp_path / "tb")  # rendered from the (empty) curve
    assert path == tmp_path / "tb" / job.id / "tensorboard.tfevents"
    assert digest == hashlib.sha256(path.read_bytes()).hexdigest()
    with pytest.raises(ApiError, match="not a job id"):
        await client.download_tensorboard("../escape", tmp_path / "tb")
    with pytest.raises(Rejected) as missing:
        await client.download_artifact(job.id, "model.pt", tmp_path / "model.pt")
    assert missing.value.code == "unknown_artifact" and not (tmp_path / "model.pt.part").exists()

    async def lying(request: web.Request) -> web.Response:
        return web.Response(body=b"model bytes", headers={"X-Content-SHA256": "0" * 64})

    app = web.Application()
    app.router.add_get("/v1/jobs/{job_id}/artifacts/{name}", lying)
    async with TestServer(app) as server:
        with pytest.raises(ApiError, match="corrupt"):
            await CoordinatorClient(str(server.make_url(""))).download_artifact(job.id, "model.pt",
                                                                                tmp_path / "model.pt")
    assert not (tmp_path / "model.pt").exists() and not (tmp_path / "model.pt.part").exists()


async def test_the_blocking_client_runs_the_same_calls_from_a_thread(coordinator):
    url, admin_token = coordinator
    with SyncClient(url, token=admin_token) as admin:
        owner = await asyncio.to_thread(admin.create_owner, "erin", 1.0)  # its own loop, in a worker thread
    owner_client = SyncClient(url, token=owner.token)
    assert (await asyncio.to_thread(owner_client.whoami)).name == "erin"
    raw = await asyncio.to_thread(owner_client.request, "GET", "/v1/owners/me")
    assert json.loads(json.dumps(raw))["id"] == owner.id


async def test_a_node_uploads_the_final_model_and_its_owner_downloads_it(coordinator, tmp_path):
    url, admin_token = coordinator
    owner = await CoordinatorClient(url, token=admin_token).create_owner("grace", 10.0)
    identity = Identity(Ed25519PrivateKey.generate())
    model = tmp_path / "model.pt"
    model.write_bytes(b"weights" * 1000)
    async with CoordinatorClient(url, identity) as node, CoordinatorClient(url, token=owner.token) as owner_client:
        await node.register(NodeRegistration(node_id=identity.node_id, resources=Resources(cpu_cores=2, ram_gb=4),
                                             software_version="test"))
        job = await owner_client.submit_job({"workload": "digits-mlp", "stop": {"max_epochs": 1}})
        for _ in range(100):
            if assignments := await node.assignments():
                break
            await asyncio.sleep(0.1)
        assert [a.job_id for a in assignments] == [job.id]
        stored = await node.upload(job.id, model, final=True, accuracy=0.9, epoch=1.0)
        assert (stored.name, stored.size) == ("model.pt", model.stat().st_size)
        done = await owner_client.job(job.id)
        assert done.state == "completed" and done.final_accuracy == 0.9
        assert [(a.name, a.node_id, a.final) for a in done.artifacts] == [("model.pt", identity.node_id, True)]
        digest = await owner_client.download_artifact(job.id, "model.pt", tmp_path / "copy.pt")
    assert (tmp_path / "copy.pt").read_bytes() == model.read_bytes() and digest == stored.sha256
    assert ENVELOPE_HEADER == "X-Gpuswarm-Envelope"
