"""Hyper-parameter sweeps: creating one, and the step that moves each running sweep on.

Owns the `db.Sweep` and `db.SweepTrial` rows. A trial is an ordinary job (`jobs.create`): the matcher gives it its
own nodes, it escrows its own budget when it starts and is settled and paid like any job, and its model downloads
like any job's. `advance` (called by the supervisor on the leading coordinator, every tick, before matching) reads
each running trial's new progress points into its curve (by epoch or global step), asks the pruner
(coordinator/search.py) whether it stops and cancels its job if so, records the trials whose jobs ended, and starts
new trials (values from the sampler) while fewer than `parallel` run and fewer than `trials` were started. A sweep
ends when all its trials have: completed with the best trial if one completed, failed otherwise.

Each sweep advances in its own transaction with its row locked, so a crash between two steps leaves either the
step or nothing (a trial's values depend only on the history and its number: asked again, they are the same).
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
from typing import Any

from gpuswarm.coordinator import blobs, jobs, ledger, search
from gpuswarm.coordinator.db import Job, JobProgress, Sweep, SweepTrial
from gpuswarm.coordinator.errors import ApiError
from gpuswarm.proto.models import JobSpec, JobState
from gpuswarm.proto.sweeps import SweepSpec, SweepState, TrialState
from pydantic import ValidationError
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

logger = logging.getLogger(__name__)
_JOB_ENDED = {JobState.COMPLETED: TrialState.COMPLETE, JobState.FAILED: TrialState.FAILED,
              JobState.CANCELLED: TrialState.CANCELLED}


def create(session: AsyncSession, spec: SweepSpec, owner_id: str, now: float) -> Sweep:
    """A new running sweep, added to the caller's transaction (its first trials start at the next `advance`)."""
    sweep = Sweep(id=f"s-{secrets.token_hex(6)}", owner_id=owner_id, name=spec.name,
                  spec=spec.model_dump(mode="json"), state=SweepState.RUNNING.value, created_at=now)
    session.add(sweep)
    return sweep


async def trials_of(session: AsyncSession, sweep_id: str) -> list[SweepTrial]:
    return list((await session.scalars(select(SweepTrial).where(SweepTrial.sweep_id == sweep_id)
                                       .order_by(SweepTrial.number))).all())


def record(trial: SweepTrial) -> search.TrialRecord:
    return search.TrialRecord(trial.number, TrialState(trial.state), trial.params,
                              {int(s): v for s, v in (trial.intermediate or {}).items()}, trial.value,
                              trial.system_attrs or {})


def metric_of(metrics: dict[str, Any] | None, metric: str, *, accuracy: float | None = None,
              loss: float | None = None) -> float | None:
    """The sweep's metric in a progress point or a final model's metrics (accuracy and loss have columns too)."""
    value = (metrics or {}).get(metric)
    if value is None:
        value = {"accuracy": accuracy, "loss": loss}.get(metric)
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


async def advance_all(sessions: async_sessionmaker[AsyncSession], blob_lock: asyncio.Lock, now: float) -> int:
    """Advance every running sweep; returns how many trial jobs were created (the caller matches them)."""
    async with sessions() as session:
        ids = (await session.scalars(select(Sweep.id).where(Sweep.state == SweepState.RUNNING.value))).all()
    created = 0
    for sweep_id in ids:
        try:
            # The blob lock before the transaction, as the routes take them: a trial's job references the
            # template's blobs, which the retention pass must not remove meanwhile.
            async with blob_lock, sessions.begin() as session:
                sweep = await session.get(Sweep, sweep_id, with_for_update=True)
                if sweep is not None and sweep.state == SweepState.RUNNING.value:
                    created += await advance(session, sweep, now)
        except Exception:  # one sweep's failure must not stop the others, nor the supervisor
            logger.exception("sweep %s: advancing it failed; retrying at the next tick", sweep_id)
    return created


async def advance(session: AsyncSession, sweep: Sweep, now: float) -> int:
    """One step of `sweep` (see the module's docstring), under the blob lock. Returns the number of trial jobs it
    created."""
    try:
        spec = SweepSpec.model_validate(sweep.spec)
    except ValidationError as e:  # valid at submit; a later version's schemas refuse it
        _end(sweep, SweepState.FAILED, now, f"its spec no longer validates: {e}"[:2000])
        return 0
    trials = await trials_of(session, sweep.id)
    for trial in trials:
        if trial.state == TrialState.RUNNING.value:
            await _follow(session, sweep, spec, trial, trials, now)
    created = 0
    while (sum(t.state == TrialState.RUNNING.value for t in trials) < spec.parallel
           and len(trials) < spec.trials):
        trial = await _start_trial(session, sweep, spec, trials, now)
        if trial is None:
            break
        trials.append(trial)
        if trial.job_id is None:
            break  # it could not run: one such trial a tick, so a spec no trial can run fails slowly, not in a burst
        created += 1
    if len(trials) >= spec.trials and all(t.state != TrialState.RUNNING.value for t in trials):
        _finish(sweep, spec, trials, now, None)
    return created


def _finish(sweep: Sweep, spec: SweepSpec, trials: list[SweepTrial], now: float, reason: str | None) -> None:
    """End the sweep: completed when a trial completed with the metric, failed otherwise."""
    done = search.best(spec.direction, [record(t) for t in trials]) is not None
    _end(sweep, SweepState.COMPLETED if done else SweepState.FAILED, now,
         reason or (None if done else "no trial completed with the metric"))


async def _follow(session: AsyncSession, sweep: Sweep, spec: SweepSpec, trial: SweepTrial,
                  trials: list[SweepTrial], now: float) -> None:
    """Read the trial's new progress points; record its end if its job ended, else ask the pruner."""
    job = await session.get(Job, trial.job_id, with_for_update=True)  # a final-model upload must not race a prune
    curve = dict(trial.intermediate or {})
    points = (await session.scalars(select(JobProgress).where(JobProgress.job_id == job.id,
                                                              JobProgress.global_step > trial.last_step)
                                    .order_by(JobProgress.global_step))).all()
    fresh = False
    for p in points:
        value = metric_of(p.metrics, spec.metric, accuracy=p.accuracy, loss=p.loss)
        if value is not None:  # an epoch's first point stands for it: after that many epochs, as a rung means
            curve.setdefault(str(int(p.epoch) if spec.pruner.unit == "epoch" else p.global_step), value)
            fresh = True
        trial.last_step = p.global_step
    trial.intermediate = curve
    if JobState(job.state).is_final:
        _ended(trial, job, spec.metric, now)
        logger.info("sweep %s: trial %d %s (%s %s)", sweep.id, trial.number, trial.state, spec.metric, trial.value)
        return
    if not fresh:
        return
    pruned, trial.system_attrs = search.should_prune(spec, [record(t) for t in trials], trial.number)
    if pruned:
        step = max(int(s) for s in curve)
        trial.state, trial.finished_at = TrialState.PRUNED.value, now
        trial.value, trial.pruned_at_step = curve[str(step)], step
        trial.reason = (f"pruned at {spec.pruner.unit} {step} ({spec.pruner.kind}): {spec.metric} "
                        f"{curve[str(step)]:.4g}")
        await jobs.apply(session, job, jobs.Event.CANCEL, now, f"stopped by sweep {sweep.id}: {trial.reason}")
        logger.info("sweep %s: trial %d %s", sweep.id, trial.number, trial.reason)


def _ended(trial: SweepTrial, job: Job, metric: str, now: float) -> None:
    """Record the end of the trial's job: a completed one's final metric (else its last reported), or why not."""
    state = JobState(job.state)
    trial.state, trial.finished_at = _JOB_ENDED[state].value, now
    if state == JobState.COMPLETED:
        curve = trial.intermediate or {}
        final = metric_of(job.final_metrics, metric, accuracy=job.final_accuracy)
        trial.value = final if final is not None else (curve[max(curve, key=int)] if curve else None)
    else:
        trial.reason = job.error or f"its job was {state.value}"


async def _start_trial(session: AsyncSession, sweep: Sweep, spec: SweepSpec, trials: list[SweepTrial],
                       now: float) -> SweepTrial | None:
    """The next trial and its job; a trial that cannot run (its values fail the job's checks) is recorded failed.
    None: the owner's balance cannot cover the trial's budget now (a running trial's refund may, later), or never
    (nothing runs: the sweep ends)."""
    number = len(trials)
    available = await ledger.balance(session, ledger.owner_account(sweep.owner_id))
    if available < ledger.micro(spec.job.budget):
        if not any(t.state == TrialState.RUNNING.value for t in trials):
            _finish(sweep, spec, trials, now, f"stopped after {number} trials: the balance "
                    f"{ledger.credits(available)} cannot cover a trial's budget {spec.job.budget}")
        return None
    params = search.suggest(spec, [record(t) for t in trials], number)
    trial = SweepTrial(sweep_id=sweep.id, number=number, state=TrialState.RUNNING.value, params=params,
                       intermediate={}, system_attrs={}, last_step=-1, created_at=now)
    session.add(trial)
    table = spec.job.model_dump(mode="json")
    table["hyperparameters"] = table["hyperparameters"] | params
    table["name"] = f"{sweep.name or sweep.id} trial {number}"[:128]
    try:
        job_spec = JobSpec.model_validate(table)
        async with session.begin_nested():
            job = jobs.create(session, name=job_spec.name, spec=job_spec.model_dump(mode="json"),
                              owner_id=sweep.owner_id, now=now, message=f"trial {number} of sweep {sweep.id}: {params}")
            await session.flush()
            await blobs.reference(session, job, job_spec, now)
    except (ValueError, ApiError) as e:  # ValidationError is a ValueError
        trial.state, trial.finished_at, trial.reason = TrialState.FAILED.value, now, f"cannot run: {e}"[:2000]
        logger.warning("sweep %s: trial %d cannot run: %s", sweep.id, number, e)
        return trial
    trial.job_id = job.id
    logger.info("sweep %s: trial %d started as job %s with %s", sweep.id, number, job.id, params)
    return trial


def _end(sweep: Sweep, state: SweepState, now: float, reason: str | None) -> None:
    sweep.state, sweep.finished_at, sweep.reason = state.value, now, reason
    logger.info("sweep %s %s%s", sweep.id, state.value, f": {reason}" if reason else "")


async def cancel(session: AsyncSession, sweep: Sweep, now: float) -> None:
    """Cancel the sweep and the jobs of its running trials (a trial whose job ended meanwhile is recorded as it
    ended: a completed one stays, with its model)."""
    for trial in await trials_of(session, sweep.id):
        if trial.state != TrialState.RUNNING.value:
            continue
        job = await session.get(Job, trial.job_id, with_for_update=True)
        if JobState(job.state).is_final:
            _ended(trial, job, sweep.spec["metric"], now)
            continue
        await jobs.apply(session, job, jobs.Event.CANCEL, now, f"cancelled with sweep {sweep.id}")
        trial.state, trial.finished_at, trial.reason = TrialState.CANCELLED.value, now, "cancelled with the sweep"
    _end(sweep, SweepState.CANCELLED, now, "cancelled by its owner")
