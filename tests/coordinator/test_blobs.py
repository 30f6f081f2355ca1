"""The content-addressed store over real HTTP: owner uploads and reads, per-owner possession, quotas, job submits
that name blobs, node reads with signed headers, checkpoints, metrics, retention and adopting old artifact files.

The real aiohttp app on every backend of the `database_url` fixture. Every refused request is checked, as in
test_api, for its status and code and for an unchanged database (every row of every table), and where bytes were
involved for an unchanged store directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer
from gpuswarm.coordinator import blobs
from gpuswarm.coordinator.app import create_app
from gpuswarm.coordinator.config import BLOB_LOCK, BLOBS, SESSIONS, CoordinatorConfig
from gpuswarm.coordinator.db import Blob, BlobHolder, JobBlob, Suspicion
from gpuswarm.node.identity import Identity
from sqlalchemy import select
from test_api import (
    ENVELOPE_HEADER,
    SharedServerClient,
    artifact_request,
    new_identity,
    new_owner_token,
    poll,
    register,
    registration,
    rejected,
    signed,
    snapshot,
    wait_for_assignment,
)

MAX_BLOB = 4096
QUOTA = 3000


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def stored_files(data_dir: Path) -> list[Path]:
    root = data_dir / "blobs"
    return sorted(p for p in root.rglob("*") if p.is_file()) if root.exists() else []


def code_spec(data: bytes, **overrides) -> dict:
    spec = {"name": "own code", "code": {"sha256": sha(data), "size": len(data), "format": "tar",
                                         "entrypoint": "train:workload"},
            "stop": {"max_steps": 10}, "min_nodes": 1, "max_nodes": 1}
    return spec | overrides


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    return tmp_path / "coordinator"


def config(data_dir: Path, database_url: str | None, **overrides) -> CoordinatorConfig:
    return CoordinatorConfig(data_dir=data_dir, database_url=database_url, start_dht=False, loop_interval=0.2,
                             max_artifact_bytes=MAX_BLOB, owner_quota_bytes=QUOTA,
                             blob_sweep_interval=3600.0, **overrides)


@pytest.fixture
async def server(data_dir: Path, database_url: str | None):
    async with TestServer(create_app(config(data_dir, database_url))) as server:
        yield server


async def owner(server: TestServer, name: str) -> TestClient:
    token = await new_owner_token(server, server.app, name)
    client = SharedServerClient(server, headers={"Authorization": f"Bearer {token}"})
    await client.start_server()
    return client


@pytest.fixture
async def alice(server):
    client = await owner(server, "alice")
    yield client
    await client.close()


@pytest.fixture
async def bob(server):
    client = await owner(server, "bob")
    yield client
    await client.close()


async def upload(client: TestClient, data: bytes, digest: str | None = None) -> dict:
    response = await client.put(f"/v1/blobs/{digest or sha(data)}", data=data)
    assert response.status == 201, await response.text()
    return await response.json()


async def missing(client: TestClient, shas: list[str]) -> list[str]:
    response = await client.post("/v1/blobs/missing", json={"sha256": shas})
    assert response.status == 200, await response.text()
    return (await response.json())["missing"]


async def custom_node(client: TestClient) -> Identity:
    """A node whose operator allows owners' own code."""
    node = new_identity()
    body = registration(node, resources={"gpus": [], "cpu_cores": 4, "ram_gb": 8.0, "custom_code": True})
    response = await client.post("/v1/nodes/register", json=signed(node, "register", body))
    assert response.status == 200, await response.text()
    return node


def fetch_headers(node: Identity, job_id: str, digest: str) -> dict:
    envelope = signed(node, "fetch", {"job_id": job_id, "node_id": node.node_id, "sha256": digest})
    return {ENVELOPE_HEADER: json.dumps(envelope)}


@pytest.fixture
async def code_job(alice):
    """Alice's code, uploaded; a job running it; a node that allows custom code, assigned to it."""
    code = b"code tarball bytes" * 10
    await upload(alice, code)
    response = await alice.post("/v1/jobs", json=code_spec(code, training={"checkpoints_kept": 2}))
    assert response.status == 201, await response.text()
    job_id = (await response.json())["id"]
    node = await custom_node(alice)
    await wait_for_assignment(alice, node, job_id)
    return node, job_id, code


# ---------------------------------------------------------------------------------------------------- owners


async def test_upload_then_missing_then_download(alice, data_dir):
    data = b"a dataset" * 50
    assert await missing(alice, [sha(data), "0" * 64]) == [sha(data), "0" * 64]
    stored = await upload(alice, data)
    assert stored == {"ok": True, "sha256": sha(data), "size": len(data), "held_bytes": len(data),
                      "quota_bytes": QUOTA}
    assert await missing(alice, [sha(data), "0" * 64]) == ["0" * 64]
    response = await alice.get(f"/v1/blobs/{sha(data)}")
    assert response.status == 200 and await response.read() == data
    assert response.headers["X-Content-SHA256"] == sha(data)
    assert stored_files(data_dir) == [data_dir / "blobs" / sha(data)[:2] / sha(data)]


async def test_possession_is_per_owner_and_the_bytes_are_stored_once(alice, bob, data_dir):
    data = b"alice's private data"
    await upload(alice, data)
    assert await missing(bob, [sha(data)]) == [sha(data)]  # bob learns nothing of what alice uploaded
    await rejected(bob, "GET", f"/v1/blobs/{sha(data)}", 404, "unknown_blob")
    # Bob cannot claim the digest without the bytes...
    await rejected(bob, "PUT", f"/v1/blobs/{sha(data)}", 400, "digest_mismatch", data=b"X" * len(data))
    # ...and with them he holds it too; the store keeps one copy.
    assert (await upload(bob, data))["held_bytes"] == len(data)
    assert await missing(bob, [sha(data)]) == []
    assert stored_files(data_dir) == [data_dir / "blobs" / sha(data)[:2] / sha(data)]
    async with alice.app[SESSIONS]() as session:
        assert len((await session.scalars(select(BlobHolder).where(BlobHolder.sha256 == sha(data)))).all()) == 2


async def test_bytes_not_matching_their_digest_are_refused_and_nothing_is_stored(alice, data_dir):
    data = b"the real bytes"
    await rejected(alice, "PUT", f"/v1/blobs/{sha(data)}", 400, "digest_mismatch", data=b"other bytes!!!")
    # The size is the body's Content-Length: more bytes are other bytes.
    await rejected(alice, "PUT", f"/v1/blobs/{sha(data)}", 400, "digest_mismatch", data=data + b"more")
    assert stored_files(data_dir) == []


async def test_a_blob_over_the_per_artifact_cap_is_413(alice, data_dir):
    data = os.urandom(MAX_BLOB + 1)
    error = await rejected(alice, "PUT", f"/v1/blobs/{sha(data)}", 413, "payload_too_large", data=data)
    assert str(MAX_BLOB) in error["message"]
    assert stored_files(data_dir) == []


async def test_the_owners_quota_counts_what_it_holds(alice, bob, data_dir):
    first, second = os.urandom(2000), os.urandom(1500)
    await upload(alice, first)
    error = await rejected(alice, "PUT", f"/v1/blobs/{sha(second)}", 403, "quota_exceeded", data=second)
    assert "2000" in error["message"] and str(QUOTA) in error["message"] and "1500" in error["message"]
    assert stored_files(data_dir) == [data_dir / "blobs" / sha(first)[:2] / sha(first)]
    assert (await upload(alice, first))["held_bytes"] == 2000  # held already: no more quota used
    assert (await upload(bob, second))["held_bytes"] == 1500  # another owner's quota is its own


@pytest.mark.parametrize("method, path, kwargs, status, code", [
    ("PUT", "/v1/blobs/ABC", {"data": b"x"}, 400, "bad_digest"),
    ("GET", f"/v1/blobs/{'A' * 64}", {}, 400, "bad_digest"),
    ("POST", "/v1/blobs/missing", {"json": {"sha256": ["nothex"]}}, 422, "invalid"),
    ("POST", "/v1/blobs/missing", {"json": {"sha256": ["0" * 64] * 65}}, 422, "invalid"),
    ("POST", "/v1/blobs/missing", {"json": {"sha256": []}}, 422, "invalid"),
    ("POST", "/v1/blobs/missing", {"json": {"digests": ["0" * 64]}}, 422, "invalid"),
    ("GET", f"/v1/blobs/{'0' * 64}", {}, 404, "unknown_blob"),
])
async def test_bad_blob_requests_are_refused(alice, method, path, kwargs, status, code):
    await rejected(alice, method, path, status, code, **kwargs)


async def test_blob_routes_need_an_owner_token(server):
    async with SharedServerClient(server) as anonymous:
        await rejected(anonymous, "POST", "/v1/blobs/missing", 401, "no_token", json={"sha256": ["0" * 64]})
        await rejected(anonymous, "PUT", f"/v1/blobs/{sha(b'x')}", 401, "no_token", data=b"x")
        await rejected(anonymous, "GET", f"/v1/blobs/{sha(b'x')}", 401, "no_token")


# ---------------------------------------------------------------------------------------------------- job submit


async def test_submit_needs_the_code_held_by_the_submitter(alice, bob):
    code = b"bob's code"
    error = await rejected(alice, "POST", "/v1/jobs", 409, "blob_not_held", json=code_spec(code))
    assert "upload the job's code" in error["message"] and sha(code)[:12] in error["message"]
    await upload(bob, code)  # someone else's bytes do not count
    await rejected(alice, "POST", "/v1/jobs", 409, "blob_not_held", json=code_spec(code))
    await upload(alice, code)
    wrong_size = code_spec(code)
    wrong_size["code"]["size"] += 1
    await rejected(alice, "POST", "/v1/jobs", 409, "blob_size_mismatch", json=wrong_size)
    dataset = {"sha256": sha(b"data"), "size": 4, "format": "file", "name": "data.bin"}
    error = await rejected(alice, "POST", "/v1/jobs", 409, "blob_not_held", json=code_spec(code, dataset=dataset))
    assert "dataset" in error["message"]

    await upload(alice, b"data")
    response = await alice.post("/v1/jobs", json=code_spec(code, dataset=dataset))
    assert response.status == 201, await response.text()
    job = await response.json()
    assert job["spec"]["code"]["sha256"] == sha(code) and job["spec"]["dataset"]["name"] == "data.bin"
    async with alice.app[SESSIONS]() as session:
        rows = (await session.execute(select(JobBlob.sha256, JobBlob.role).where(JobBlob.job_id == job["id"]))).all()
    assert sorted(rows) == sorted([(sha(code), "code"), (sha(b"data"), "dataset")])


async def test_a_custom_code_job_goes_only_to_a_node_that_allows_it(alice):
    code = b"some code"
    await upload(alice, code)
    plain = await register(alice)
    response = await alice.post("/v1/jobs", json=code_spec(code))
    job_id = (await response.json())["id"]
    opted = await custom_node(alice)
    await wait_for_assignment(alice, opted, job_id)
    assert await poll(alice, plain) == []


# ---------------------------------------------------------------------------------------------------- node reads


async def test_an_assigned_node_fetches_the_jobs_code_once_per_signed_request(alice, code_job):
    node, job_id, code = code_job
    headers = fetch_headers(node, job_id, sha(code))
    response = await alice.get(f"/v1/jobs/{job_id}/blobs/{sha(code)}", headers=headers)
    assert response.status == 200, await response.text()
    assert await response.read() == code and response.headers["X-Content-SHA256"] == sha(code)
    await rejected(alice, "GET", f"/v1/jobs/{job_id}/blobs/{sha(code)}", 409, "replay", headers=headers)


async def test_node_fetches_that_are_refused(alice, bob, code_job):
    node, job_id, code = code_job
    url = f"/v1/jobs/{job_id}/blobs/{sha(code)}"
    outsider = await custom_node(alice)  # registered, never assigned to this job
    await rejected(alice, "GET", url, 403, "not_assigned", headers=fetch_headers(outsider, job_id, sha(code)))
    other = b"alice's other data"
    await upload(alice, other)  # held by the job's owner, but not the job's
    await rejected(alice, "GET", f"/v1/jobs/{job_id}/blobs/{sha(other)}", 403, "not_a_job_blob",
                   headers=fetch_headers(node, job_id, sha(other)))
    await rejected(alice, "GET", f"/v1/jobs/{job_id}/blobs/{'0' * 64}", 403, "not_a_job_blob",
                   headers=fetch_headers(node, job_id, "0" * 64))
    await rejected(alice, "GET", url, 400, "bad_request", headers=fetch_headers(node, job_id, sha(other)))
    await rejected(alice, "GET", url, 401, "bad_signature")
    stranger = new_identity()
    await rejected(alice, "GET", url, 404, "unknown_node", headers=fetch_headers(stranger, job_id, sha(code)))
    tampered = json.loads(fetch_headers(node, job_id, sha(code))[ENVELOPE_HEADER])
    tampered["payload"]["sha256"] = sha(other)
    await rejected(alice, "GET", f"/v1/jobs/{job_id}/blobs/{sha(other)}", 401, "bad_signature",
                   headers={ENVELOPE_HEADER: json.dumps(tampered)})


async def test_a_node_no_longer_assigned_cannot_fetch(alice, code_job):
    node, job_id, code = code_job
    assert (await alice.post(f"/v1/jobs/{job_id}/cancel")).status == 200
    await rejected(alice, "GET", f"/v1/jobs/{job_id}/blobs/{sha(code)}", 403, "not_assigned",
                   headers=fetch_headers(node, job_id, sha(code)))


# ---------------------------------------------------------------------------------------------------- checkpoints


async def test_checkpoints_keep_the_newest_and_ride_on_the_assignment(alice, code_job, data_dir):
    node, job_id, _ = code_job
    for step in (10, 30, 20):
        data = f"checkpoint at {step}".encode()
        response = await alice.put(f"/v1/jobs/{job_id}/artifacts/ckpt-{step}.pt", **artifact_request(
            node, job_id, data, name=f"ckpt-{step}.pt", checkpoint_step=step))
        assert response.status == 201, await response.text()
    listing = await (await alice.get(f"/v1/jobs/{job_id}/artifacts")).json()
    assert listing["job_id"] == job_id
    assert sorted((a["name"], a["checkpoint_step"]) for a in listing["artifacts"]) == [
        ("ckpt-20.pt", 20), ("ckpt-30.pt", 30)]  # checkpoints_kept = 2: step 10 went
    [assignment] = await poll(alice, node)
    newest = b"checkpoint at 30"
    assert assignment["checkpoint"] == {"name": "ckpt-30.pt", "sha256": sha(newest), "size": len(newest),
                                        "step": 30}
    # A member node reads a checkpoint of its job (to resume from it).
    response = await alice.get(f"/v1/jobs/{job_id}/blobs/{sha(newest)}",
                               headers=fetch_headers(node, job_id, sha(newest)))
    assert response.status == 200 and await response.read() == newest
    # The dropped checkpoint's bytes are no longer the job's.
    old = b"checkpoint at 10"
    await rejected(alice, "GET", f"/v1/jobs/{job_id}/blobs/{sha(old)}", 403, "not_a_job_blob",
                   headers=fetch_headers(node, job_id, sha(old)))


async def test_a_banned_nodes_checkpoints_are_not_handed_to_the_others(alice):
    """A node convicted of cheating (two witnesses: a ban) may have written checkpoints; the members that go on, and
    the nodes that take the job over, resume from the newest checkpoint of another node."""
    code = b"code for two nodes" * 10
    await upload(alice, code)
    response = await alice.post("/v1/jobs", json=code_spec(code, max_nodes=2, training={"checkpoints_kept": 3}))
    assert response.status == 201, await response.text()
    job_id = (await response.json())["id"]
    cheat, honest = await custom_node(alice), await custom_node(alice)
    for node in (cheat, honest):
        await wait_for_assignment(alice, node, job_id)
    for node, step in ((honest, 20), (cheat, 30)):
        data = f"checkpoint at {step}".encode()
        response = await alice.put(f"/v1/jobs/{job_id}/artifacts/ckpt-{step}.pt", **artifact_request(
            node, job_id, data, name=f"ckpt-{step}.pt", checkpoint_step=step))
        assert response.status == 201, await response.text()
    [assignment] = await poll(alice, honest)
    assert assignment["checkpoint"]["name"] == "ckpt-30.pt"
    async with alice.app[SESSIONS].begin() as session:
        for reporter in ("a" * 16, "b" * 16):
            session.add(Suspicion(job_id=job_id, node_id=cheat.node_id, reporter=reporter, epoch=3, at=time.time()))
    [assignment] = await poll(alice, honest)
    assert assignment["checkpoint"]["name"] == "ckpt-20.pt"


async def test_a_final_model_with_metrics_completes_the_job(alice, code_job):
    node, job_id, _ = code_job
    metrics = {"val_bpb": 2.1, "accuracy": 0.5}
    response = await alice.put(f"/v1/jobs/{job_id}/artifacts/model.pt", **artifact_request(
        node, job_id, b"final weights", final=True, accuracy=0.5, metrics=metrics))
    assert response.status == 201, await response.text()
    job = await (await alice.get(f"/v1/jobs/{job_id}")).json()
    assert job["state"] == "completed" and job["final_metrics"] == metrics
    [artifact] = job["artifacts"]
    assert artifact["metrics"] == metrics and artifact["final"] and artifact["checkpoint_step"] is None
    response = await alice.get(f"/v1/jobs/{job_id}/artifacts/model.pt")
    assert await response.read() == b"final weights"


async def test_an_artifact_cannot_be_final_and_a_checkpoint(alice, code_job, data_dir):
    node, job_id, _ = code_job
    await rejected(alice, "PUT", f"/v1/jobs/{job_id}/artifacts/model.pt", 400, "bad_request", **artifact_request(
        node, job_id, b"weights", final=True, checkpoint_step=3))


async def test_progress_metrics_reach_the_job_and_its_curve(alice, code_job):
    node, job_id, _ = code_job
    report = {"job_id": job_id, "epoch": 0.5, "global_step": 4, "samples_per_second": 10.0, "peers": 1,
              "loss": 1.5, "metrics": {"val_bpb": 2.5, "val_loss": 1.7}}
    body = signed(node, "heartbeat", {"node_id": node.node_id, "state": "training", "progress": [report]})
    assert (await alice.post("/v1/nodes/heartbeat", json=body)).status == 200
    job = await (await alice.get(f"/v1/jobs/{job_id}")).json()
    assert job["progress"]["metrics"] == {"val_bpb": 2.5, "val_loss": 1.7}
    curve = await (await alice.get(f"/v1/jobs/{job_id}/progress")).json()
    assert curve["points"][-1]["metrics"] == {"val_bpb": 2.5, "val_loss": 1.7}


async def test_another_owner_cannot_list_a_jobs_artifacts(alice, bob, code_job):
    _, job_id, _ = code_job
    await rejected(bob, "GET", f"/v1/jobs/{job_id}/artifacts", 403, "not_your_job")


# ---------------------------------------------------------------------------------------------------- retention


async def test_retention_removes_only_unreferenced_unused_blobs(alice, code_job, data_dir):
    node, job_id, code = code_job
    loose = b"uploaded and never used"
    await upload(alice, loose)
    checkpoint = b"a checkpoint"
    response = await alice.put(f"/v1/jobs/{job_id}/artifacts/ckpt.pt", **artifact_request(
        node, job_id, checkpoint, name="ckpt.pt", checkpoint_step=1))
    assert response.status == 201
    app = alice.app
    later = time.time() + 10

    # Recently used: nothing goes.
    assert await blobs.sweep(app[SESSIONS], app[BLOBS], app[BLOB_LOCK], time.time(), 3600) == []
    # Past retention: only the loose blob goes (the code belongs to a running job, the checkpoint is an artifact).
    assert await blobs.sweep(app[SESSIONS], app[BLOBS], app[BLOB_LOCK], later, 1.0) == [sha(loose)]
    assert not (data_dir / "blobs" / sha(loose)[:2] / sha(loose)).exists()
    assert await missing(alice, [sha(loose), sha(code)]) == [sha(loose)]
    alice_id = await owner_id(alice)
    async with app[SESSIONS]() as session:  # (one connection on SQLite: no HTTP call while it is open)
        assert await session.get(Blob, sha(loose)) is None
        assert await session.get(BlobHolder, (alice_id, sha(loose))) is None

    # Once the job ended and retention passed, its code goes too; its artifacts stay.
    assert (await alice.post(f"/v1/jobs/{job_id}/cancel")).status == 200
    assert await blobs.sweep(app[SESSIONS], app[BLOBS], app[BLOB_LOCK], time.time() + 100, 10.0) == [sha(code)]
    assert stored_files(data_dir) == [data_dir / "blobs" / sha(checkpoint)[:2] / sha(checkpoint)]


async def owner_id(client: TestClient) -> str:
    return (await (await client.get("/v1/owners/me")).json())["id"]


# ---------------------------------------------------------------------------------------------------- older data


async def test_artifact_files_of_an_older_data_dir_are_adopted_at_start(data_dir, database_url):
    """An artifact stored where the previous version kept it (artifacts/JOB/NAME), with no blob row, still
    downloads after a restart: its file moved into the store."""
    data = b"model from an older version"
    async with TestServer(create_app(config(data_dir, database_url))) as server:
        client = await owner(server, "alice")
        node = await register(client)
        response = await client.post("/v1/jobs", json={"workload": "digits-mlp", "stop": {"max_epochs": 1}})
        job_id = (await response.json())["id"]
        await wait_for_assignment(client, node, job_id)
        response = await client.put(f"/v1/jobs/{job_id}/artifacts/model.pt",
                                    **artifact_request(node, job_id, data, final=True, accuracy=0.5))
        assert response.status == 201
        token = client.session.headers["Authorization"]
        await client.close()
        async with server.app[SESSIONS].begin() as session:  # as an older version left it: no blob row
            await session.execute(Blob.__table__.delete())
    legacy = data_dir / "artifacts" / job_id / "model.pt"
    legacy.parent.mkdir(parents=True, exist_ok=True)
    os.replace(data_dir / "blobs" / sha(data)[:2] / sha(data), legacy)

    async with TestServer(create_app(config(data_dir, database_url))) as server, \
            TestClient(server, headers={"Authorization": token}) as client:
        response = await client.get(f"/v1/jobs/{job_id}/artifacts/model.pt")
        assert response.status == 200 and await response.read() == data
        assert not legacy.exists() and (data_dir / "blobs" / sha(data)[:2] / sha(data)).is_file()
        before = await snapshot(server.app)
    assert before["blobs"][0][0] == sha(data)
