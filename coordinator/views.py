"""HTTP handlers of the /v1 API.

Owns request parsing (bounded reads, proto validation, signature and replay checks), the per-request database
transactions and the JSON shapes of responses. Every write happens in one `sessions.begin()` block, so a request
that fails validation half-way leaves the database as it was. Errors are raised as `ApiError`s and rendered by
`errors.error_middleware`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import secrets
import time
from typing import Any, TypeVar

from aiohttp import web
from gpuswarm.coordinator import ledger, openapi, reputation, tensorboard
from gpuswarm.coordinator.auth import check_owner, create_owner, current_owner, owner_of, require_admin
from gpuswarm.coordinator.challenge_schedule import after_registration
from gpuswarm.coordinator.config import ADVERTS, CONFIG, DHT_PEERS, HEARTBEATS, MESH_VERSION, SESSIONS, WAKE
from gpuswarm.coordinator.db import (
    Artifact,
    AssignmentRow,
    Attestation,
    Contribution,
    Job,
    JobEvent,
    JobProgress,
    Node,
    Owner,
    remember_nonce,
)
from gpuswarm.coordinator.errors import (
    BadRequest,
    Conflict,
    Forbidden,
    NotFound,
    PayloadTooLarge,
    PaymentRequired,
    Unauthorized,
    Unprocessable,
    validation_details,
)
from gpuswarm.coordinator.heartbeats import end_job, lose_assignments
from gpuswarm.coordinator.mesh import assign_address, mesh_config, release_address
from gpuswarm.coordinator.openapi import describe
from gpuswarm.proto.dht import job_run_id
from gpuswarm.proto.models import (
    CLAIM_KIND,
    ArtifactMeta,
    Assignment,
    AssignmentPoll,
    AssignmentState,
    ContributionClaim,
    CreditAdjustment,
    Heartbeat,
    JobSpec,
    JobState,
    MeshPoll,
    NewOwner,
    NodeRegistration,
    NodeState,
    RegistrationResponse,
    RoundReport,
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
MAX_PROGRESS_POINTS = 5000  # per response of GET /v1/jobs/{id}/progress: the oldest, when a job has more
MAX_STEP = 2**53  # proto's Count: no reported global_step is larger


# ---------------------------------------------------------------------------------------------------- parsing


async def read_json(request: web.Request, limit: int | None = None) -> Any:
    """The request body as JSON, refusing bodies over `limit` (default: the JSON cap) before reading them whole."""
    limit = limit or request.app[CONFIG].max_json_bytes
    if request.content_length is not None and request.content_length > limit:
        raise PayloadTooLarge(f"request body is {request.content_length} bytes; the limit is {limit}")
    raw = bytearray()
    while len(raw) <= limit and (chunk := await request.content.read(limit + 1 - len(raw))):
        raw += chunk
    if len(raw) > limit:
        raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"malformed JSON: {e}", code="malformed_json") from None
    except RecursionError:
        raise BadRequest("malformed JSON: nested too deeply", code="malformed_json") from None
    if _has_nul(data):
        # PostgreSQL text cannot hold NUL (SQLite would store it): refuse it here for every database alike.
        raise Unprocessable("text must not contain NUL characters (\\u0000)", code="nul_character")
    return data


def _has_nul(data: Any) -> bool:
    stack = [data]
    while stack:  # a loop, not recursion: json.loads accepts nesting deeper than a recursive walk would survive
        item = stack.pop()
        if isinstance(item, str):
            if "\x00" in item:
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


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


async def owned_job(request: web.Request, session: AsyncSession) -> Job:
    """The job named in the URL, if the request's owner token is its owner's (401/403/404 otherwise)."""
    owner = await current_owner(request, session)
    job = await get_job(session, request.match_info["job_id"])
    check_owner(job, owner)
    return job


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
        "final_accuracy": job.final_accuracy, "error": job.error, "owner_id": job.owner_id,
        "dht_epoch": job.dht_epoch,
    }


def node_json(node: Node, adverts: dict) -> dict:
    advert = adverts.get(node.id)
    return {
        "id": node.id, "state": node.state, "online": node.online, "resources": node.resources,
        "software_version": node.software_version, "price_per_gpu_hour": node.price_per_gpu_hour,
        "endpoints": node.endpoints, "registered_at": node.registered_at, "last_seen": node.last_seen,
        "revoked": node.revoked, "mesh_address": node.mesh_address, "mesh_endpoints": node.mesh_endpoints,
        "verified": bool(node.verified), "measured_gflops": node.measured_gflops,
        "online_seconds": round(node.online_seconds, 1),
        "advert": None if advert is None else {"state": advert["state"], "expires_at": advert["dht_expiry"],
                                                "maddrs": advert["maddrs"]},
    }


# ---------------------------------------------------------------------------------------------------- general


@routes.get("/v1/health")
async def health(request: web.Request) -> web.Response:
    """Liveness, version and the coordinator's clock."""
    return web.json_response({"ok": True, "version": __version__, "time": time.time()})


@routes.get("/v1/openapi.json")
async def openapi_document(request: web.Request) -> web.Response:
    """This API's OpenAPI 3.1 document."""
    return web.json_response(openapi.build(request.app))


@routes.get("/v1/dht")
async def dht_peers(request: web.Request) -> web.Response:
    """The DHT bootstrap peer's multiaddrs."""
    return web.json_response({"initial_peers": request.app[DHT_PEERS]})


# ---------------------------------------------------------------------------------------------------- nodes


@routes.post("/v1/nodes/register")
@describe(auth="node", body=NodeRegistration, signed="register")
async def register(request: web.Request) -> web.Response:
    """Register (or re-register) a node; with the mesh, returns its mesh address and peers."""
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
        resources = reg.resources.model_dump(mode="json")
        after_registration(node, node.resources != resources, config, now)  # GPU challenge due; new claim: unverified
        node.resources = resources
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
@describe(auth="node", body=Heartbeat, signed="heartbeat")
async def heartbeat(request: web.Request) -> web.Response:
    """A node's heartbeat: state, training progress, failures, RTTs to peers."""
    envelope, hb = await read_signed(request, "heartbeat", Heartbeat)
    outcome = await request.app[HEARTBEATS].submit(envelope, hb)
    if outcome.wake:
        wake(request)
    if outcome.membership_changed:
        await mesh_changed(request)
    return web.json_response({"ok": True, "server_time": time.time(), "challenge": outcome.challenge})


@routes.post("/v1/mesh/peers")
@describe(auth="node", body=MeshPoll, signed="mesh_poll")
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
@describe(auth="admin")
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
@describe(auth="node", body=AssignmentPoll, signed="poll")
async def poll_assignments(request: web.Request) -> web.Response:
    """The node's active assignments."""
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
    """Every registered node: resources, price, reputation, verification, state, live DHT advert."""
    async with request.app[SESSIONS]() as session:
        nodes = (await session.scalars(select(Node).order_by(Node.registered_at))).all()
        jobs: dict[str, list[str]] = {}
        for node_id, job_id in await session.execute(select(AssignmentRow.node_id, AssignmentRow.job_id).where(
                AssignmentRow.state == AssignmentState.ACTIVE.value)):
            jobs.setdefault(node_id, []).append(job_id)
        records = await reputation.records(session, list(nodes), time.time())
    adverts = request.app.get(ADVERTS, {})
    return web.json_response({"nodes": [
        node_json(n, adverts) | {"job_id": (jobs.get(n.id) or [None])[0], "job_ids": jobs.get(n.id, []),
                                 "reputation": reputation.score(records[n.id])} for n in nodes]})


# ---------------------------------------------------------------------------------------------------- contributions


@routes.post("/v1/rounds")
@describe(auth="node", body=RoundReport, signed="round_report")
async def report_round(request: web.Request) -> web.Response:
    """A member's report of one round: its group's signed claims. Claims by nodes that are not members of the
    job, or for another job, are ignored (a peer's bad gather data must not void an honest report); a claim that
    is not a valid signed claim rejects the whole report. Reporting the same round again changes nothing."""
    envelope, report = await read_signed(request, "round_report", RoundReport)
    now = time.time()
    claims: list[tuple[SignedEnvelope, ContributionClaim]] = []
    for i, raw in enumerate(report.claims):
        claim_envelope = parse(SignedEnvelope, raw, f"claim {i}")
        try:
            signer = verify(claim_envelope, kind=CLAIM_KIND, max_skew=float("inf"))  # may be buffered for long
        except SignatureError as e:
            raise Unprocessable(f"claim {i}: {e}", code="bad_claim") from None
        claim = parse(ContributionClaim, claim_envelope.payload, f"claim {i}")
        if claim.node_id != signer:
            raise Unprocessable(f"claim {i} is not signed by node {claim.node_id}", code="bad_claim")
        if claim.window_end > now + MAX_CLOCK_SKEW:
            raise Unprocessable(f"claim {i}: its window ends in the future", code="bad_claim")
        claims.append((claim_envelope, claim))
    own = [c for _, c in claims if c.node_id == report.node_id and c.job_id == report.job_id]
    if not own:
        raise Unprocessable("a round report must include the reporter's own claim", code="bad_claim")
    if report.solo and len(claims) != 1:
        raise Unprocessable("a solo round report holds exactly one claim", code="bad_claim")
    results, ignored = [], []
    async with request.app[SESSIONS].begin() as session:
        await known_node(session, envelope, report.node_id)
        job = await get_job(session, report.job_id)
        members = set((await session.scalars(select(AssignmentRow.node_id).where(
            AssignmentRow.job_id == job.id))).all())
        if report.node_id not in members:
            raise Forbidden(f"node {report.node_id} was never assigned to job {job.id}", code="not_a_member")
        for claim_envelope, claim in claims:
            if claim.job_id != job.id or claim.node_id not in members:
                ignored.append({"node_id": claim.node_id, "epoch": claim.epoch,
                                "reason": "not a member of this job" if claim.job_id == job.id else "another job"})
                continue
            row = await session.scalar(select(Contribution).where(
                Contribution.job_id == job.id, Contribution.node_id == claim.node_id,
                Contribution.epoch == claim.epoch, Contribution.signature == claim_envelope.signature))
            if row is None:
                row = Contribution(**claim.model_dump(exclude={"peer_id"}), solo=report.solo,
                                   signature=claim_envelope.signature, received_at=now,
                                   envelope=claim_envelope.model_dump(mode="json"), status="pending")
                session.add(row)
                await session.flush()
            if claim.node_id != report.node_id:
                seen = await session.scalar(select(Attestation.id).where(
                    Attestation.claim_id == row.id, Attestation.attester == report.node_id))
                if seen is None:
                    session.add(Attestation(claim_id=row.id, attester=report.node_id, at=now))
            results.append(row)
        await session.flush()
        waiting = set((await session.scalars(select(Contribution.epoch).where(
            Contribution.job_id == job.id, Contribution.status == "pending").distinct())).all())
        events = await ledger.credit_epochs(session, job, waiting | {r.epoch for r in results}, now)
        for message in dict.fromkeys(events):
            session.add(JobEvent(job_id=job.id, at=now, message=message))
        if "budget exhausted" in events and not JobState(job.state).is_final:
            job.error = "the job's budget is spent"
            await end_job(session, job, JobState.FAILED, now, "failed: budget exhausted")
        body = {"ok": True, "claims": [{"node_id": r.node_id, "epoch": r.epoch, "status": r.status,
                                        "credited_samples": r.credited_samples, "flag": r.flag} for r in results],
                "ignored": ignored}
    return web.json_response(body, status=201)


# ---------------------------------------------------------------------------------------------------- jobs


@routes.post("/v1/jobs")
@describe(auth="owner", body=JobSpec)
async def submit_job(request: web.Request) -> web.Response:
    """Submit a job (the budget must not exceed the owner's balance)."""
    owner = await owner_of(request)
    spec = parse(JobSpec, await read_json(request), "job spec")
    now = time.time()
    job = Job(id=f"j-{secrets.token_hex(6)}", name=spec.name, spec=spec.model_dump(mode="json"),
              state=JobState.PENDING.value, created_at=now, owner_id=owner.id)
    async with request.app[SESSIONS].begin() as session:
        available = await ledger.balance(session, ledger.owner_account(owner.id))
        if available < ledger.micro(spec.budget):
            raise PaymentRequired(f"the budget {spec.budget} is more than your balance "
                                  f"{ledger.credits(available)}", code="insufficient_funds")
        session.add(job)
        session.add(JobEvent(job_id=job.id, at=now, message=f"submitted ({spec.workload}, "
                             f"{spec.min_nodes}-{spec.max_nodes} nodes)"))
    logger.info("job %s submitted (%s)", job.id, spec.workload)
    wake(request)
    return web.json_response(job_json(job), status=201)


@routes.get("/v1/jobs")
@describe(auth="owner")
async def list_jobs(request: web.Request) -> web.Response:
    """The owner's jobs, newest first (?state= filters)."""
    state = request.query.get("state")
    if state is not None and state not in {s.value for s in JobState}:
        raise BadRequest(f"unknown state {state!r}; one of {', '.join(s.value for s in JobState)}")
    async with request.app[SESSIONS]() as session:
        owner = await current_owner(request, session)
        query = select(Job).where(Job.owner_id == owner.id).order_by(Job.created_at.desc())
        if state:
            query = query.where(Job.state == state)
        jobs = (await session.scalars(query)).all()
        counts = dict((await session.execute(select(AssignmentRow.job_id, func.count()).where(
            AssignmentRow.state == AssignmentState.ACTIVE.value).group_by(AssignmentRow.job_id))).all())
    return web.json_response({"jobs": [job_json(j) | {"active_nodes": counts.get(j.id, 0)} for j in jobs]})


@routes.get("/v1/jobs/{job_id}")
@describe(auth="owner")
async def job_detail(request: web.Request) -> web.Response:
    """A job with progress, assignments, contributions, artifacts and events."""
    async with request.app[SESSIONS]() as session:
        job = await owned_job(request, session)
        assignments = (await session.scalars(
            select(AssignmentRow).where(AssignmentRow.job_id == job.id).order_by(AssignmentRow.id))).all()
        artifacts = (await session.scalars(select(Artifact).where(Artifact.job_id == job.id))).all()
        events = (await session.scalars(
            select(JobEvent).where(JobEvent.job_id == job.id).order_by(JobEvent.id.desc()).limit(50))).all()
        contributions = await ledger.contributions(session, job.id)
    return web.json_response(job_json(job) | {
        "assignments": [{"node_id": a.node_id, "state": a.state, "shard_index": a.shard_index, "gpus": a.gpus,
                         "price_per_gpu_hour": a.price_per_gpu_hour, "created_at": a.created_at,
                         "ended_at": a.ended_at, "reason": a.reason} for a in assignments],
        "artifacts": [{"name": a.name, "size": a.size, "sha256": a.sha256, "final": a.final, "accuracy": a.accuracy,
                       "node_id": a.node_id, "created_at": a.created_at} for a in artifacts],
        "contributions": contributions,
        "events": [{"at": e.at, "message": e.message} for e in reversed(events)],
    })


@routes.get("/v1/jobs/{job_id}/contributions")
@describe(auth="owner")
async def job_contributions(request: web.Request) -> web.Response:
    """Per node: claimed, credited and paid."""
    async with request.app[SESSIONS]() as session:
        job = await owned_job(request, session)
        return web.json_response({"job_id": job.id, "contributions": await ledger.contributions(session, job.id)})


def step_query(request: web.Request, name: str) -> int | None:
    """An optional query parameter holding a global step: a whole number from 0 to 2**53 (400 otherwise)."""
    raw = request.query.get(name)
    if raw is None:
        return None
    if not re.fullmatch(r"[0-9]{1,16}", raw) or int(raw) > MAX_STEP:
        raise BadRequest(f"{name} must be a global step: a whole number from 0 to {MAX_STEP}, not {raw[:40]!r}")
    return int(raw)


@routes.get("/v1/jobs/{job_id}/progress")
@describe(auth="owner")
async def job_progress(request: web.Request) -> web.Response:
    """A job's training curve: one point per global step, oldest first (?after=STEP: only later steps). At most
    5000 points; `truncated` is true when more follow (ask again with ?after= the last step)."""
    async with request.app[SESSIONS]() as session:
        job = await owned_job(request, session)
        after = step_query(request, "after")
        query = select(*tensorboard.POINT_COLUMNS).where(JobProgress.job_id == job.id)
        if after is not None:
            query = query.where(JobProgress.global_step > after)
        rows = (await session.execute(
            query.order_by(JobProgress.global_step).limit(MAX_PROGRESS_POINTS + 1))).all()
    points = [dataclasses.asdict(tensorboard.Point(*row)) for row in rows[:MAX_PROGRESS_POINTS]]
    return web.json_response({"job_id": job.id, "state": job.state, "points": points,
                              "truncated": len(rows) > MAX_PROGRESS_POINTS})


@routes.post("/v1/jobs/{job_id}/cancel")
@describe(auth="owner")
async def cancel_job(request: web.Request) -> web.Response:
    """Cancel a pending or running job."""
    now = time.time()
    async with request.app[SESSIONS].begin() as session:
        job = await owned_job(request, session)
        if JobState(job.state).is_final:
            raise Conflict(f"job {job.id} is already {job.state}", code="job_final")
        await end_job(session, job, JobState.CANCELLED, now, "cancelled by its owner")
    logger.info("job %s cancelled", job.id)
    return web.json_response(job_json(job))


# ---------------------------------------------------------------------------------------------------- artifacts


@routes.put("/v1/jobs/{job_id}/artifacts/{name}")
@describe(auth="node", body=ArtifactMeta, signed="artifact")
async def upload_artifact(request: web.Request) -> web.Response:
    """Upload a model or checkpoint; the signed header binds the bytes' size and SHA-256."""
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
    if meta.name == tensorboard.ARTIFACT_NAME:
        raise Forbidden(f"{meta.name} is written by the coordinator from the job's progress; nodes cannot upload it",
                        code="reserved_artifact")
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
@describe(auth="owner")
async def download_artifact(request: web.Request) -> web.StreamResponse:
    """Download an artifact (header X-Content-SHA256). tensorboard.tfevents: the job's progress as a TensorBoard
    event file, stored when the job settles and rendered from the progress points until then."""
    name = request.match_info["name"]
    points = None
    async with request.app[SESSIONS]() as session:
        job = await owned_job(request, session)
        artifact = await session.scalar(select(Artifact).where(Artifact.job_id == job.id, Artifact.name == name))
        if artifact is None and name == tensorboard.ARTIFACT_NAME:
            points = await tensorboard.load_points(session, job.id)
    if points is not None:
        data = await tensorboard.render(points, time.time())
        return web.Response(body=data, content_type="application/octet-stream", headers={
            "X-Content-SHA256": hashlib.sha256(data).hexdigest(),
            "Content-Disposition": f'attachment; filename="{name}"'})
    if artifact is None:
        raise NotFound(f"job {job.id} has no artifact {name!r}", code="unknown_artifact")
    path = request.app[CONFIG].artifact_dir / job.id / artifact.name
    return web.FileResponse(path, headers={"X-Content-SHA256": artifact.sha256,
                                           "Content-Disposition": f'attachment; filename="{artifact.name}"'})


# ---------------------------------------------------------------------------------------------------- accounts


@routes.post("/v1/owners")
@describe(auth="admin", body=NewOwner)
async def new_owner(request: web.Request) -> web.Response:
    """Admin: create a job owner's account with initial credits; the token is in this response only."""
    require_admin(request)
    body = parse(NewOwner, await read_json(request), "owner")
    async with request.app[SESSIONS].begin() as session:
        owner, token = await create_owner(session, body.name, body.credits, time.time())
    return web.json_response({"id": owner.id, "name": owner.name, "token": token, "balance": body.credits},
                             status=201)


@routes.get("/v1/owners/me")
@describe(auth="owner")
async def whoami(request: web.Request) -> web.Response:
    """The calling owner's account and balance."""
    async with request.app[SESSIONS]() as session:
        owner = await current_owner(request, session)
        return web.json_response(await owner_json(session, owner))


@routes.post("/v1/owners/{owner_id}/credits")
@describe(auth="admin", body=CreditAdjustment)
async def adjust_credits(request: web.Request) -> web.Response:
    """Admin: grant (positive) or withdraw (negative) credits; an owner's balance never goes below zero."""
    require_admin(request)
    body = parse(CreditAdjustment, await read_json(request), "credit adjustment")
    now = time.time()
    async with request.app[SESSIONS].begin() as session:
        owner = await session.get(Owner, request.match_info["owner_id"])
        if owner is None:
            raise NotFound(f"no owner {request.match_info['owner_id']!r}", code="unknown_owner")
        account, amount = ledger.owner_account(owner.id), ledger.micro(body.amount)
        if amount < 0 and await ledger.balance(session, account) < -amount:
            raise Conflict("the adjustment would make the balance negative", code="insufficient_funds")
        if amount > 0:
            await ledger.transfer(session, ledger.MINT, account, amount, "adjust", now, memo=body.memo)
        else:
            await ledger.transfer(session, account, ledger.MINT, -amount, "adjust", now, memo=body.memo)
        return web.json_response(await owner_json(session, owner))


async def owner_json(session: AsyncSession, owner: Owner) -> dict:
    return {"id": owner.id, "name": owner.name, "created_at": owner.created_at,
            "balance": ledger.credits(await ledger.balance(session, ledger.owner_account(owner.id)))}


@routes.get("/v1/jobs/{job_id}/statement")
@describe(auth="owner")
async def job_statement(request: web.Request) -> web.Response:
    """The money side of a job: budget, escrow, payments per node, refund."""
    async with request.app[SESSIONS]() as session:
        job = await owned_job(request, session)
        return web.json_response(await ledger.job_statement(session, job))


@routes.get("/v1/nodes/{node_id}/statement")
async def node_statement(request: web.Request) -> web.Response:
    """Public, like an on-chain work log: what a node was credited and paid, job by job."""
    async with request.app[SESSIONS]() as session:
        node_id = request.match_info["node_id"]
        if await session.get(Node, node_id) is None:
            raise NotFound(f"node {node_id} is not registered", code="unknown_node")
        return web.json_response(await ledger.node_statement(session, node_id))


def setup_routes(app: web.Application) -> None:
    app.add_routes(routes)
