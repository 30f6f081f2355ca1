"""The job lifecycle: which events move a job between proto's `JobState`s, and the one place that writes them.

Owns `Job.state`, `Job.started_at` and `Job.finished_at`: every job state change in the coordinator goes through
`apply`, which asks the pure `next_state` first. An event the table below does not allow is refused with
`IllegalTransition` (HTTP 409) naming the job's state and the state the event leads to, and nothing is written.
`apply` also closes the job's active assignments when it ends and adds the `db.JobEvent` row (the line in the
job's history that the owner reads). It does not decide *when* an event happens: the supervisor's tick, the
heartbeats, the artifact upload, the round ingest and the owner's cancel do, and call `apply`. Also here: creating
a job (`create`, in the initial state), looking one up (`get_job`) and the membership check (`require_member`).

Transitions (every pair not listed is refused; the final states completed, failed and cancelled take no event):

    pending  --start-->             running     the tick matched it to nodes and reserved its budget
    pending  --cancel-->            cancelled   its owner cancelled it
    running  --final_model-->       completed   a member uploaded the final model
    running  --too_many_failures--> failed      node failures reached max_job_failures
    running  --budget_exhausted-->  failed      the escrow could not pay a credited claim
    running  --cancel-->            cancelled   its owner cancelled it

`started_at` is set when a job starts (once: nothing leads back to pending); `finished_at` when it reaches a final
state (once: final states take no event).
"""

from __future__ import annotations

import enum
import secrets
from dataclasses import dataclass

from gpuswarm.coordinator.db import AssignmentRow, Job, JobEvent
from gpuswarm.coordinator.errors import Conflict, Forbidden, NotFound
from gpuswarm.proto.models import AssignmentState, JobState, is_job_id
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

INITIAL = JobState.PENDING


class Event(enum.StrEnum):
    """What happened to a job (the `db.JobEvent` row is its line in the job's history, written by `apply`)."""

    START = "start"
    FINAL_MODEL = "final_model"
    TOO_MANY_FAILURES = "too_many_failures"
    BUDGET_EXHAUSTED = "budget_exhausted"
    CANCEL = "cancel"

    @property
    def verb(self) -> str:
        """How a refusal says it: "cannot <verb> a completed job"."""
        return _VERBS[self]


_VERBS = {Event.START: "start", Event.FINAL_MODEL: "complete", Event.TOO_MANY_FAILURES: "fail",
          Event.BUDGET_EXHAUSTED: "fail (budget exhausted)", Event.CANCEL: "cancel"}

TRANSITIONS: dict[tuple[JobState, Event], JobState] = {
    (JobState.PENDING, Event.START): JobState.RUNNING,
    (JobState.PENDING, Event.CANCEL): JobState.CANCELLED,
    (JobState.RUNNING, Event.FINAL_MODEL): JobState.COMPLETED,
    (JobState.RUNNING, Event.TOO_MANY_FAILURES): JobState.FAILED,
    (JobState.RUNNING, Event.BUDGET_EXHAUSTED): JobState.FAILED,
    (JobState.RUNNING, Event.CANCEL): JobState.CANCELLED,
}


def target(event: Event) -> JobState:
    """The state `event` leads to (each event has one, whatever state it is allowed from)."""
    return next(to for (_, e), to in TRANSITIONS.items() if e is event)


def sources(event: Event) -> list[JobState]:
    """The states `event` is allowed from, in JobState's order."""
    return [s for s in JobState if (s, event) in TRANSITIONS]


class IllegalTransition(Conflict):
    """An event the job's state does not allow (409). `job_final` when the job has ended, as before."""

    def __init__(self, job_id: str, current: JobState, event: Event):
        allowed = " or ".join(s.value for s in sources(event))
        super().__init__(f"job {job_id} is {current.value}; cannot {event.verb} a {current.value} job (only a "
                         f"{allowed} job can become {target(event).value})",
                         code="job_final" if current.is_final else "job_not_running")
        self.job_id, self.current, self.event = job_id, current, event


@dataclass(frozen=True)
class Refusal:
    """`next_state`'s answer when the transition is not allowed."""

    current: JobState
    event: Event

    def error(self, job_id: str) -> IllegalTransition:
        return IllegalTransition(job_id, self.current, self.event)


def next_state(current: JobState, event: Event) -> JobState | Refusal:
    """The state after `event`, or a Refusal: a pure function of the table in this module's docstring."""
    to = TRANSITIONS.get((current, event))
    return Refusal(current, event) if to is None else to


def allows(job: Job, event: Event) -> bool:
    """Whether `event` may happen to `job` now (for events the coordinator raises itself and may skip)."""
    return (JobState(job.state), event) in TRANSITIONS


def require(job: Job, event: Event) -> JobState:
    """The state `event` moves `job` to now, or IllegalTransition. `apply` checks this itself; call it alone ahead
    of work that cannot be rolled back with the transaction (a file moved into place)."""
    state = next_state(JobState(job.state), event)
    if isinstance(state, Refusal):
        raise state.error(job.id)
    return state


def enter(job: Job, state: JobState, now: float) -> None:
    """Write the state's columns on the row; `next_state` has allowed the move."""
    job.state = state.value
    if state is JobState.RUNNING:
        job.started_at = now
    if state.is_final:
        job.finished_at = now


async def apply(session: AsyncSession, job: Job, event: Event, now: float, message: str, *,
                error: str | None = None) -> JobState:
    """Move `job` on `event` inside the caller's transaction: its columns, its history line (`message`), and, when
    it ends, its active assignments (cancelled with it, or finished). Raises IllegalTransition (nothing written)."""
    state = require(job, event)
    enter(job, state, now)
    if error is not None:
        job.error = error
    if state.is_final:
        closing = AssignmentState.CANCELLED if state is JobState.CANCELLED else AssignmentState.FINISHED
        rows = (await session.scalars(select(AssignmentRow).where(
            AssignmentRow.job_id == job.id, AssignmentRow.state == AssignmentState.ACTIVE.value))).all()
        for a in rows:
            a.state, a.ended_at, a.reason = closing.value, now, message
    session.add(JobEvent(job_id=job.id, at=now, message=message))
    return state


def create(session: AsyncSession, *, name: str, spec: dict, owner_id: str, now: float, message: str) -> Job:
    """A new job in the initial state, with its first history line, added to the caller's transaction."""
    job = Job(id=f"j-{secrets.token_hex(6)}", name=name, spec=spec, state=INITIAL.value, created_at=now,
              owner_id=owner_id)
    session.add(job)
    session.add(JobEvent(job_id=job.id, at=now, message=message))
    return job


async def get_job(session: AsyncSession, job_id: str) -> Job:
    """The job with this id (404 `unknown_job` for an unknown or malformed id)."""
    job = await session.get(Job, job_id) if is_job_id(job_id) else None
    if job is None:
        raise NotFound(f"no job {job_id!r}", code="unknown_job")
    return job


async def require_member(session: AsyncSession, job: Job, node_id: str) -> None:
    """403 `not_a_member` unless the node was assigned to the job at some time (a past member may still report)."""
    member = await session.scalar(select(AssignmentRow.id).where(
        AssignmentRow.job_id == job.id, AssignmentRow.node_id == node_id).limit(1))
    if member is None:
        raise Forbidden(f"node {node_id} was never assigned to job {job.id}", code="not_a_member")
