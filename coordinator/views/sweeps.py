"""Handlers of a job owner's sweep routes: submit, list, detail, cancel.

Owns POST/GET /v1/sweeps, GET /v1/sweeps/{sweep_id} and POST /v1/sweeps/{sweep_id}/cancel, each with the owner's
token. A sweep's trials are started and followed by the supervisor (coordinator/sweeps.py); each trial's job is an
ordinary job of the owner, read through the job routes.
"""

from __future__ import annotations

import logging
import re
import time

from aiohttp import web
from gpuswarm.coordinator import ledger, search, sweeps
from gpuswarm.coordinator.auth import current_owner
from gpuswarm.coordinator.config import SESSIONS
from gpuswarm.coordinator.db import Sweep, SweepTrial
from gpuswarm.coordinator.errors import Conflict, Forbidden, NotFound, PaymentRequired
from gpuswarm.coordinator.openapi import describe, respond
from gpuswarm.coordinator.requests import parse, read_json
from gpuswarm.coordinator.views.signals import wake
from gpuswarm.proto.sweeps import SWEEP_ID_PATTERN, SweepDetail, SweepList, SweepSpec, SweepState, SweepSummary
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

logger = logging.getLogger(__name__)
routes = web.RouteTableDef()


@routes.post("/v1/sweeps")
@describe(auth="owner", body=SweepSpec, response=SweepSummary, status=201)
async def submit_sweep(request: web.Request) -> web.Response:
    """Submit a sweep. Its first `parallel` trials start at once, so the owner's balance must cover their budgets
    (402 `insufficient_funds` otherwise); each later trial needs its budget when it starts."""
    spec = parse(SweepSpec, await read_json(request), "sweep spec")
    async with request.app[SESSIONS].begin() as session:
        owner = await current_owner(request, session)
        first = min(spec.parallel, spec.trials) * ledger.micro(spec.job.budget)
        available = await ledger.balance(session, ledger.owner_account(owner.id))
        if available < first:
            raise PaymentRequired(f"the first {min(spec.parallel, spec.trials)} trials need "
                                  f"{ledger.credits(first)} credits; your balance is {ledger.credits(available)}",
                                  code="insufficient_funds")
        sweep = sweeps.create(session, spec, owner.id, time.time())
    logger.info("sweep %s submitted: %d trials of %s, %s %s", sweep.id, spec.trials, spec.job.label,
                spec.direction, spec.metric)
    wake(request)  # the supervisor starts the first trials
    return respond(SweepSummary, summary_json(sweep, []), status=201)


@routes.get("/v1/sweeps")
@describe(auth="owner", response=SweepList)
async def list_sweeps(request: web.Request) -> web.Response:
    """The owner's sweeps, newest first."""
    async with request.app[SESSIONS]() as session:
        owner = await current_owner(request, session)
        rows = (await session.scalars(select(Sweep).where(Sweep.owner_id == owner.id)
                                      .order_by(Sweep.created_at.desc()))).all()
        trials = (await session.scalars(select(SweepTrial).where(SweepTrial.sweep_id.in_([s.id for s in rows]))
                                        .order_by(SweepTrial.number))).all()
    by_sweep: dict[str, list[SweepTrial]] = {}
    for t in trials:
        by_sweep.setdefault(t.sweep_id, []).append(t)
    return respond(SweepList, {"sweeps": [summary_json(s, by_sweep.get(s.id, [])) for s in rows]})


@routes.get("/v1/sweeps/{sweep_id}")
@describe(auth="owner", response=SweepDetail)
async def sweep_detail(request: web.Request) -> web.Response:
    """A sweep with every trial started so far (its values, state, final or last metric and curve) and the best."""
    async with request.app[SESSIONS]() as session:
        sweep = await owned_sweep(request, session)
        trials = await sweeps.trials_of(session, sweep.id)
    return respond(SweepDetail, detail_json(sweep, trials))


@routes.post("/v1/sweeps/{sweep_id}/cancel")
@describe(auth="owner", response=SweepSummary)
async def cancel_sweep(request: web.Request) -> web.Response:
    """Cancel a running sweep and its running trials' jobs (409 `sweep_final` when it already ended)."""
    async with request.app[SESSIONS].begin() as session:
        sweep = await owned_sweep(request, session, for_update=True)
        if sweep.state != SweepState.RUNNING.value:
            raise Conflict(f"sweep {sweep.id} is {sweep.state}", code="sweep_final")
        await sweeps.cancel(session, sweep, time.time())
        trials = await sweeps.trials_of(session, sweep.id)
    logger.info("sweep %s cancelled", sweep.id)
    return respond(SweepSummary, summary_json(sweep, trials))


async def owned_sweep(request: web.Request, session: AsyncSession, *, for_update: bool = False) -> Sweep:
    """The sweep named in the URL, if the request's owner token is its owner's (401/403/404 otherwise)."""
    owner = await current_owner(request, session)
    sweep_id = request.match_info["sweep_id"]
    sweep = (await session.get(Sweep, sweep_id, with_for_update=for_update)
             if re.fullmatch(SWEEP_ID_PATTERN, sweep_id) else None)
    if sweep is None:
        raise NotFound(f"no sweep {sweep_id!r}", code="unknown_sweep")
    if sweep.owner_id != owner.id:
        raise Forbidden(f"sweep {sweep.id} belongs to another owner", code="not_your_sweep")
    return sweep


def summary_json(sweep: Sweep, trials: list[SweepTrial]) -> dict:
    # From the stored spec as it is: it was valid at submit, and an answer must not depend on today's schemas.
    spec = sweep.spec
    best = search.best(spec["direction"], [sweeps.record(t) for t in trials])
    return {"id": sweep.id, "name": sweep.name, "state": sweep.state, "metric": spec["metric"],
            "direction": spec["direction"], "trials": spec["trials"],
            "trials_done": sum(t.state != "running" for t in trials),
            "best_value": best.value if best else None, "best_trial": best.number if best else None,
            "created_at": sweep.created_at, "finished_at": sweep.finished_at, "reason": sweep.reason}


def detail_json(sweep: Sweep, trials: list[SweepTrial]) -> dict:
    detail = summary_json(sweep, trials)
    detail["trials_planned"] = detail.pop("trials")
    best = next((t for t in trials if t.number == detail["best_trial"]), None)
    return detail | {
        "space": sweep.spec["space"], "sampler": sweep.spec["sampler"], "pruner": sweep.spec["pruner"],
        "trials": [{"number": t.number, "job_id": t.job_id, "state": t.state, "params": t.params, "value": t.value,
                    "pruned_at_step": t.pruned_at_step, "reason": t.reason,
                    "curve": sorted((int(s), v) for s, v in (t.intermediate or {}).items())} for t in trials],
        "best": None if best is None else {"number": best.number, "job_id": best.job_id, "value": best.value,
                                           "params": best.params}}
