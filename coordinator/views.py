"""HTTP handlers of the /v1 API.

Owns request parsing (bounded reads, proto validation, signature and replay checks), the per-request database
transactions and the JSON shapes of responses. Every write happens in one `sessions.begin()` block, so a request
that fails validation half-way leaves the database as it was. Errors are raised as `ApiError`s and rendered by
`errors.error_middleware`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import time
from typing import Any, TypeVar

from aiohttp import web
from gpuswarm.coordinator.config import ADMIN_TOKEN, ADVERTS, CONFIG, DHT_PEERS, MESH_VERSION, SESSIONS, WAKE
from gpuswarm.coordinator.db import Artifact, AssignmentRow, Contribution, Job, JobEvent, Node, remember_nonce
from gpuswarm.coordinator.errors import (
    BadRequest,
    Conflict,
    Forbidden,
    NotFound,
    PayloadTooLarge,
    Unauthorized,
    Unprocessable,
    validation_details,
)
from gpuswarm.coordinator.mesh import assign_address, mesh_config, release_address
from gpuswarm.proto.dht import job_run_id
from gpuswarm.proto.models import (
    ArtifactMeta,
    Assignment,
    AssignmentPoll,
    AssignmentState,
    ContributionClaim,
    Heartbeat,
    JobSpec,
    JobState,
    MeshPoll,
    NodeRegistration,
    NodeState,
    RegistrationResponse,
    is_job_id,
)
from gpuswarm.proto.signing import MAX_CLOCK_SKEW, SignatureError, SignedEnvelope, node_id_for, verify
from pydantic import BaseModel, ValidationError
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from gpuswarm import __version__

logger = logging.getLogger(__name__)
routes = web.RouteTableDef()
M = TypeVar("M", bound=BaseModel)
ENVELOPE_HEADER = "X-Gpuswarm-Envelope"


# ---------------------------------------------------------------------------------------------------- parsing


async def read_json(request: web.Request) -> Any:
    """The request body as JSON, refusing bodies over the JSON cap before reading them whole."""
    limit = request.app[CONFIG].max_json_bytes
    if request.content_length is not None and request.content_length > limit:
        raise PayloadTooLarge(f"request body is {request.content_length} bytes; the limit is {limit}")
    raw = bytearray()
    while len(raw) <= limit and (chunk := await request.content.read(limit + 1 - len(raw))):
        raw += chunk
    if len(raw) > limit:
        raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"malformed JSON: {e}", code="malformed_json") from None
    except RecursionError:
        raise BadRequest("malformed JSON: nested too deeply", code="malformed_json") from None


def parse(model: type[M], data: Any, what: str) -> M:
    try:
        return model.model_validate(data)
    except ValidationError as e:
        details = validation_details(e)
        summary = "; ".join(f"{d['field'] or what}: {d['message']}" for d in details[:3])
        raise Unprocessable(f"invalid {what}: {summary}", details=details) from None


async def read_signed(request: web.Request, kind: str, model: type[M]) -> tuple[SignedEnvelope, M]:
    return check_envelope(await read_json(request), kind, model)


def check_envelope(data: Any, kind: str, model: type[M]) -> tuple[SignedEnvelope, M]:
    envelope = parse(SignedEnvelope, data, "signed envelope")
    try:
        signer = verify(envelope, kind=kind)
    except SignatureError as e:
        raise Unauthorized(str(e), code="bad_signature") from None
    payload = parse(model, envelope.payload, kind)
    if getattr(payload, "node_id", signer) != signer:
        raise Unauthorized("the payload's node_id is not the signer's", code="bad_signature")
    return envelope, payload


async def known_node(session: AsyncSession, envelope: SignedEnvelope, node_id: str) -> Node:
    """The registered node that signed `envelope`; its nonce is recorded in the same transaction."""
    node = await session.get(Node, node_id)
    if node is None:
        raise NotFound(f"node {node_id} is not registered", code="unknown_node")
    if node.public_key != envelope.public_key:
        raise Unauthorized("signed with a key that is not this node's", code="bad_signature")
    if node.revoked:
        raise Forbidden(f"node {node_id} has been revoked", code="revoked")
    await remember_nonce(session, envelope.nonce, envelope.timestamp + 2 * MAX_CLOCK_SKEW)
    return node


async def get_job(session: AsyncSession, job_id: str) -> Job:
    job = await session.get(Job, job_id) if is_job_id(job_id) else None
    if job is None:
        raise NotFound(f"no job {job_id!r}", code="unknown_job")
    return job


def wake(request: web.Request) -> None:
    if WAKE in request.app:
        request.app[WAKE].set()


async def mesh_changed(request: web.Request) -> int:
    """Tell long-polling nodes that peer lists changed; returns the new mesh version."""
    return await request.app[MESH_VERSION].bump()


def require_admin(request: web.Request) -> None:
    expected = request.app[ADMIN_TOKEN]
    given = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
    if not given or not secrets.compare_digest(given, expected):
        raise Unauthorized("this needs the admin token (Authorization: Bearer ...; see DATA_DIR/admin.token)",
                           code="admin_only")


def observed_endpoint(request: web.Request, port: int) -> str | None:
    """The address the node's request came from, with its WireGuard port: a candidate it may not know itself."""
    host = request.remote
    if not host:
        return None
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# ---------------------------------------------------------------------------------------------------- shapes


def job_json(job: Job) -> dict:
    return {
        "id": job.id, "name": job.name, "state": job.state, "spec": job.spec,
        "created_at": job.created_at, "started_at": job.started_at, "finished_at": job.finished_at,
        "progress": {"epoch": job.epoch, "global_step": job.global_step, "accuracy": job.accuracy, "loss": job.loss,
                     "samples_per_second": job.samples_per_second, "peers": job.peers},
        "final_accuracy": job.final_accuracy, "error": job.error,
    }


def node_json(node: Node, adverts: dict) -> dict:
    advert = adverts.get(node.id)
    return {
        "id": node.id, "state": node.state, "online": node.online, "resources": node.resources,
        "software_version": node.software_version, "price_per_gpu_hour": node.price_per_gpu_hour,
        "endpoints": node.endpoints, "registered_at": node.registered_at, "last_seen": node.last_seen,
        "revoked": node.revoked, "mesh_address": node.mesh_address, "mesh_endpoints": node.mesh_endpoints,
        "advert": None if advert is None else {"state": advert["state"], "expires_at": advert["dht_expiry"],
                                                "maddrs": advert["maddrs"]},
    }


async def ledger(session: AsyncSession, job_id: str) -> list[dict]:
    rows = await session.execute(
        select(Contribution.node_id, func.sum(Contribution.samples), func.sum(Contribution.steps),
               func.sum(Contribution.compute_seconds), func.sum(Contribution.rounds_joined), func.count())
        .where(Contribution.job_id == job_id).group_by(Contribution.node_id).order_by(Contribution.node_id)
    )
    return [{"node_id": n, "samples": s, "steps": st, "compute_seconds": round(c, 3), "rounds_joined": r,
             "claims": k} for n, s, st, c, r, k in rows]


# ---------------------------------------------------------------------------------------------------- general


@routes.get("/v1/health")
async def health(request: web.Request) -> web.Response:
    return web.json_response({"ok": True, "version": __version__, "time": time.time()})


@routes.get("/v1/dht")
async def dht_peers(request: web.Request) -> web.Response:
    return web.json_response({"initial_peers": request.app[DHT_PEERS]})


# ---------------------------------------------------------------------------------------------------- nodes


@routes.post("/v1/nodes/register")
async def register(request: web.Request) -> web.Response:
    envelope, reg = await read_signed(request, "register", NodeRegistration)
    if node_id_for(envelope.public_key) != reg.node_id:
        raise Unauthorized("node_id is not derived from the signing key", code="bad_signature")
    config, now = request.app[CONFIG], time.time()
    async with request.app[SESSIONS].begin() as session:
        await remember_nonce(session, envelope.nonce, envelope.timestamp + 2 * MAX_CLOCK_SKEW)
        node = await session.get(Node, reg.node_id)
        if node is None:
            node = Node(id=reg.node_id, public_key=envelope.public_key, registered_at=now)
            session.add(node)
        elif node.revoked:
            raise Forbidden(f"node {reg.node_id} has been revoked", code="revoked")
        node.resources = reg.resources.model_dump(mode="json")
        node.software_version = reg.software_version
        node.price_per_gpu_hour = reg.price_per_gpu_hour
        # The address the coordinator saw the node from is a candidate endpoint the node itself may not know.
        node.endpoints = list(dict.fromkeys([*reg.endpoints, *([request.remote] if request.remote else [])]))
        node.state, node.online, node.last_seen = NodeState.IDLE.value, True, now
        if reg.mesh is not None:
            if node.wg_public_key and node.wg_public_key != reg.mesh.public_key:
                await release_address(session, config.mesh_cidr, node.wg_public_key, now)
            node.wg_public_key = reg.mesh.public_key
            node.mesh_address = await assign_address(session, config.mesh_cidr, reg.mesh.public_key, now)
            observed = observed_endpoint(request, reg.mesh.listen_port)
            node.mesh_endpoints = list(dict.fromkeys([*reg.mesh.endpoints, *([observed] if observed else [])]))
        else:
            node.mesh_address = None
    logger.info("node %s registered (%d GPU(s), %s, %s)", reg.node_id, reg.resources.gpu_count,
                reg.software_version, f"mesh {node.mesh_address}" if reg.mesh else "no mesh")
    wake(request)
    mesh = None
    if reg.mesh is not None:
        version = await mesh_changed(request)
        async with request.app[SESSIONS]() as session:
            mesh = await mesh_config(session, await session.get(Node, reg.node_id), config.mesh_cidr, version)
    response = RegistrationResponse(node_id=reg.node_id, dht_initial_peers=request.app[DHT_PEERS],
                                    heartbeat_interval=config.heartbeat_interval, advert_ttl=config.advert_ttl,
                                    mesh=mesh)
    return web.json_response(response.model_dump(mode="json"))


@routes.post("/v1/nodes/heartbeat")
async def heartbeat(request: web.Request) -> web.Response:
    envelope, hb = await read_signed(request, "heartbeat", Heartbeat)
    config, now = request.app[CONFIG], time.time()
    async with request.app[SESSIONS].begin() as session:
        node = await known_node(session, envelope, hb.node_id)
        was_online = node.online
        node.last_seen, node.state, node.online = now, hb.state.value, hb.state is not NodeState.OFFLINE
        membership_changed = node.mesh_address is not None and was_online != node.online
        active = {a.job_id: a for a in (await session.scalars(select(AssignmentRow).where(
            AssignmentRow.node_id == node.id, AssignmentRow.state == AssignmentState.ACTIVE.value))).all()}
        for p in hb.progress:
            job = await session.get(Job, p.job_id)
            # Only a member of a running job moves its progress, and never backwards.
            if job is None or p.job_id not in active or job.state != JobState.RUNNING.value:
                continue
            if p.global_step >= job.global_step:
                job.epoch, job.global_step, job.accuracy, job.loss = p.epoch, p.global_step, p.accuracy, p.loss
                job.samples_per_second, job.peers = p.samples_per_second, p.peers
        for f in hb.failures:
            assignment = active.pop(f.job_id, None)  # pop: one failure per assignment, however often it is listed
            if assignment is None:
                continue
            assignment.state, assignment.ended_at = AssignmentState.FAILED.value, now
            assignment.reason = f.reason[-2000:]
            job = await session.get(Job, f.job_id)
            job.failures += 1
            session.add(JobEvent(job_id=job.id, at=now, message=f"node {node.id} failed: {f.reason[-300:]}"))
            if job.failures >= config.max_job_failures and not JobState(job.state).is_final:
                job.error = f.reason[-2000:]
                await end_job(session, job, JobState.FAILED, now, f"failed after {job.failures} node failures")
        if hb.state is NodeState.OFFLINE:
            await lose_assignments(session, node.id, now, "node went offline")
    if hb.failures or hb.state is NodeState.OFFLINE:
        wake(request)
    if membership_changed:
        await mesh_changed(request)
    return web.json_response({"ok": True, "server_time": now})


@routes.post("/v1/mesh/peers")
async def mesh_peers(request: web.Request) -> web.Response:
    """Long-poll: answers as soon as the mesh version passes `since` (at once if it already has), or after
    `mesh_poll_timeout` seconds with the current list. Nodes apply joins, leaves and revocations from here."""
    envelope, poll = await read_signed(request, "mesh_poll", MeshPoll)
    config = request.app[CONFIG]
    async with request.app[SESSIONS].begin() as session:
        node = await known_node(session, envelope, poll.node_id)
        if node.mesh_address is None:
            raise Conflict(f"node {node.id} registered without the mesh", code="no_mesh")
    version = await request.app[MESH_VERSION].wait_past(poll.since, config.mesh_poll_timeout)
    async with request.app[SESSIONS]() as session:
        node = await session.get(Node, poll.node_id)
        if node.revoked:
            raise Forbidden(f"node {node.id} has been revoked", code="revoked")
        mesh = await mesh_config(session, node, config.mesh_cidr, version)
    return web.json_response(mesh.model_dump(mode="json"))


@routes.post("/v1/nodes/{node_id}/revoke")
async def revoke_node(request: web.Request) -> web.Response:
    """Admin: remove a node from every peer's mesh, end its assignments, refuse its later requests."""
    require_admin(request)
    node_id, now = request.match_info["node_id"], time.time()
    async with request.app[SESSIONS].begin() as session:
        node = await session.get(Node, node_id)
        if node is None:
            raise NotFound(f"node {node_id} is not registered", code="unknown_node")
        if node.revoked:
            raise Conflict(f"node {node_id} is already revoked", code="revoked")
        node.revoked, node.online, node.state = True, False, NodeState.OFFLINE.value
        if node.wg_public_key:
            await release_address(session, request.app[CONFIG].mesh_cidr, node.wg_public_key, now)
        await lose_assignments(session, node.id, now, "node revoked")
    logger.warning("node %s revoked", node_id)
    await mesh_changed(request)
    wake(request)
    return web.json_response({"ok": True, "node_id": node_id, "revoked": True})


@routes.post("/v1/nodes/assignments")
async def poll_assignments(request: web.Request) -> web.Response:
    envelope, poll = await read_signed(request, "poll", AssignmentPoll)
    async with request.app[SESSIONS].begin() as session:
        await known_node(session, envelope, poll.node_id)
        rows = await session.execute(
            select(AssignmentRow, Job).join(Job, Job.id == AssignmentRow.job_id)
            .where(AssignmentRow.node_id == poll.node_id, AssignmentRow.state == AssignmentState.ACTIVE.value)
        )
        assignments = [
            Assignment(assignment_id=a.id, job_id=j.id, node_id=a.node_id, state=AssignmentState(a.state),
                       job_state=JobState(j.state), spec=JobSpec.model_validate(j.spec), run_id=job_run_id(j.id),
                       shard_index=a.shard_index, num_shards=a.num_shards,
                       initial_peers=request.app[DHT_PEERS]).model_dump(mode="json")
            for a, j in rows
        ]
    return web.json_response({"assignments": assignments})


@routes.get("/v1/nodes")
async def list_nodes(request: web.Request) -> web.Response:
    async with request.app[SESSIONS]() as session:
        nodes = (await session.scalars(select(Node).order_by(Node.registered_at))).all()
        busy = dict((await session.execute(select(AssignmentRow.node_id, AssignmentRow.job_id).where(
            AssignmentRow.state == AssignmentState.ACTIVE.value))).all())
    adverts = request.app.get(ADVERTS, {})
    return web.json_response({"nodes": [node_json(n, adverts) | {"job_id": busy.get(n.id)} for n in nodes]})


async def lose_assignments(session: AsyncSession, node_id: str, now: float, reason: str) -> None:
    rows = (await session.scalars(select(AssignmentRow).where(
        AssignmentRow.node_id == node_id, AssignmentRow.state == AssignmentState.ACTIVE.value))).all()
    for a in rows:
        a.state, a.ended_at, a.reason = AssignmentState.LOST.value, now, reason
        session.add(JobEvent(job_id=a.job_id, at=now, message=f"node {node_id}: {reason}"))


# ---------------------------------------------------------------------------------------------------- contributions


@routes.post("/v1/contributions")
async def report_contribution(request: web.Request) -> web.Response:
    envelope, claim = await read_signed(request, "contribution", ContributionClaim)
    now = time.time()
    if claim.window_end > now + MAX_CLOCK_SKEW:
        raise Unprocessable("claim window ends in the future", code="bad_claim")
    async with request.app[SESSIONS].begin() as session:
        await known_node(session, envelope, claim.node_id)
        job = await get_job(session, claim.job_id)
        member = await session.scalar(select(AssignmentRow.id).where(
            AssignmentRow.job_id == job.id, AssignmentRow.node_id == claim.node_id).limit(1))
        if member is None:
            raise Forbidden(f"node {claim.node_id} was never assigned to job {job.id}", code="not_a_member")
        duplicate = await session.scalar(select(Contribution.id).where(
            Contribution.job_id == claim.job_id, Contribution.node_id == claim.node_id, Contribution.seq == claim.seq))
        if duplicate is not None:
            raise Conflict(f"claim {claim.seq} of node {claim.node_id} for {job.id} was already recorded",
                           code="duplicate_claim")
        session.add(Contribution(**claim.model_dump(), received_at=now, envelope=envelope.model_dump(mode="json")))
    return web.json_response({"ok": True, "seq": claim.seq}, status=201)


# ---------------------------------------------------------------------------------------------------- jobs


@routes.post("/v1/jobs")
async def submit_job(request: web.Request) -> web.Response:
    spec = parse(JobSpec, await read_json(request), "job spec")
    now = time.time()
    job = Job(id=f"j-{secrets.token_hex(6)}", name=spec.name, spec=spec.model_dump(mode="json"),
              state=JobState.PENDING.value, created_at=now)
    async with request.app[SESSIONS].begin() as session:
        session.add(job)
        session.add(JobEvent(job_id=job.id, at=now, message=f"submitted ({spec.workload}, "
                             f"{spec.min_nodes}-{spec.max_nodes} nodes)"))
    logger.info("job %s submitted (%s)", job.id, spec.workload)
    wake(request)
    return web.json_response(job_json(job), status=201)


@routes.get("/v1/jobs")
async def list_jobs(request: web.Request) -> web.Response:
    state = request.query.get("state")
    if state is not None and state not in {s.value for s in JobState}:
        raise BadRequest(f"unknown state {state!r}; one of {', '.join(s.value for s in JobState)}")
    async with request.app[SESSIONS]() as session:
        query = select(Job).order_by(Job.created_at.desc())
        if state:
            query = query.where(Job.state == state)
        jobs = (await session.scalars(query)).all()
        counts = dict((await session.execute(select(AssignmentRow.job_id, func.count()).where(
            AssignmentRow.state == AssignmentState.ACTIVE.value).group_by(AssignmentRow.job_id))).all())
    return web.json_response({"jobs": [job_json(j) | {"active_nodes": counts.get(j.id, 0)} for j in jobs]})


@routes.get("/v1/jobs/{job_id}")
async def job_detail(request: web.Request) -> web.Response:
    async with request.app[SESSIONS]() as session:
        job = await get_job(session, request.match_info["job_id"])
        assignments = (await session.scalars(
            select(AssignmentRow).where(AssignmentRow.job_id == job.id).order_by(AssignmentRow.id))).all()
        artifacts = (await session.scalars(select(Artifact).where(Artifact.job_id == job.id))).all()
        events = (await session.scalars(
            select(JobEvent).where(JobEvent.job_id == job.id).order_by(JobEvent.id.desc()).limit(50))).all()
        contributions = await ledger(session, job.id)
    return web.json_response(job_json(job) | {
        "assignments": [{"node_id": a.node_id, "state": a.state, "shard_index": a.shard_index,
                         "created_at": a.created_at, "ended_at": a.ended_at, "reason": a.reason} for a in assignments],
        "artifacts": [{"name": a.name, "size": a.size, "sha256": a.sha256, "final": a.final, "accuracy": a.accuracy,
                       "node_id": a.node_id, "created_at": a.created_at} for a in artifacts],
        "contributions": contributions,
        "events": [{"at": e.at, "message": e.message} for e in reversed(events)],
    })


@routes.get("/v1/jobs/{job_id}/contributions")
async def job_contributions(request: web.Request) -> web.Response:
    async with request.app[SESSIONS]() as session:
        job = await get_job(session, request.match_info["job_id"])
        return web.json_response({"job_id": job.id, "contributions": await ledger(session, job.id)})


@routes.post("/v1/jobs/{job_id}/cancel")
async def cancel_job(request: web.Request) -> web.Response:
    now = time.time()
    async with request.app[SESSIONS].begin() as session:
        job = await get_job(session, request.match_info["job_id"])
        if JobState(job.state).is_final:
            raise Conflict(f"job {job.id} is already {job.state}", code="job_final")
        await end_job(session, job, JobState.CANCELLED, now, "cancelled by its owner")
    logger.info("job %s cancelled", job.id)
    return web.json_response(job_json(job))


async def end_job(session: AsyncSession, job: Job, state: JobState, now: float, message: str) -> None:
    """Move a job to a final state and close its active assignments."""
    job.state, job.finished_at = state.value, now
    closing = AssignmentState.CANCELLED if state is JobState.CANCELLED else AssignmentState.FINISHED
    rows = (await session.scalars(select(AssignmentRow).where(
        AssignmentRow.job_id == job.id, AssignmentRow.state == AssignmentState.ACTIVE.value))).all()
    for a in rows:
        a.state, a.ended_at, a.reason = closing.value, now, message
    session.add(JobEvent(job_id=job.id, at=now, message=message))


# ---------------------------------------------------------------------------------------------------- artifacts


@routes.put("/v1/jobs/{job_id}/artifacts/{name}")
async def upload_artifact(request: web.Request) -> web.Response:
    config = request.app[CONFIG]
    header = request.headers.get(ENVELOPE_HEADER)
    if header is None:
        raise Unauthorized(f"artifact uploads need a signed {ENVELOPE_HEADER} header", code="bad_signature")
    try:
        header_json = json.loads(header)
    except json.JSONDecodeError as e:
        raise BadRequest(f"malformed JSON in {ENVELOPE_HEADER}: {e}", code="malformed_json") from None
    envelope, meta = check_envelope(header_json, "artifact", ArtifactMeta)
    if meta.job_id != request.match_info["job_id"] or meta.name != request.match_info["name"]:
        raise BadRequest("the signed job id and name do not match the URL")
    if meta.size > config.max_artifact_bytes:
        raise PayloadTooLarge(f"artifact is {meta.size} bytes; the limit is {config.max_artifact_bytes}")
    if request.content_length is not None and request.content_length != meta.size:
        raise BadRequest(f"body is {request.content_length} bytes but the signed size is {meta.size}")
    async with request.app[SESSIONS]() as session:  # read-only checks before accepting the bytes
        job = await get_job(session, meta.job_id)
        node = await session.get(Node, meta.node_id)
        if node is None or node.public_key != envelope.public_key:
            raise Unauthorized("artifact is not signed by a registered node", code="bad_signature")
        member = await session.scalar(select(AssignmentRow.id).where(
            AssignmentRow.job_id == job.id, AssignmentRow.node_id == node.id).limit(1))
        if member is None:
            raise Forbidden(f"node {node.id} was never assigned to job {job.id}", code="not_a_member")

    directory = config.artifact_dir / meta.job_id
    tmp = config.artifact_dir / f".{meta.job_id}.{meta.name}.{secrets.token_hex(4)}.part"
    digest, size = hashlib.sha256(), 0
    try:
        with open(tmp, "wb") as f:
            async for chunk in request.content.iter_chunked(1 << 20):
                size += len(chunk)
                if size > meta.size:
                    raise BadRequest(f"body is longer than the signed size {meta.size}")
                digest.update(chunk)
                f.write(chunk)
        if size != meta.size or digest.hexdigest() != meta.sha256:
            raise BadRequest("body does not match the signed size and SHA-256", code="digest_mismatch")
        now = time.time()
        async with request.app[SESSIONS].begin() as session:
            await remember_nonce(session, envelope.nonce, envelope.timestamp + 2 * MAX_CLOCK_SKEW)
            job = await get_job(session, meta.job_id)
            if meta.final and JobState(job.state).is_final:
                raise Conflict(f"job {job.id} is already {job.state}", code="job_final")
            existing = await session.scalar(select(Artifact).where(Artifact.job_id == job.id,
                                                                   Artifact.name == meta.name))
            if existing is not None:
                await session.delete(existing)
                await session.flush()
            session.add(Artifact(job_id=job.id, name=meta.name, node_id=meta.node_id, sha256=meta.sha256,
                                 size=meta.size, final=meta.final, accuracy=meta.accuracy, created_at=now))
            directory.mkdir(parents=True, exist_ok=True)
            os.replace(tmp, directory / meta.name)
            if meta.final:
                job.final_accuracy = meta.accuracy
                if meta.accuracy is not None:
                    job.accuracy = meta.accuracy
                await end_job(session, job, JobState.COMPLETED, now,
                              f"completed: node {meta.node_id} saved the final model (accuracy {meta.accuracy})")
    finally:
        tmp.unlink(missing_ok=True)
    logger.info("artifact %s/%s stored (%d bytes%s)", meta.job_id, meta.name, size, ", final" if meta.final else "")
    wake(request)
    return web.json_response({"ok": True, "name": meta.name, "size": size, "sha256": meta.sha256}, status=201)


@routes.get("/v1/jobs/{job_id}/artifacts/{name}")
async def download_artifact(request: web.Request) -> web.StreamResponse:
    async with request.app[SESSIONS]() as session:
        job = await get_job(session, request.match_info["job_id"])
        artifact = await session.scalar(select(Artifact).where(Artifact.job_id == job.id,
                                                               Artifact.name == request.match_info["name"]))
    if artifact is None:
        raise NotFound(f"job {job.id} has no artifact {request.match_info['name']!r}", code="unknown_artifact")
    path = request.app[CONFIG].artifact_dir / job.id / artifact.name
    return web.FileResponse(path, headers={"X-Content-SHA256": artifact.sha256,
                                           "Content-Disposition": f'attachment; filename="{artifact.name}"'})


def setup_routes(app: web.Application) -> None:
    app.add_routes(routes)
