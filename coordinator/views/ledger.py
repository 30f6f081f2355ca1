"""Handlers of the money routes: a member's round report, and the job and node statements.

Owns POST /v1/rounds (thin: authenticate the reporter, then `ledger.verify_claims` and `ledger.ingest_round` do
the work) and GET /v1/jobs/{job_id}/statement and /v1/nodes/{node_id}/statement (built by `ledger`).
"""

from __future__ import annotations

import time

from aiohttp import web
from gpuswarm.coordinator import jobs, ledger
from gpuswarm.coordinator.auth import authenticate_node, owned_job, read_signed
from gpuswarm.coordinator.config import SESSIONS
from gpuswarm.coordinator.db import Node
from gpuswarm.coordinator.errors import NotFound
from gpuswarm.coordinator.openapi import describe, respond
from gpuswarm.coordinator.views import shapes
from gpuswarm.proto import api
from gpuswarm.proto.models import RoundReport

routes = web.RouteTableDef()


@routes.post("/v1/rounds")
@describe(auth="node", body=RoundReport, signed="round_report", response=api.RoundAnswer, status=201)
async def report_round(request: web.Request) -> web.Response:
    """A member's report of one round: its group's signed claims. Claims by nodes that are not members of the
    job, or for another job, are ignored (a peer's bad gather data must not void an honest report); a claim that
    is not a valid signed claim rejects the whole report. Reporting the same round again changes nothing."""
    message = await read_signed(request, "round_report", RoundReport)
    now = time.time()
    claims = ledger.verify_claims(message.payload, now)
    async with request.app[SESSIONS].begin() as session:
        await authenticate_node(session, message)
        job = await jobs.get_job(session, message.payload.job_id)
        results, ignored = await ledger.ingest_round(session, job, message.payload, claims, now)
        body = shapes.round_json(results, ignored)
    return respond(api.RoundAnswer, body, status=201)


@routes.get("/v1/jobs/{job_id}/statement")
@describe(auth="owner", response=api.JobStatement)
async def job_statement(request: web.Request) -> web.Response:
    """The money side of a job: budget, escrow, payments per node, refund."""
    async with request.app[SESSIONS]() as session:
        job = await owned_job(request, session)
        return respond(api.JobStatement, await ledger.job_statement(session, job))


@routes.get("/v1/nodes/{node_id}/statement")
@describe(auth="anyone", response=api.NodeStatement)
async def node_statement(request: web.Request) -> web.Response:
    """Public, like an on-chain work log: what a node was credited and paid, job by job."""
    async with request.app[SESSIONS]() as session:
        node_id = request.match_info["node_id"]
        if await session.get(Node, node_id) is None:
            raise NotFound(f"node {node_id} is not registered", code="unknown_node")
        return respond(api.NodeStatement, await ledger.node_statement(session, node_id))
