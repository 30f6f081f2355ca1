"""Every JSON answer of the /v1 API matches the response schema its OpenAPI document names, field for field.

The real coordinator app over real HTTP, real signatures, a real GPU challenge solved on this CPU. Each route that
documents a success schema is called, and its real body is checked against that schema: every field the server
sends must be in the schema (objects are closed, whatever the model lets a newer server add), with its type, and
every required field must be there. The body is then parsed by the pydantic model the document names, as the
client parses it. Finally, no documented route went uncalled.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import time
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp.test_utils import TestServer
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from gpuswarm.client.api import ENVELOPE_HEADER
from gpuswarm.coordinator.app import create_app
from gpuswarm.coordinator.config import ADMIN_TOKEN, SESSIONS, CoordinatorConfig
from gpuswarm.coordinator.db import Audit, Contribution
from gpuswarm.mesh.keys import KeyPair
from gpuswarm.node.challenge import answer, solve
from gpuswarm.node.identity import Identity
from gpuswarm.proto import api, audits, challenge, models, sweeps
from gpuswarm.proto.challenge import ChallengeIssue, ChallengeReveal
from sqlalchemy import select

# Routes whose success answer is not a JSON document of ours: the document itself, and artifact bytes.
NOT_JSON = {("/v1/openapi.json", "get"), ("/v1/jobs/{job_id}/artifacts/{name}", "get"),
            ("/v1/blobs/{sha256}", "get"), ("/v1/jobs/{job_id}/blobs/{sha256}", "get"),
            ("/v1/audits/{audit_id}/evidence", "get")}
MODEL_MODULES = (api, models, challenge, sweeps, audits)
JSON_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


# ---------------------------------------------------------------------------------------------------- schema walk


def check(value: Any, schema: dict, defs: dict, where: str = "body") -> None:
    """Assert that `value` fits `schema` (the JSON Schema subset pydantic writes), with closed objects."""
    if "$ref" in schema:
        return check(value, defs[schema["$ref"].rsplit("/", 1)[1]], defs, where)
    if "anyOf" in schema:
        problems = []
        for option in schema["anyOf"]:
            try:
                return check(value, option, defs, where)
            except AssertionError as e:
                problems.append(str(e))
        raise AssertionError(f"{where}: {value!r} fits none of {problems}")
    for part in schema.get("allOf", []):
        check(value, part, defs, where)
    if "enum" in schema:
        assert value in schema["enum"], f"{where}: {value!r} not one of {schema['enum']}"
    if "const" in schema:
        assert value == schema["const"], f"{where}: {value!r} != {schema['const']!r}"
    kind = schema.get("type")
    if kind in ("integer", "number"):
        assert isinstance(value, int if kind == "integer" else int | float) and not isinstance(value, bool), \
            f"{where}: {value!r} is not an {kind}"
        low, high = schema.get("minimum", value), schema.get("maximum", value)
        assert low <= value <= high, f"{where}: {value!r} outside [{low}, {high}]"
        assert value > schema.get("exclusiveMinimum", value - 1), f"{where}: {value!r} <= exclusiveMinimum"
        assert value < schema.get("exclusiveMaximum", value + 1), f"{where}: {value!r} >= exclusiveMaximum"
    elif kind is not None:
        assert isinstance(value, JSON_TYPES[kind]), f"{where}: {value!r} is not a JSON {kind}"
    if isinstance(value, str):
        assert len(value) <= schema.get("maxLength", len(value)) and len(value) >= schema.get("minLength", 0), where
        assert "pattern" not in schema or re.search(schema["pattern"], value), f"{where}: {value!r} !~ pattern"
    if isinstance(value, list):
        assert schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", len(value)), where
        for i, item in enumerate(value):
            check(item, schema.get("items", {}), defs, f"{where}[{i}]")
    if isinstance(value, dict) and kind == "object":
        missing = set(schema.get("required", [])) - set(value)
        assert not missing, f"{where}: required {sorted(missing)} missing from {sorted(value)}"
        properties = schema.get("properties")
        if properties is not None:  # a model: every field the server sends must be typed
            unknown = set(value) - set(properties)
            assert not unknown, f"{where}: fields {sorted(unknown)} are not in the schema"
            for key, item in value.items():
                check(item, properties[key], defs, f"{where}.{key}")
        elif isinstance(schema.get("additionalProperties"), dict):  # dict[str, X]
            for key, item in value.items():
                check(item, schema["additionalProperties"], defs, f"{where}.{key}")


def model_named(name: str):
    for module in MODEL_MODULES:
        if isinstance(getattr(module, name, None), type):
            return getattr(module, name)
    raise AssertionError(f"the document names {name}, which no proto module defines")


class Api:
    """Raw calls to the app, each checked against the OpenAPI document: (path template, method) -> schema."""

    def __init__(self, url: str, session: aiohttp.ClientSession, document: dict):
        self.url, self.session, self.document = url, session, document
        self.defs = document["components"]["schemas"]
        self.called: set[tuple[str, str]] = set()

    async def __call__(self, method: str, template: str, status: int, body: Any = None, token: str | None = None,
                       data: bytes | None = None, headers: dict | None = None, **params: str) -> Any:
        path = template.format(**params)
        headers = dict(headers or {}) | ({"Authorization": f"Bearer {token}"} if token else {})
        async with self.session.request(method, self.url + path, json=body, data=data, headers=headers) as response:
            assert response.status == status, (method, path, response.status, await response.text())
            answer_ = await response.json()
        operation = self.document["paths"][template][method.lower()]
        documented = operation["responses"].get(str(status), {}).get("content", {}).get("application/json")
        assert documented is not None, f"{method} {template} documents no JSON schema for {status}"
        schema = documented["schema"]
        check(answer_, schema, self.defs, f"{method} {template}")
        model_named(schema["$ref"].rsplit("/", 1)[1]).model_validate(answer_)
        self.called.add((template, method.lower()))
        return answer_


def signed(identity: Identity, kind: str, payload: dict) -> dict:
    return identity.sign(kind, payload).model_dump(mode="json")


def registration(identity: Identity, mesh: KeyPair | None = None) -> dict:
    payload = {"node_id": identity.node_id, "resources": {"gpus": [], "cpu_cores": 2, "ram_gb": 4.0},
               "software_version": "gpuswarm-test", "price_per_gpu_hour": 0.5, "endpoints": ["127.0.0.1"]}
    if mesh is not None:
        payload["mesh"] = {"public_key": mesh.public_key, "listen_port": 51820, "endpoints": ["192.0.2.9:51820"]}
    return payload


# ---------------------------------------------------------------------------------------------------- the test


async def test_every_json_answer_matches_its_documented_schema(tmp_path: Path):
    app = create_app(CoordinatorConfig(data_dir=tmp_path / "coordinator", start_dht=False, loop_interval=0.2,
                                       node_timeout=3600))
    async with TestServer(app) as server, aiohttp.ClientSession() as session:
        url = str(server.make_url("")).rstrip("/")
        async with session.get(url + "/v1/openapi.json") as response:
            document = await response.json()
        call = Api(url, session, document)
        admin_token = app[ADMIN_TOKEN]

        await call("GET", "/v1/health", 200)
        await call("GET", "/v1/dht", 200)
        owner = await call("POST", "/v1/owners", 201, {"name": "alice", "credits": 100.0}, token=admin_token)
        token = owner["token"]
        await call("GET", "/v1/owners/me", 200, token=token)
        await call("POST", "/v1/owners/{owner_id}/credits", 200, {"amount": 5.0, "memo": "test"}, token=admin_token,
                   owner_id=owner["id"])

        # Two nodes: `a` trains (no mesh), `b` joins the mesh and is revoked at the end.
        a, b = Identity(Ed25519PrivateKey.generate()), Identity(Ed25519PrivateKey.generate())
        await call("POST", "/v1/nodes/register", 200, signed(a, "register", registration(a)))
        await call("POST", "/v1/nodes/register", 200, signed(b, "register", registration(b, KeyPair.generate())))
        await call("POST", "/v1/mesh/peers", 200, signed(b, "mesh_poll", {"node_id": b.node_id, "since": -1}))
        beat = await call("POST", "/v1/nodes/heartbeat", 200, signed(a, "heartbeat", {"node_id": a.node_id,
                                                                                      "state": "idle"}))
        assert beat["challenge"] is True  # a registration makes the GPU challenge due

        # The GPU challenge, solved for real (a CPU node: n=1024).
        issue = await call("POST", "/v1/challenges", 201, signed(a, challenge.START_KIND, {"node_id": a.node_id}))
        solution = await asyncio.to_thread(solve, ChallengeIssue.model_validate(issue))
        committed = await call("POST", "/v1/challenges/{challenge_id}/commit", 200, signed(a, challenge.COMMIT_KIND, {
            "challenge_id": issue["challenge_id"], "node_id": a.node_id, "root": solution.root}),
            challenge_id=issue["challenge_id"])
        proof = await asyncio.to_thread(answer, solution, ChallengeReveal.model_validate(committed["reveal"]),
                                        a.node_id)
        result = await call("POST", "/v1/challenges/{challenge_id}/proof", 200,
                            signed(a, challenge.PROOF_KIND, proof.model_dump(mode="json")),
                            challenge_id=issue["challenge_id"])
        assert result["passed"], result
        await call("GET", "/v1/nodes/{node_id}/challenges", 200, node_id=a.node_id)

        # A job, trained by one node: progress, a round report, an artifact.
        spec = {"name": "schema", "workload": "digits-mlp", "hyperparameters": {"hidden": 32}, "budget": 10.0,
                "stop": {"max_epochs": 2}, "min_nodes": 1, "max_nodes": 1, "requirements": {"verified_only": True}}
        job = await call("POST", "/v1/jobs", 201, spec, token=token)
        deadline = time.monotonic() + 15
        while not (await call("POST", "/v1/nodes/assignments", 200,
                              signed(a, "poll", {"node_id": a.node_id})))["assignments"]:
            assert time.monotonic() < deadline, "the verified node was not assigned the job"
            await asyncio.sleep(0.2)
        progress = {"job_id": job["id"], "epoch": 0.5, "global_step": 3, "samples": 96, "loss": 1.2,
                    "accuracy": 0.5, "samples_per_second": 100.0, "peers": 1, "metrics": {"val_loss": 1.3}}
        await call("POST", "/v1/nodes/heartbeat", 200, signed(a, "heartbeat", {
            "node_id": a.node_id, "state": "training", "progress": [progress], "peer_rtt_ms": {b.node_id: 1.5}}))
        now = time.time()
        claim = signed(a, models.CLAIM_KIND, {"job_id": job["id"], "node_id": a.node_id, "epoch": 0, "samples": 96,
                                              "steps": 3, "compute_seconds": 2.0, "window_start": now - 5,
                                              "window_end": now - 1})
        outsider = signed(b, models.CLAIM_KIND, claim["payload"] | {"node_id": b.node_id})  # b is no member
        rounds = await call("POST", "/v1/rounds", 201, signed(a, "round_report", {
            "job_id": job["id"], "node_id": a.node_id, "epoch": 0, "claims": [claim, outsider]}))
        assert rounds["claims"] and rounds["ignored"]
        data = b"checkpoint bytes"
        meta = {"job_id": job["id"], "node_id": a.node_id, "name": "checkpoint.pt", "size": len(data),
                "sha256": hashlib.sha256(data).hexdigest(), "final": False, "epoch": 0.5, "checkpoint_step": 3}
        await call("PUT", "/v1/jobs/{job_id}/artifacts/{name}", 201, data=data, job_id=job["id"], name="checkpoint.pt",
                   headers={ENVELOPE_HEADER: json.dumps(signed(a, "artifact", meta)),
                            "Content-Type": "application/octet-stream"})
        polled = await call("POST", "/v1/nodes/assignments", 200, signed(a, "poll", {"node_id": a.node_id}))
        assert polled["assignments"][0]["checkpoint"]["step"] == 3
        listing = await call("GET", "/v1/jobs/{job_id}/artifacts", 200, token=token, job_id=job["id"])
        assert listing["artifacts"][0]["checkpoint_step"] == 3

        # The blob store: what the owner lacks, then an upload.
        blob = b"owner code"
        digest = hashlib.sha256(blob).hexdigest()
        assert (await call("POST", "/v1/blobs/missing", 200, {"sha256": [digest]}, token=token))["missing"]
        await call("PUT", "/v1/blobs/{sha256}", 201, data=blob, token=token, sha256=digest,
                   headers={"Content-Type": "application/octet-stream"})

        await call("GET", "/v1/jobs", 200, token=token)
        detail = await call("GET", "/v1/jobs/{job_id}", 200, token=token, job_id=job["id"])
        assert detail["assignments"] and detail["artifacts"] and detail["events"]
        await call("GET", "/v1/jobs/{job_id}/contributions", 200, token=token, job_id=job["id"])
        curve = await call("GET", "/v1/jobs/{job_id}/progress", 200, token=token, job_id=job["id"])
        assert curve["points"]
        await call("GET", "/v1/jobs/{job_id}/statement", 200, token=token, job_id=job["id"])
        nodes = await call("GET", "/v1/nodes", 200)
        assert {n["id"] for n in nodes["nodes"]} == {a.node_id, b.node_id}
        await call("GET", "/v1/nodes/{node_id}/statement", 200, node_id=a.node_id)

        # An audit of a's round (opened here: the draw and the referee are coordinator.audits', tested apart):
        # a uploads its evidence, b referees it.
        async with app[SESSIONS].begin() as db:
            claim_id = (await db.scalars(select(Contribution.id).where(Contribution.node_id == a.node_id))).one()
            db.add(Audit(id="a-0123456789ab", job_id=job["id"], node_id=a.node_id, epoch=0, claim_id=claim_id,
                         state="requested", referees=[], excluded=[], failures=0, reason="", requested_at=now,
                         deadline=now + 600))
        assert (await call("POST", "/v1/nodes/assignments", 200, signed(a, "poll", {"node_id": a.node_id})))["audits"]
        evidence = {"audit_id": "a-0123456789ab", "node_id": a.node_id, "size": len(data),
                    "sha256": hashlib.sha256(data).hexdigest()}
        await call("PUT", "/v1/audits/{audit_id}/evidence", 201, data=data, audit_id="a-0123456789ab",
                   headers={ENVELOPE_HEADER: json.dumps(signed(a, audits.EVIDENCE_KIND, evidence)),
                            "Content-Type": "application/octet-stream"})
        async with app[SESSIONS].begin() as db:
            audit = await db.get(Audit, "a-0123456789ab")
            audit.state, audit.referee_id = "assigned", b.node_id
        assert (await call("POST", "/v1/nodes/assignments", 200, signed(b, "poll", {"node_id": b.node_id})))["referee"]
        await call("POST", "/v1/audits/{audit_id}/verdict", 200, signed(b, audits.VERDICT_KIND, {
            "audit_id": "a-0123456789ab", "node_id": b.node_id, "steps": 3, "samples": 96, "distance": 0.0,
            "passed": True}), audit_id="a-0123456789ab")
        assert (await call("GET", "/v1/jobs/{job_id}/audits", 200, token=token, job_id=job["id"]))["audits"]

        other = await call("POST", "/v1/jobs", 201, spec | {"name": "cancelled"}, token=token)
        await call("POST", "/v1/jobs/{job_id}/cancel", 200, token=token, job_id=other["id"])

        # A sweep: its first trial starts as a job at the supervisor's next tick, then the sweep is cancelled.
        sweep = await call("POST", "/v1/sweeps", 201, {
            "trials": 2, "parallel": 1, "space": {"hidden": {"type": "int", "low": 16, "high": 64}},
            "job": spec | {"name": "trial"}}, token=token)
        deadline = time.monotonic() + 15
        while not (await call("GET", "/v1/sweeps/{sweep_id}", 200, token=token, sweep_id=sweep["id"]))["trials"]:
            assert time.monotonic() < deadline, "the sweep started no trial"
            await asyncio.sleep(0.2)
        assert (await call("GET", "/v1/sweeps", 200, token=token))["sweeps"][0]["id"] == sweep["id"]
        await call("POST", "/v1/sweeps/{sweep_id}/cancel", 200, token=token, sweep_id=sweep["id"])
        await call("POST", "/v1/nodes/{node_id}/revoke", 200, {}, token=admin_token, node_id=b.node_id)

        documented = {(path, method) for path, operations in document["paths"].items() for method in operations}
        assert documented - NOT_JSON - call.called == set(), "documented routes this test did not call"
