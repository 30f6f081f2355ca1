"""Handlers of a job owner's job routes: submit, list, detail, contributions, progress, cancel.

Owns POST/GET /v1/jobs, GET /v1/jobs/{job_id}, .../contributions, .../progress and POST .../cancel. Each needs
the owner's token (`auth.current_owner`, `auth.owned_job`). Job states change only through `jobs`; a submitted
job's code and dataset are recorded as its blobs (`blobs.reference`), which its owner must hold.
"""

from __future__ import annotations

import contextlib
import logging
import time

from aiohttp import web
from gpuswarm.coordinator import blobs, jobs, ledger, tensorboard
from gpuswarm.coordinator.auth import current_owner, owned_job, owner_of
from gpuswarm.coordinator.config import BLOB_LOCK, SESSIONS
from gpuswarm.coordinator.db import Artifact, AssignmentRow, Job, JobEvent, JobProgress
from gpuswarm.coordinator.errors import BadRequest, PaymentRequired
from gpuswarm.coordinator.openapi import describe, respond
from gpuswarm.coordinator.requests import parse, read_json, step_query
from gpuswarm.coordinator.views import shapes
from gpuswarm.coordinator.views.signals import wake
from gpuswarm.proto import api
from gpuswarm.proto.models import AssignmentState, JobSpec, JobState
from sqlalchemy import func, select

logger = logging.getLogger(__name__)
routes = web.RouteTableDef()
MAX_PROGRESS_POINTS = 5000  # per response of GET /v1/jobs/{id}/progress: the oldest, when a job has more


@routes.post("/v1/jobs")
@describe(auth="owner", body=JobSpec, response=api.JobInfo, status=201)
async def submit_job(request: web.Request) -> web.Response:
    """Submit a job (the budget must not exceed the owner's balance). A job with its own `code` (and `dataset`)
    names blobs the owner uploaded first (PUT /v1/blobs/{sha256}); 409 `blob_not_held` otherwise."""
    owner = await owner_of(request)
    spec = parse(JobSpec, await read_json(request), "job spec")
    now = time.time()
    # Under the store's lock when the job names blobs: the retention pass cannot remove one between the check and
    # the reference.
    async with (request.app[BLOB_LOCK] if spec.blob_refs() else contextlib.nullcontext()), \
            request.app[SESSIONS].begin() as session:
        available = await ledger.balance(session, ledger.owner_account(owner.id))
        if available < ledger.micro(spec.budget):
            raise PaymentRequired(f"the budget {spec.budget} is more than your balance "
                                  f"{ledger.credits(available)}", code="insufficient_funds")
        job = jobs.create(session, name=spec.name, spec=spec.model_dump(mode="json"), owner_id=owner.id, now=now,
                          message=f"submitted ({spec.label}, {spec.min_nodes}-{spec.max_nodes} nodes)")
        await session.flush()  # the job's row first: its blob references point at it
        await blobs.reference(session, job, spec, now)  # 409 unless the owner holds the code and dataset
    logger.info("job %s submitted (%s)", job.id, spec.label)
    wake(request)
    return respond(api.JobInfo, shapes.job_json(job), status=201)


@routes.get("/v1/jobs")
@describe(auth="owner", response=api.JobList)
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
        rows = (await session.scalars(query)).all()
        counts = dict((await session.execute(select(AssignmentRow.job_id, func.count()).where(
            AssignmentRow.state == AssignmentState.ACTIVE.value).group_by(AssignmentRow.job_id))).all())
    return respond(api.JobList, shapes.job_list_json(rows, counts))


@routes.get("/v1/jobs/{job_id}")
@describe(auth="owner", response=api.JobDetail)
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
    return respond(api.JobDetail, shapes.job_detail_json(job, assignments, artifacts, contributions, events))


@routes.get("/v1/jobs/{job_id}/contributions")
@describe(auth="owner", response=api.JobContributions)
async def job_contributions(request: web.Request) -> web.Response:
    """Per node: claimed, credited and paid."""
    async with request.app[SESSIONS]() as session:
        job = await owned_job(request, session)
        contributions = await ledger.contributions(session, job.id)
    return respond(api.JobContributions, shapes.contributions_json(job, contributions))


@routes.get("/v1/jobs/{job_id}/progress")
@describe(auth="owner", response=api.ProgressCurve)
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
    points = [tensorboard.Point(*row) for row in rows[:MAX_PROGRESS_POINTS]]
    return respond(api.ProgressCurve, shapes.progress_json(job, points, len(rows) > MAX_PROGRESS_POINTS))


@routes.post("/v1/jobs/{job_id}/cancel")
@describe(auth="owner", response=api.JobInfo)
async def cancel_job(request: web.Request) -> web.Response:
    """Cancel a pending or running job."""
    now = time.time()
    async with request.app[SESSIONS].begin() as session:
        job = await owned_job(request, session)
        await jobs.apply(session, job, jobs.Event.CANCEL, now, "cancelled by its owner")
    logger.info("job %s cancelled", job.id)
    return respond(api.JobInfo, shapes.job_json(job))
