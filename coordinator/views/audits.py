"""Handlers of refereed re-execution (the rules are `coordinator.audits`'): a node's evidence of an audited round,
its referee's download of it and verdict on it, and a job's audits for its owner.

Owns PUT and GET /v1/audits/{audit_id}/evidence, POST /v1/audits/{audit_id}/verdict and GET
/v1/jobs/{job_id}/audits. Nodes sign every call (the evidence's header binds its size and SHA-256, as an
artifact's does); only the audited node uploads, only the assigned referee reads and judges, each once.
"""

from __future__ import annotations

import time

from aiohttp import web
from gpuswarm.coordinator import audits, blobs
from gpuswarm.coordinator.auth import authenticate_node, owned_job, read_signed, verify_signed
from gpuswarm.coordinator.config import BLOB_LOCK, CONFIG, SESSIONS
from gpuswarm.coordinator.db import Audit
from gpuswarm.coordinator.errors import BadRequest, Conflict, Forbidden, NotFound, PayloadTooLarge
from gpuswarm.coordinator.openapi import describe, respond
from gpuswarm.coordinator.requests import envelope_header
from gpuswarm.coordinator.views import shapes
from gpuswarm.coordinator.views.blobs import receive, serve_blob
from gpuswarm.coordinator.views.signals import wake
from gpuswarm.proto import api
from gpuswarm.proto.audits import (
    EVIDENCE_KIND,
    FETCH_EVIDENCE_KIND,
    VERDICT_KIND,
    AuditVerdict,
    EvidenceFetch,
    EvidenceMeta,
)
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

routes = web.RouteTableDef()


async def _audit(session: AsyncSession, request: web.Request, audit_id: str, *, lock: bool = False) -> Audit:
    if audit_id != request.match_info["audit_id"]:
        raise BadRequest("the signed audit id does not match the URL")
    audit = await session.get(Audit, audit_id, with_for_update=lock)
    if audit is None:
        raise NotFound(f"no audit {audit_id}", code="unknown_audit")
    return audit


def _answer(audit: Audit, status: int = 200) -> web.Response:
    return respond(api.AuditAnswer, shapes.audit_answer_json(audit), status=status)


@routes.put("/v1/audits/{audit_id}/evidence")
@describe(auth="node", body=EvidenceMeta, signed=EVIDENCE_KIND, response=api.AuditAnswer, status=201)
async def upload_evidence(request: web.Request) -> web.Response:
    """The audited node's evidence of its round (a file from gpuswarm.node.evidence), once, while it is asked
    for; the signed header binds the bytes' size and SHA-256."""
    config = request.app[CONFIG]
    message = verify_signed(envelope_header(request), EVIDENCE_KIND, EvidenceMeta)
    meta = message.payload
    if meta.size > config.max_artifact_bytes:
        raise PayloadTooLarge(f"evidence is {meta.size} bytes; the limit is {config.max_artifact_bytes}")
    if request.content_length is not None and request.content_length != meta.size:
        raise BadRequest(f"body is {request.content_length} bytes but the signed size is {meta.size}")

    def check(audit: Audit) -> None:
        if audit.node_id != meta.node_id:
            raise Forbidden(f"audit {audit.id} is of another node's round", code="not_your_audit")
        if audit.state != "requested":
            raise Conflict(f"audit {audit.id} is {audit.state}; it takes no evidence", code="audit_state")

    async with request.app[SESSIONS]() as session:  # read-only checks before accepting the bytes
        await authenticate_node(session, message, record_nonce=False)
        check(await _audit(session, request, meta.audit_id))
    staged = await receive(request, meta.sha256, meta.size)
    try:
        async with request.app[BLOB_LOCK]:
            now = time.time()
            async with request.app[SESSIONS].begin() as session:
                await authenticate_node(session, message)
                audit = await _audit(session, request, meta.audit_id, lock=True)
                check(audit)
                await staged.commit()
                await blobs.record_blob(session, meta.sha256, meta.size, now)
                audit.evidence_sha256, audit.evidence_size, audit.state = meta.sha256, meta.size, "waiting"
    finally:
        await staged.discard()
    wake(request)
    return _answer(audit, 201)


@routes.get("/v1/audits/{audit_id}/evidence", allow_head=False)
@describe(auth="node", body=EvidenceFetch, signed=FETCH_EVIDENCE_KIND)
async def fetch_evidence(request: web.Request) -> web.StreamResponse:
    """The referee reads the evidence of the round it re-computes (the signed EvidenceFetch in the
    X-Gpuswarm-Envelope header)."""
    message = verify_signed(envelope_header(request), FETCH_EVIDENCE_KIND, EvidenceFetch)
    async with request.app[SESSIONS].begin() as session:
        await authenticate_node(session, message)
        audit = await _audit(session, request, message.payload.audit_id)
        if audit.referee_id != message.payload.node_id or audit.state != "assigned":
            raise Forbidden(f"node {message.payload.node_id} is not the referee of audit {audit.id}",
                            code="not_the_referee")
        sha256 = audit.evidence_sha256
        await blobs.touch(session, [sha256], time.time())
    return await serve_blob(request, sha256)


@routes.post("/v1/audits/{audit_id}/verdict")
@describe(auth="node", body=AuditVerdict, signed=VERDICT_KIND, response=api.AuditAnswer)
async def post_verdict(request: web.Request) -> web.Response:
    """The assigned referee's verdict on the round it re-computed; a failed one is a witness against the node."""
    message = await read_signed(request, VERDICT_KIND, AuditVerdict)
    verdict = message.payload
    async with request.app[SESSIONS].begin() as session:
        await authenticate_node(session, message)
        audit = await _audit(session, request, verdict.audit_id, lock=True)
        if audit.referee_id != verdict.node_id or audit.state != "assigned":
            raise Forbidden(f"node {verdict.node_id} is not the referee of audit {audit.id}",
                            code="not_the_referee")
        await audits.judge(session, audit, verdict, time.time())
    wake(request)
    return _answer(audit)


@routes.get("/v1/jobs/{job_id}/audits")
@describe(auth="owner", response=api.JobAudits)
async def job_audits(request: web.Request) -> web.Response:
    """The job's audits, newest first: whose round, its state, the referees that answered, and why one failed."""
    async with request.app[SESSIONS]() as session:
        job = await owned_job(request, session)
        rows = (await session.scalars(select(Audit).where(Audit.job_id == job.id)
                                      .order_by(Audit.requested_at.desc()).limit(1000))).all()
    return respond(api.JobAudits, shapes.audit_list_json(job, rows))
