"""API tests of the coordinator: the real aiohttp app over real HTTP, real SQLite, real Ed25519 signatures.

Every rejected request is checked for (a) a 4xx status, (b) the JSON error shape {"error": {"code", "message"}}
with the expected code, and (c) an unchanged database (every row of every table, before == after).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from gpuswarm.coordinator.app import create_app
from gpuswarm.coordinator.config import ADMIN_TOKEN, CONFIG, SESSIONS, CoordinatorConfig
from gpuswarm.coordinator.db import Base
from gpuswarm.node.identity import Identity
from gpuswarm.proto import signing
from gpuswarm.proto.models import CLAIM_KIND
from sqlalchemy import select

ENVELOPE_HEADER = "X-Gpuswarm-Envelope"
UNKNOWN_JOB = "j-000000000000"
ASSIGNMENT_WAIT = 10.0  # seconds to wait for the background loop (interval 0.2 s) to match a job


# ---------------------------------------------------------------------------------------------------- fixtures


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    return tmp_path / "coordinator"


# The signature tests run with CoordinatorConfig.signature_process both ways (conftest's fixture is False).
BOTH_CHECKERS = pytest.mark.parametrize("signature_process", [False, True], ids=["in-loop", "child-process"])


@pytest.fixture
async def client(data_dir: Path, database_url: str | None, signature_process: bool):
    app = create_app(CoordinatorConfig(data_dir=data_dir, database_url=database_url, start_dht=False,
                                       loop_interval=0.2, signature_process=signature_process))
    async with TestServer(app) as server:
        token = await new_owner_token(server, app)
        async with TestClient(server, headers={"Authorization": f"Bearer {token}"}) as client:
            yield client


class SharedServerClient(TestClient):
    """A TestClient that leaves the server running when it closes, so several callers can share one app."""

    async def close(self) -> None:
        if not self._closed:
            await self._session.close()
            self._closed = True


async def new_owner_token(server: TestServer, app: web.Application, name: str = "owner",
                          credits: float = 1000.0) -> str:
    """A job owner's API token, made through the admin API."""
    async with SharedServerClient(server, headers={"Authorization": f"Bearer {app[ADMIN_TOKEN]}"}) as admin:
        response = await admin.post("/v1/owners", json={"name": name, "credits": credits})
        assert response.status == 201, await response.text()
        return (await response.json())["token"]


def new_identity() -> Identity:
    return Identity(Ed25519PrivateKey.generate())


# ---------------------------------------------------------------------------------------------------- helpers


async def snapshot(app: web.Application) -> dict[str, list[tuple]]:
    """Every row of every table, in primary-key order."""
    state: dict[str, list[tuple]] = {}
    async with app[SESSIONS]() as session:
        for table in Base.metadata.sorted_tables:
            rows = await session.execute(select(table).order_by(*table.primary_key.columns))
            state[table.name] = [tuple(row) for row in rows]
    return state


async def error_of(response, status: int, code: str | None) -> dict:
    """Assert the API's error shape and return its inner object."""
    assert response.status == status, (response.status, await response.text())
    assert 400 <= response.status < 500
    assert response.content_type == "application/json"
    body = await response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert isinstance(error, dict) and isinstance(error.get("code"), str) and isinstance(error.get("message"), str)
    assert error["message"], body
    if code is not None:
        assert error["code"] == code, body
    return error


async def rejected(client: TestClient, method: str, path: str, status: int, code: str | None, **kwargs) -> dict:
    """Send one request that must be refused with `status`/`code` and leave the database exactly as it was."""
    before = await snapshot(client.app)
    response = await client.request(method, path, **kwargs)
    error = await error_of(response, status, code)
    after = await snapshot(client.app)
    assert after == before, f"{method} {path} changed the database although it was refused"
    return error


def registration(identity: Identity, **overrides) -> dict:
    payload = {
        "node_id": identity.node_id,
        "resources": {"gpus": [], "cpu_cores": 4, "ram_gb": 8.0},
        "software_version": "gpuswarm-test",
        "price_per_gpu_hour": 0.0,
        "endpoints": ["127.0.0.1"],
    }
    return payload | overrides


def signed(identity: Identity, kind: str, payload: dict) -> dict:
    return identity.sign(kind, payload).model_dump(mode="json")


def job_spec(**overrides) -> dict:
    spec = {"name": "test job", "workload": "digits-mlp", "hyperparameters": {"hidden": 32},
            "stop": {"max_epochs": 2}, "min_nodes": 1, "max_nodes": 1}
    return spec | overrides


def claim(identity: Identity, job_id: str, epoch: int = 0, **overrides) -> dict:
    """A signed claim (the envelope a training process shares in its round)."""
    now = time.time()
    payload = {"job_id": job_id, "node_id": identity.node_id, "epoch": epoch, "samples": 640, "steps": 20,
               "compute_seconds": 12.5, "window_start": now - 30, "window_end": now - 1}
    return signed(identity, CLAIM_KIND, payload | overrides)


def round_report(identity: Identity, job_id: str, claims: list[dict], epoch: int = 0, solo: bool = False) -> dict:
    return signed(identity, "round_report", {"job_id": job_id, "node_id": identity.node_id, "epoch": epoch,
                                             "solo": solo, "claims": claims})


def artifact_request(identity: Identity, job_id: str, data: bytes, name: str = "model.pt", **overrides) -> dict:
    meta = {"job_id": job_id, "node_id": identity.node_id, "name": name,
            "sha256": hashlib.sha256(data).hexdigest(), "size": len(data)} | overrides
    return {"headers": {ENVELOPE_HEADER: json.dumps(signed(identity, "artifact", meta))}, "data": data}


async def register(client: TestClient, identity: Identity | None = None) -> Identity:
    identity = identity or new_identity()
    response = await client.post("/v1/nodes/register", json=signed(identity, "register", registration(identity)))
    assert response.status == 200, await response.text()
    return identity


async def submit(client: TestClient, **overrides) -> str:
    response = await client.post("/v1/jobs", json=job_spec(**overrides))
    assert response.status == 201, await response.text()
    return (await response.json())["id"]


async def poll(client: TestClient, identity: Identity) -> list[dict]:
    response = await client.post("/v1/nodes/assignments",
                                 json=signed(identity, "poll", {"node_id": identity.node_id}))
    assert response.status == 200, await response.text()
    return (await response.json())["assignments"]


async def wait_for_assignment(client: TestClient, identity: Identity, job_id: str) -> dict:
    deadline = time.monotonic() + ASSIGNMENT_WAIT
    while time.monotonic() < deadline:
        for assignment in await poll(client, identity):
            if assignment["job_id"] == job_id:
                return assignment
        await asyncio.sleep(0.1)
    raise AssertionError(f"node {identity.node_id} got no assignment to {job_id} within {ASSIGNMENT_WAIT}s")


@pytest.fixture
async def assigned(client: TestClient) -> tuple[Identity, str]:
    """One registered node, matched by the background loop to a 1-node job."""
    node = await register(client)
    job_id = await submit(client, min_nodes=1, max_nodes=1)
    assignment = await wait_for_assignment(client, node, job_id)
    assert assignment["node_id"] == node.node_id and assignment["state"] == "active"
    assert assignment["job_state"] == "running" and assignment["num_shards"] == 1
    return node, job_id


# ---------------------------------------------------------------------------------------------------- happy paths


async def test_health(client: TestClient):
    response = await client.get("/v1/health")
    assert response.status == 200
    assert (await response.json())["ok"] is True


async def test_register_returns_node_id_peers_and_heartbeat_interval(client: TestClient):
    node = new_identity()
    response = await client.post("/v1/nodes/register", json=signed(node, "register", registration(node)))
    assert response.status == 200, await response.text()
    body = await response.json()
    assert body["node_id"] == node.node_id
    assert body["dht_initial_peers"] == []  # start_dht=False
    assert body["heartbeat_interval"] == client.app[CONFIG].heartbeat_interval
    assert body["advert_ttl"] == client.app[CONFIG].advert_ttl

    nodes = (await (await client.get("/v1/nodes")).json())["nodes"]
    assert [n["id"] for n in nodes] == [node.node_id]
    assert nodes[0]["online"] is True and nodes[0]["state"] == "idle"


@BOTH_CHECKERS
async def test_heartbeat_and_poll_of_a_registered_node(client: TestClient):
    node = await register(client)
    response = await client.post("/v1/nodes/heartbeat",
                                 json=signed(node, "heartbeat", {"node_id": node.node_id, "state": "idle"}))
    assert response.status == 200, await response.text()
    assert (await response.json())["ok"] is True
    assert await poll(client, node) == []


async def test_submit_list_get_and_cancel_a_job(client: TestClient):
    response = await client.post("/v1/jobs", json=job_spec(min_nodes=2, max_nodes=3))
    assert response.status == 201, await response.text()
    job = await response.json()
    assert job["state"] == "pending" and job["name"] == "test job"
    assert job["spec"]["hyperparameters"]["hidden"] == 32
    assert job["spec"]["hyperparameters"]["learning_rate"] == 0.02  # defaults filled in by the workload schema

    listed = (await (await client.get("/v1/jobs")).json())["jobs"]
    assert [j["id"] for j in listed] == [job["id"]]
    detail = await (await client.get(f"/v1/jobs/{job['id']}")).json()
    assert detail["id"] == job["id"] and detail["assignments"] == [] and detail["contributions"] == []

    response = await client.post(f"/v1/jobs/{job['id']}/cancel")
    assert response.status == 200
    assert (await response.json())["state"] == "cancelled"


async def test_final_artifact_completes_the_job_and_downloads_byte_for_byte(client, assigned, data_dir):
    node, job_id = assigned
    data = bytes(range(256)) * 40 + b"final model"
    response = await client.put(f"/v1/jobs/{job_id}/artifacts/model.pt",
                                **artifact_request(node, job_id, data, final=True, accuracy=0.93))
    assert response.status == 201, await response.text()
    assert (await response.json()) == {"ok": True, "name": "model.pt", "size": len(data),
                                       "sha256": hashlib.sha256(data).hexdigest()}

    job = await (await client.get(f"/v1/jobs/{job_id}")).json()
    assert job["state"] == "completed"
    assert job["final_accuracy"] == pytest.approx(0.93)
    assert job["finished_at"] is not None
    assert [a["state"] for a in job["assignments"]] == ["finished"]
    assert [(a["name"], a["size"], a["final"]) for a in job["artifacts"]] == [("model.pt", len(data), True)]

    response = await client.get(f"/v1/jobs/{job_id}/artifacts/model.pt")
    assert response.status == 200
    assert await response.read() == data
    assert response.headers["X-Content-SHA256"] == hashlib.sha256(data).hexdigest()
    sha256 = hashlib.sha256(data).hexdigest()  # the bytes live once, in the content-addressed store
    assert _files_under(data_dir / "blobs") == [data_dir / "blobs" / sha256[:2] / sha256]

    # A completed job takes no second final artifact.
    await rejected(client, "PUT", f"/v1/jobs/{job_id}/artifacts/model.pt", 409, "job_final",
                   **artifact_request(node, job_id, b"another", final=True, accuracy=0.5))


async def test_solo_claims_of_a_lone_member_are_credited(client: TestClient, assigned):
    node, job_id = assigned
    for epoch, samples in ((0, 200), (1, 150)):
        response = await client.post("/v1/rounds", json=round_report(
            node, job_id, [claim(node, job_id, epoch, samples=samples)], epoch=epoch, solo=True))
        assert response.status == 201, await response.text()
        assert (await response.json())["claims"][0]["status"] == "credited"

    response = await client.get(f"/v1/jobs/{job_id}/contributions")
    assert response.status == 200
    body = await response.json()
    assert body["job_id"] == job_id
    [row] = body["contributions"]
    assert (row["node_id"], row["claims"], row["claimed_samples"], row["samples"], row["pending"]) == \
        (node.node_id, 2, 350, 350, 0)
    detail = await (await client.get(f"/v1/jobs/{job_id}")).json()
    assert detail["contributions"] == body["contributions"]


# ---------------------------------------------------------------------------------------------------- malformed input


@pytest.mark.parametrize("path", ["/v1/jobs", "/v1/nodes/register", "/v1/nodes/heartbeat",
                                  "/v1/nodes/assignments", "/v1/rounds"])
@pytest.mark.parametrize("body", [b'{"workload": "digits-mlp",', b"", b"not json", b"\xff\xfe\x00{}",
                                  b'{"workload": "digits-mlp"} trailing'])
async def test_malformed_json_is_400(client: TestClient, path: str, body: bytes):
    await rejected(client, "POST", path, 400, "malformed_json", data=body,
                   headers={"Content-Type": "application/json"})


LONG_INT = b"7" * 5000  # past Python's 4,300-digit limit for int(str)


@pytest.mark.parametrize("path", ["/v1/jobs", "/v1/owners", "/v1/nodes/register", "/v1/nodes/heartbeat"])
@pytest.mark.parametrize("body", [b'{"workload": ' + LONG_INT + b"}", b'{"payload": {"a": ' + LONG_INT + b"}}",
                                  b"[" * 30_000 + b"]" * 30_000])
async def test_integers_longer_than_python_converts_and_deep_nesting_are_400(client: TestClient, path, body):
    headers = {"Content-Type": "application/json"}
    if path == "/v1/owners":
        headers["Authorization"] = f"Bearer {client.app[ADMIN_TOKEN]}"
    await rejected(client, "POST", path, 400, "malformed_json", data=body, headers=headers)


@pytest.mark.parametrize("header", ['{"kind": ' + LONG_INT.decode() + "}", "[" * 3000 + "]" * 3000, "{", "\u00e9"])
async def test_a_bad_signed_header_is_400_not_500(client: TestClient, header: str):
    await rejected(client, "PUT", "/v1/jobs/j-000000000000/artifacts/model.pt", 400, "malformed_json", data=b"x",
                   headers={signing_header(): header})


@pytest.mark.parametrize("token", ["Bearer gso_\u00e9t\u00e9", "Bearer \u00ff\u00fe", "Bearer a\u2028b"])
@pytest.mark.parametrize(("method", "path"), [("GET", "/v1/owners/me"), ("POST", "/v1/nodes/x/revoke"),
                                              ("POST", "/v1/owners")])
async def test_a_non_ascii_token_is_401(client: TestClient, token: str, method: str, path: str):
    await rejected(client, method, path, 401, "bad_token", headers={"Authorization": token}, json={})


async def test_credits_stay_inside_the_supply_so_no_sum_overflows(client: TestClient):
    admin = {"Authorization": f"Bearer {client.app[ADMIN_TOKEN]}"}
    owner = await (await client.get("/v1/owners/me")).json()
    # 1,000 credits exist (the test owner's); the supply is 1e12: one more 1e12 grant would pass it.
    error = await rejected(client, "POST", f"/v1/owners/{owner['id']}/credits", 409, "supply_limit",
                           json={"amount": 1e12}, headers=admin)
    assert "circulation" in error["message"]
    await rejected(client, "POST", "/v1/owners", 409, "supply_limit", json={"name": "rich", "credits": 1e12},
                   headers=admin)
    response = await client.post(f"/v1/owners/{owner['id']}/credits", json={"amount": 1e12 - 1000}, headers=admin)
    assert response.status == 200, await response.text()
    assert (await response.json())["balance"] == 1e12


@pytest.mark.parametrize("method", ["TRACE", "PATCH", "DELETE"])
async def test_405_says_which_methods_are_allowed(client: TestClient, method: str):
    response = await client.request(method, "/v1/jobs")
    await error_of(response, 405, "method_not_allowed")
    assert set(response.headers["Allow"].split(",")) == {"GET", "HEAD", "POST"}


def signing_header() -> str:
    from gpuswarm.proto.models import ENVELOPE_HEADER

    return ENVELOPE_HEADER


@pytest.mark.parametrize("spec", [
    pytest.param({}, id="missing-workload"),
    pytest.param([], id="array-body"),
    pytest.param("digits-mlp", id="string-body"),
    pytest.param(None, id="null-body"),
    pytest.param({"workload": 123}, id="workload-int"),
    pytest.param({"workload": "digits-mlp", "min_nodes": "two"}, id="min_nodes-str"),
    pytest.param({"workload": "digits-mlp", "min_nodes": 0}, id="min_nodes-zero"),
    pytest.param({"workload": "digits-mlp", "max_nodes": 5000}, id="max_nodes-too-big"),
    pytest.param({"workload": "digits-mlp", "hyperparameters": []}, id="hyperparameters-list"),
    pytest.param({"workload": "digits-mlp", "hyperparameters": {"hidden": "big"}}, id="hidden-str"),
    pytest.param({"workload": "digits-mlp", "hyperparameters": {"hidden": 2}}, id="hidden-too-small"),
    pytest.param({"workload": "digits-mlp", "stop": {"max_epochs": None}}, id="no-stop-rule"),
    pytest.param({"workload": "digits-mlp", "stop": {"target_accuracy": 1.5}}, id="accuracy-over-1"),
    pytest.param({"workload": "digits-mlp", "requirements": "gpu"}, id="requirements-str"),
    pytest.param({"workload": "digits-mlp", "max_price_per_gpu_hour": -1}, id="negative-price"),
    pytest.param({"workload": "digits-mlp", "name": "x" * 129}, id="name-too-long"),
    pytest.param({"workload": ""}, id="workload-empty"),
    pytest.param({"workload": "digits-mlp", "training": {"mode": "async"}}, id="training-mode-unknown"),
    pytest.param({"workload": "digits-mlp", "training": {"inner_steps": 0}}, id="inner-steps-zero"),
    pytest.param({"workload": "digits-mlp", "training": {"outer_momentum": 1.5}}, id="outer-momentum-above-1"),
    pytest.param({"workload": "digits-mlp", "training": {"compression": "zip"}}, id="compression-unknown"),
])
async def test_job_spec_with_wrong_types_or_missing_fields_is_422(client: TestClient, spec: Any):
    # Sent as raw text: aiohttp's json=None would mean "no body" rather than the JSON literal null.
    error = await rejected(client, "POST", "/v1/jobs", 422, "invalid", data=json.dumps(spec),
                           headers={"Content-Type": "application/json"})
    assert error["message"].startswith("invalid job spec")


async def test_unknown_workload_is_422_naming_it(client: TestClient):
    error = await rejected(client, "POST", "/v1/jobs", 422, "invalid", json=job_spec(workload="resnet-9000"))
    assert "resnet-9000" in error["message"]
    assert any(d["field"] == "workload" for d in error["details"])


async def test_unknown_hyperparameter_is_422(client: TestClient):
    error = await rejected(client, "POST", "/v1/jobs", 422, "invalid",
                           json=job_spec(hyperparameters={"hidden": 32, "hiden_layers": 3}))
    assert "hiden_layers" in error["message"] or any("hiden_layers" in d["field"] for d in error["details"])


async def test_min_nodes_above_max_nodes_is_422(client: TestClient):
    error = await rejected(client, "POST", "/v1/jobs", 422, "invalid", json=job_spec(min_nodes=3, max_nodes=2))
    assert "min_nodes" in error["message"]


@pytest.mark.parametrize("raw", [
    '{"workload": "digits-mlp", "min_nodes": NaN}',
    '{"workload": "digits-mlp", "max_price_per_gpu_hour": NaN}',
    '{"workload": "digits-mlp", "max_price_per_gpu_hour": Infinity}',
    '{"workload": "digits-mlp", "hyperparameters": {"learning_rate": NaN}}',
    '{"workload": "digits-mlp", "stop": {"target_accuracy": NaN}}',
    '{"workload": "digits-mlp", "requirements": {"min_gpu_memory_gb": -Infinity}}',
])
async def test_nan_in_a_numeric_field_is_refused(client: TestClient, raw: str):
    await rejected(client, "POST", "/v1/jobs", 422, None, data=raw, headers={"Content-Type": "application/json"})


async def test_nan_inside_a_signed_payload_is_refused(client: TestClient):
    node = await register(client)
    envelope = signed(node, "heartbeat", {"node_id": node.node_id, "state": "idle"})
    raw = json.dumps(envelope | {"payload": {"node_id": node.node_id, "state": "idle", "x": float("nan")}})
    assert "NaN" in raw
    await rejected(client, "POST", "/v1/nodes/heartbeat", 401, "bad_signature", data=raw,
                   headers={"Content-Type": "application/json"})


async def test_nan_timestamp_in_an_envelope_is_refused(client: TestClient):
    node = new_identity()
    envelope = signed(node, "register", registration(node))
    raw = json.dumps(envelope | {"timestamp": float("nan")})
    await rejected(client, "POST", "/v1/nodes/register", 422, "invalid", data=raw,
                   headers={"Content-Type": "application/json"})


@pytest.mark.parametrize("path", ["/v1/jobs", "/v1/nodes/register", "/v1/nodes/heartbeat", "/v1/rounds"])
async def test_oversized_json_body_is_413(client: TestClient, path: str):
    limit = client.app[CONFIG].max_json_bytes
    body = json.dumps(job_spec(name="", padding="x" * limit)).encode()
    assert len(body) > limit
    await rejected(client, "POST", path, 413, "payload_too_large", data=body,
                   headers={"Content-Type": "application/json"})


async def test_body_exactly_at_the_json_limit_is_read(client: TestClient):
    limit = client.app[CONFIG].max_json_bytes
    compact = json.dumps(job_spec(min_nodes=2, max_nodes=2)).encode()
    body = compact + b" " * (limit - len(compact))  # padded with JSON whitespace: an unknown key would be refused
    assert len(body) == limit
    response = await client.post("/v1/jobs", data=body, headers={"Content-Type": "application/json"})
    assert response.status == 201, await response.text()


@pytest.mark.parametrize("path", ["/v1/jobs", "/v1/nodes/register"])
async def test_oversized_chunked_json_body_is_413(client: TestClient, path: str):
    """Without a Content-Length the cap must still hold while reading."""
    limit = client.app[CONFIG].max_json_bytes
    body = json.dumps(job_spec(padding="x" * (2 * limit))).encode()

    async def chunks():
        for i in range(0, len(body), 8192):
            yield body[i:i + 8192]

    await rejected(client, "POST", path, 413, "payload_too_large", data=chunks(),
                   headers={"Content-Type": "application/json"})


async def test_oversized_chunked_json_body_arriving_slowly_is_413(client: TestClient):
    """Regression (same as below): when the first piece of an oversized chunked body arrives alone, read_json parses
    just that piece and answers 400 malformed_json instead of 413; the cap is never applied to the whole body."""
    limit = client.app[CONFIG].max_json_bytes
    body = json.dumps(job_spec(padding="x" * (2 * limit))).encode()

    async def chunks():
        yield body[:100]
        await asyncio.sleep(0.2)
        yield body[100:]

    await rejected(client, "POST", "/v1/jobs", 413, "payload_too_large", data=chunks(),
                   headers={"Content-Type": "application/json"})


async def test_valid_json_body_arriving_in_several_chunks_is_accepted(client: TestClient):
    """Regression: `request.content.read(limit + 1)` returns as soon as *some* data is buffered, so a valid JSON body
    that arrives in more than one piece (chunked encoding, or a large body split across TCP segments) is cut and
    refused as malformed_json."""
    body = json.dumps(job_spec(min_nodes=2, max_nodes=2)).encode()

    async def chunks():
        yield body[:20]
        await asyncio.sleep(0.2)
        yield body[20:]

    response = await client.post("/v1/jobs", data=chunks(), headers={"Content-Type": "application/json"})
    assert response.status == 201, await response.text()


async def test_deeply_nested_json_is_a_4xx(client: TestClient):
    """Regression: json.loads raises RecursionError (not JSONDecodeError) for deep nesting, which the middleware turns
    into 500 internal, although the body is well under the size cap."""
    body = b"[" * 30_000 + b"]" * 30_000
    assert len(body) <= client.app[CONFIG].max_json_bytes
    await rejected(client, "POST", "/v1/jobs", 400, "malformed_json", data=body,
                   headers={"Content-Type": "application/json"})


# ---------------------------------------------------------------------------------------------------- signatures


@BOTH_CHECKERS
@pytest.mark.parametrize("field, value", [
    ("software_version", "evil-1.0"),
    ("price_per_gpu_hour", 99.0),
    ("resources", {"gpus": [], "cpu_cores": 512, "ram_gb": 8.0}),
])
async def test_register_with_payload_tampered_after_signing_is_401(client: TestClient, field: str, value: Any):
    node = new_identity()
    envelope = signed(node, "register", registration(node))
    envelope["payload"][field] = value
    await rejected(client, "POST", "/v1/nodes/register", 401, "bad_signature", json=envelope)


@BOTH_CHECKERS
@pytest.mark.parametrize("field", ["timestamp", "nonce", "kind", "signature"])
async def test_heartbeat_with_envelope_tampered_after_signing_is_401(client: TestClient, field: str):
    node = await register(client)
    envelope = signed(node, "heartbeat", {"node_id": node.node_id, "state": "idle"})
    tampered = {"timestamp": envelope["timestamp"] + 1, "nonce": "0" * 32, "kind": "poll",
                "signature": signed(node, "heartbeat", {"node_id": node.node_id, "state": "training"})["signature"]}
    envelope[field] = tampered[field]
    await rejected(client, "POST", "/v1/nodes/heartbeat", 401, "bad_signature", json=envelope)


@BOTH_CHECKERS
async def test_heartbeat_payload_tampered_after_signing_is_401(client: TestClient):
    node = await register(client)
    envelope = signed(node, "heartbeat", {"node_id": node.node_id, "state": "idle"})
    envelope["payload"]["state"] = "offline"
    await rejected(client, "POST", "/v1/nodes/heartbeat", 401, "bad_signature", json=envelope)


async def test_register_with_node_id_not_derived_from_the_key_is_401(client: TestClient):
    node, other = new_identity(), new_identity()
    envelope = signed(node, "register", registration(node, node_id=other.node_id))
    await rejected(client, "POST", "/v1/nodes/register", 401, "bad_signature", json=envelope)


@BOTH_CHECKERS
async def test_register_with_another_nodes_public_key_is_401(client: TestClient):
    """The envelope names the victim's public key but is signed with the attacker's private key."""
    victim, attacker = new_identity(), new_identity()
    envelope = signed(attacker, "register", registration(victim))
    envelope["public_key"] = victim.public_key
    await rejected(client, "POST", "/v1/nodes/register", 401, "bad_signature", json=envelope)


@BOTH_CHECKERS
async def test_heartbeat_signed_by_another_registered_node_is_401(client: TestClient):
    a, b = await register(client), await register(client)
    envelope = signed(a, "heartbeat", {"node_id": b.node_id, "state": "offline"})
    await rejected(client, "POST", "/v1/nodes/heartbeat", 401, "bad_signature", json=envelope)


async def test_poll_signed_by_another_registered_node_is_401(client: TestClient, assigned):
    victim, _ = assigned
    thief = await register(client)
    envelope = signed(thief, "poll", {"node_id": victim.node_id})
    await rejected(client, "POST", "/v1/nodes/assignments", 401, "bad_signature", json=envelope)


@BOTH_CHECKERS
@pytest.mark.parametrize("kind, path", [("poll", "/v1/nodes/heartbeat"), ("heartbeat", "/v1/nodes/assignments"),
                                        ("heartbeat", "/v1/nodes/register")])
async def test_message_of_another_kind_is_401(client: TestClient, kind: str, path: str):
    node = await register(client)
    payload = registration(node) | {"state": "idle"}
    await rejected(client, "POST", path, 401, "bad_signature", json=signed(node, kind, payload))


@pytest.mark.parametrize("envelope_patch", [
    pytest.param({"signature": None}, id="missing-signature"),
    pytest.param({"public_key": "short"}, id="short-public-key"),
    pytest.param({"nonce": "not-hex"}, id="bad-nonce"),
    pytest.param({"payload": ["not", "a", "dict"]}, id="payload-list"),
])
async def test_structurally_invalid_envelope_is_422(client: TestClient, envelope_patch: dict):
    node = await register(client)
    envelope = signed(node, "heartbeat", {"node_id": node.node_id, "state": "idle"})
    for key, value in envelope_patch.items():
        if value is None:
            del envelope[key]
        else:
            envelope[key] = value
    await rejected(client, "POST", "/v1/nodes/heartbeat", 422, "invalid", json=envelope)


async def test_signed_heartbeat_with_invalid_payload_is_422(client: TestClient):
    node = await register(client)
    envelope = signed(node, "heartbeat", {"node_id": node.node_id, "state": "dancing"})
    await rejected(client, "POST", "/v1/nodes/heartbeat", 422, "invalid", json=envelope)


# ---------------------------------------------------------------------------------------------------- replay, staleness


async def test_replayed_heartbeat_is_409_and_the_first_was_accepted(client: TestClient):
    node = await register(client)
    envelope = signed(node, "heartbeat", {"node_id": node.node_id, "state": "training"})
    first = await client.post("/v1/nodes/heartbeat", json=envelope)
    assert first.status == 200, await first.text()
    nodes = (await (await client.get("/v1/nodes")).json())["nodes"]
    assert nodes[0]["state"] == "training"
    await rejected(client, "POST", "/v1/nodes/heartbeat", 409, "replay", json=envelope)


async def test_replayed_registration_is_409(client: TestClient):
    node = new_identity()
    envelope = signed(node, "register", registration(node))
    first = await client.post("/v1/nodes/register", json=envelope)
    assert first.status == 200, await first.text()
    await rejected(client, "POST", "/v1/nodes/register", 409, "replay", json=envelope)


async def test_replayed_round_report_is_409(client: TestClient, assigned):
    node, job_id = assigned
    envelope = round_report(node, job_id, [claim(node, job_id)], solo=True)
    first = await client.post("/v1/rounds", json=envelope)
    assert first.status == 201, await first.text()
    await rejected(client, "POST", "/v1/rounds", 409, "replay", json=envelope)


async def test_replayed_artifact_upload_is_409(client: TestClient, assigned):
    node, job_id = assigned
    request = artifact_request(node, job_id, b"checkpoint bytes", name="ckpt.pt")
    first = await client.put(f"/v1/jobs/{job_id}/artifacts/ckpt.pt", **request)
    assert first.status == 201, await first.text()
    await rejected(client, "PUT", f"/v1/jobs/{job_id}/artifacts/ckpt.pt", 409, "replay", **request)


@pytest.mark.parametrize("offset", [-3600, +3600], ids=["past", "future"])
async def test_stale_registration_is_401(client: TestClient, offset: float):
    node = new_identity()
    envelope = signing.sign(node.private_key, "register", registration(node), now=time.time() + offset)
    await rejected(client, "POST", "/v1/nodes/register", 401, "bad_signature", json=envelope.model_dump(mode="json"))


@pytest.mark.parametrize("offset", [-3600, +3600], ids=["past", "future"])
async def test_stale_heartbeat_is_401(client: TestClient, offset: float):
    node = await register(client)
    envelope = signing.sign(node.private_key, "heartbeat", {"node_id": node.node_id, "state": "idle"},
                            now=time.time() + offset)
    error = await rejected(client, "POST", "/v1/nodes/heartbeat", 401, "bad_signature",
                           json=envelope.model_dump(mode="json"))
    assert "stale" in error["message"]


# ---------------------------------------------------------------------------------------------------- unknown nodes


@pytest.mark.parametrize("kind, path, payload", [
    ("heartbeat", "/v1/nodes/heartbeat", {"state": "idle"}),
    ("poll", "/v1/nodes/assignments", {}),
])
async def test_unregistered_node_is_404(client: TestClient, kind: str, path: str, payload: dict):
    await register(client)  # some other node exists
    stranger = new_identity()
    envelope = signed(stranger, kind, {"node_id": stranger.node_id} | payload)
    await rejected(client, "POST", path, 404, "unknown_node", json=envelope)


async def test_round_report_from_an_unregistered_node_is_404(client: TestClient, assigned):
    _, job_id = assigned
    stranger = new_identity()
    await rejected(client, "POST", "/v1/rounds", 404, "unknown_node",
                   json=round_report(stranger, job_id, [claim(stranger, job_id)], solo=True))


# ---------------------------------------------------------------------------------------------------- round reports


async def test_round_report_from_a_node_never_assigned_is_403(client: TestClient, assigned):
    _, job_id = assigned
    outsider = await register(client)
    await rejected(client, "POST", "/v1/rounds", 403, "not_a_member",
                   json=round_report(outsider, job_id, [claim(outsider, job_id)], solo=True))


async def test_round_report_for_an_unknown_job_is_404(client: TestClient, assigned):
    node, _ = assigned
    await rejected(client, "POST", "/v1/rounds", 404, "unknown_job",
                   json=round_report(node, UNKNOWN_JOB, [claim(node, UNKNOWN_JOB)], solo=True))


async def test_claim_window_in_the_future_is_422(client: TestClient, assigned):
    node, job_id = assigned
    now = time.time()
    await rejected(client, "POST", "/v1/rounds", 422, "bad_claim", json=round_report(
        node, job_id, [claim(node, job_id, window_start=now, window_end=now + 3600)], solo=True))


async def test_claim_window_backwards_is_422(client: TestClient, assigned):
    node, job_id = assigned
    now = time.time()
    await rejected(client, "POST", "/v1/rounds", 422, "invalid", json=round_report(
        node, job_id, [claim(node, job_id, window_start=now - 1, window_end=now - 10)], solo=True))


async def test_forged_claim_in_a_report_is_422(client: TestClient, assigned):
    node, job_id = assigned
    forged = claim(node, job_id)
    forged["payload"]["samples"] = 10**9  # changed after signing
    await rejected(client, "POST", "/v1/rounds", 422, "bad_claim", json=round_report(node, job_id, [forged]))


async def test_claim_signed_by_someone_else_is_422(client: TestClient, assigned):
    node, job_id = assigned
    impostor = new_identity()
    stolen = signed(impostor, CLAIM_KIND, claim(node, job_id)["payload"])  # names `node`, signed by another key
    await rejected(client, "POST", "/v1/rounds", 422, "bad_claim",
                   json=round_report(node, job_id, [claim(node, job_id), stolen]))


async def test_report_without_the_reporters_own_claim_is_422(client: TestClient, assigned):
    node, job_id = assigned
    other = await register(client)
    await rejected(client, "POST", "/v1/rounds", 422, "bad_claim",
                   json=round_report(node, job_id, [claim(other, job_id)]))


async def test_solo_report_with_several_claims_is_422(client: TestClient, assigned):
    node, job_id = assigned
    other = await register(client)
    await rejected(client, "POST", "/v1/rounds", 422, "bad_claim",
                   json=round_report(node, job_id, [claim(node, job_id), claim(other, job_id)], solo=True))


@pytest.mark.parametrize("bad", [{"not": "an envelope"}, {"kind": "claim"}, {}])
async def test_malformed_claim_envelope_is_422(client: TestClient, assigned, bad: dict):
    node, job_id = assigned
    await rejected(client, "POST", "/v1/rounds", 422, "invalid",
                   json=round_report(node, job_id, [claim(node, job_id), bad]))


async def test_claim_of_another_kind_is_422(client: TestClient, assigned):
    node, job_id = assigned
    wrong_kind = signed(node, "heartbeat", claim(node, job_id)["payload"])
    await rejected(client, "POST", "/v1/rounds", 422, "bad_claim", json=round_report(node, job_id, [wrong_kind]))


# ---------------------------------------------------------------------------------------------------- artifacts


def _files_under(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file()) if directory.exists() else []


async def test_artifact_with_body_not_matching_the_signed_digest_is_400(client, assigned, data_dir):
    node, job_id = assigned
    data = b"the real model weights"
    request = artifact_request(node, job_id, data, final=True, accuracy=0.9)
    request["data"] = b"X" * len(data)  # same size, different bytes
    await rejected(client, "PUT", f"/v1/jobs/{job_id}/artifacts/model.pt", 400, "digest_mismatch", **request)
    assert _files_under(data_dir / "blobs") == []
    job = await (await client.get(f"/v1/jobs/{job_id}")).json()
    assert job["state"] == "running" and job["final_accuracy"] is None and job["artifacts"] == []


async def test_artifact_body_of_another_size_than_signed_is_400(client, assigned, data_dir):
    node, job_id = assigned
    request = artifact_request(node, job_id, b"0123456789")
    request["data"] = b"0123456789-and-more"
    await rejected(client, "PUT", f"/v1/jobs/{job_id}/artifacts/model.pt", 400, "bad_request", **request)
    assert _files_under(data_dir / "blobs") == []


async def test_chunked_artifact_body_not_matching_the_digest_is_400(client, assigned, data_dir):
    """Without Content-Length the size check cannot run first; the digest check must catch it while streaming."""
    node, job_id = assigned
    data = b"a" * 100_000
    request = artifact_request(node, job_id, data)

    async def body():
        yield b"b" * 50_000
        yield b"a" * 50_000

    request["data"] = body()
    await rejected(client, "PUT", f"/v1/jobs/{job_id}/artifacts/model.pt", 400, "digest_mismatch", **request)
    assert _files_under(data_dir / "blobs") == []


async def test_artifact_upload_without_the_envelope_header_is_401(client, assigned, data_dir):
    _, job_id = assigned
    await rejected(client, "PUT", f"/v1/jobs/{job_id}/artifacts/model.pt", 401, "bad_signature", data=b"weights")
    assert _files_under(data_dir / "blobs") == []


async def test_artifact_upload_with_malformed_envelope_header_is_400(client, assigned):
    _, job_id = assigned
    await rejected(client, "PUT", f"/v1/jobs/{job_id}/artifacts/model.pt", 400, "malformed_json",
                   data=b"weights", headers={ENVELOPE_HEADER: "{not json"})


async def test_artifact_upload_with_tampered_meta_is_401(client, assigned, data_dir):
    node, job_id = assigned
    request = artifact_request(node, job_id, b"weights", final=False)
    envelope = json.loads(request["headers"][ENVELOPE_HEADER])
    envelope["payload"]["final"] = True
    request["headers"][ENVELOPE_HEADER] = json.dumps(envelope)
    await rejected(client, "PUT", f"/v1/jobs/{job_id}/artifacts/model.pt", 401, "bad_signature", **request)
    assert _files_under(data_dir / "blobs") == []


async def test_artifact_signed_for_another_name_is_400(client, assigned, data_dir):
    node, job_id = assigned
    request = artifact_request(node, job_id, b"weights", name="model.pt")
    await rejected(client, "PUT", f"/v1/jobs/{job_id}/artifacts/other.pt", 400, "bad_request", **request)
    assert _files_under(data_dir / "blobs") == []


async def test_artifact_from_a_node_never_assigned_is_403(client, assigned, data_dir):
    _, job_id = assigned
    outsider = await register(client)
    await rejected(client, "PUT", f"/v1/jobs/{job_id}/artifacts/model.pt", 403, "not_a_member",
                   **artifact_request(outsider, job_id, b"weights", final=True, accuracy=1.0))
    assert _files_under(data_dir / "blobs") == []


async def test_artifact_from_an_unregistered_node_is_404(client, assigned):
    """Like every node route (auth.authenticate_node); before, the upload answered 401 bad_signature."""
    _, job_id = assigned
    stranger = new_identity()
    await rejected(client, "PUT", f"/v1/jobs/{job_id}/artifacts/model.pt", 404, "unknown_node",
                   **artifact_request(stranger, job_id, b"weights"))


async def test_artifact_for_an_unknown_job_is_404(client, assigned):
    node, _ = assigned
    await rejected(client, "PUT", f"/v1/jobs/{UNKNOWN_JOB}/artifacts/model.pt", 404, "unknown_job",
                   **artifact_request(node, UNKNOWN_JOB, b"weights"))


async def test_download_of_a_missing_artifact_is_404(client, assigned):
    _, job_id = assigned
    await rejected(client, "GET", f"/v1/jobs/{job_id}/artifacts/model.pt", 404, "unknown_artifact")


# ---------------------------------------------------------------------------------------------------- jobs


@pytest.mark.parametrize("method, suffix", [("GET", ""), ("GET", "/contributions"), ("POST", "/cancel"),
                                            ("GET", "/artifacts/model.pt")])
@pytest.mark.parametrize("job_id", [UNKNOWN_JOB, "nope", "j-XYZ"])
async def test_unknown_job_id_is_404(client: TestClient, method: str, suffix: str, job_id: str):
    await submit(client, min_nodes=2, max_nodes=2)  # some other job exists
    await rejected(client, method, f"/v1/jobs/{job_id}{suffix}", 404, "unknown_job")


async def test_cancel_twice_is_409(client: TestClient):
    job_id = await submit(client, min_nodes=2, max_nodes=2)
    first = await client.post(f"/v1/jobs/{job_id}/cancel")
    assert first.status == 200, await first.text()
    error = await rejected(client, "POST", f"/v1/jobs/{job_id}/cancel", 409, "job_final")
    assert "cancelled" in error["message"]


async def test_cancel_of_a_running_job_closes_its_assignments(client: TestClient, assigned):
    node, job_id = assigned
    response = await client.post(f"/v1/jobs/{job_id}/cancel")
    assert response.status == 200
    assert await poll(client, node) == []
    job = await (await client.get(f"/v1/jobs/{job_id}")).json()
    assert job["state"] == "cancelled" and [a["state"] for a in job["assignments"]] == ["cancelled"]


async def test_list_jobs_with_unknown_state_is_400(client: TestClient):
    await submit(client, min_nodes=2, max_nodes=2)
    await rejected(client, "GET", "/v1/jobs?state=exploded", 400, "bad_request")


async def test_unknown_route_and_method_use_the_error_shape(client: TestClient):
    await rejected(client, "GET", "/v1/nope", 404, "not_found")
    await rejected(client, "DELETE", "/v1/jobs", 405, "method_not_allowed")


# ------------------------------------------------------------------------------------------------- heartbeat failures


async def test_one_heartbeat_cannot_count_the_same_failure_several_times(client: TestClient, assigned):
    """Regression: `active` is computed once per heartbeat, so a heartbeat listing the same job's failure three times
    increments job.failures three times and, with max_job_failures=3, fails the whole job from one crash of one
    node."""
    node, job_id = assigned
    failures = [{"job_id": job_id, "reason": "CUDA out of memory"}] * 3
    response = await client.post("/v1/nodes/heartbeat", json=signed(
        node, "heartbeat", {"node_id": node.node_id, "state": "idle", "failures": failures}))
    assert response.status == 200, await response.text()
    job = await (await client.get(f"/v1/jobs/{job_id}")).json()
    assert job["state"] != "failed", job["events"]


@pytest.mark.parametrize("name", [".", ".."])
async def test_artifact_named_dot_or_dot_dot_is_a_4xx(client: TestClient, assigned, data_dir, name: str):
    """Regression: the name pattern ^[A-Za-z0-9_.-]{1,64}$ admits "." and "..", so the coordinator tries to
    os.replace() the upload onto artifacts/{job} or artifacts/ themselves and answers 500 internal. (No file
    escapes the directory, since replacing a directory with a file fails; the request should be a 4xx.)"""
    node, job_id = assigned
    request = artifact_request(node, job_id, b"weights", name=name)
    # The dots are percent-encoded so that no client-side path normalisation removes them.
    url = client.make_url("/").with_path(f"/v1/jobs/{job_id}/artifacts/{name.replace('.', '%2E')}", encoded=True)
    before = await snapshot(client.app)
    response = await client.session.put(url, **request)
    await error_of(response, 422, "invalid")
    assert await snapshot(client.app) == before
    assert _files_under(data_dir / "blobs") == []


async def test_concurrent_heartbeats_share_a_batch_but_each_gets_its_own_answer(client: TestClient):
    """Heartbeats that arrive together are written in one transaction; a replay or an unknown node in the batch
    is refused alone, and the others still land."""
    nodes = [await register(client) for _ in range(5)]
    stranger = new_identity()
    replayed = signed(nodes[0], "heartbeat", {"node_id": nodes[0].node_id, "state": "training"})
    bodies = [replayed, replayed, signed(stranger, "heartbeat", {"node_id": stranger.node_id, "state": "idle"})]
    bodies += [signed(n, "heartbeat", {"node_id": n.node_id, "state": "training"}) for n in nodes[1:] * 4]
    responses = await asyncio.gather(*(client.post("/v1/nodes/heartbeat", json=b) for b in bodies))
    statuses = [r.status for r in responses]
    assert sorted(statuses[:2]) == [200, 409] and statuses[2] == 404 and set(statuses[3:]) == {200}, statuses
    assert {(await r.json())["error"]["code"] for r in responses if r.status >= 400} == {"replay", "unknown_node"}
    listed = {n["id"]: n for n in (await (await client.get("/v1/nodes")).json())["nodes"]}
    assert {listed[n.node_id]["state"] for n in nodes} == {"training"}
