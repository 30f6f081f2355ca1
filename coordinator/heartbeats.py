"""Node heartbeats, applied in batches (group commit), and the job/assignment transitions they can trigger.

Owns `HeartbeatBatcher`: handlers hand it verified heartbeats and await their result; one task applies everything
that queued up meanwhile in ONE transaction (one SELECT of the nodes, one of the nonces, one of the active
assignments, one commit), instead of one transaction per heartbeat. Each heartbeat still gets its own answer: an
unknown node, a wrong key, a revoked node or a replayed nonce refuses that heartbeat alone, before anything of it
is written: the same checks as every node request (`auth.node_refusal`), applied to the batch's rows. A failure of
the batch itself (the database) fails every heartbeat in it, and changes nothing.

Also owns `lose_assignments`, which going offline shares with the admin's revocation, and the job's progress
history (`JobProgress`): one point per global step, the first report that reached it, with the metrics the
workload's evaluate reported (the latest of which the job keeps too). A job that fails on node
failures moves through `jobs.apply`, like every job state change.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gpuswarm.coordinator import jobs, tasks
from gpuswarm.coordinator.auth import NodeMessage, node_refusal
from gpuswarm.coordinator.challenge_schedule import challenge_due
from gpuswarm.coordinator.config import CoordinatorConfig
from gpuswarm.coordinator.db import (
    AssignmentRow,
    Attestation,
    Contribution,
    Job,
    JobEvent,
    JobProgress,
    Node,
    SeenNonce,
)
from gpuswarm.coordinator.errors import ApiError
from gpuswarm.proto.models import PROGRESS_MARGIN, AssignmentState, Heartbeat, JobState, NodeState, Progress
from sqlalchemy import Update, bindparam, func, insert, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

if TYPE_CHECKING:
    from gpuswarm.coordinator.metrics import CoordinatorMetrics

logger = logging.getLogger(__name__)
MAX_BATCH = 512


@dataclass
class Outcome:
    """What one applied heartbeat tells its handler."""

    challenge: bool = False
    wake: bool = False  # failures or OFFLINE: the supervisor should run now
    membership_changed: bool = False  # a mesh node came or went: peer lists change


class HeartbeatBatcher:
    def __init__(self, sessions: async_sessionmaker[AsyncSession], config: CoordinatorConfig,
                 metrics: CoordinatorMetrics | None = None):
        self.sessions, self.config, self.metrics = sessions, config, metrics
        self._batches: tasks.Batches[NodeMessage[Heartbeat], Outcome] = tasks.Batches(
            self._apply, MAX_BATCH, "heartbeat-batcher")

    def start(self) -> None:
        self._batches.start()

    async def stop(self) -> None:
        await self._batches.stop()

    async def submit(self, message: NodeMessage[Heartbeat]) -> Outcome:
        """Apply a heartbeat whose signature `auth.read_signed` checked; raises its refusal (an ApiError)."""
        return await self._batches.submit(message)

    async def _apply(self, batch: list[NodeMessage[Heartbeat]]) -> list[Outcome | ApiError]:
        try:
            async with self.sessions.begin() as session:
                results = await apply_heartbeats(session, batch, self.config, time.time())
        except Exception:  # the database failed: every heartbeat of the batch gets the error
            logger.exception("applying %d heartbeat(s) failed", len(batch))
            if self.metrics is not None:
                self.metrics.heartbeat_batch(len(batch), 0, failed=True)
            raise
        if self.metrics is not None:
            self.metrics.heartbeat_batch(len(batch), sum(isinstance(r, ApiError) for r in results))
        return results


@dataclass(slots=True)
class _NodeRow:
    """The columns of a node that heartbeats read or write, and the names of those a heartbeat changed."""

    id: str
    public_key: str
    revoked: bool
    online: bool
    last_seen: float
    online_seconds: float
    state: str
    mesh_address: str | None
    next_challenge_at: float | None
    mesh_unreachable: list | None
    peer_rtt_ms: dict | None = None
    changed: set[str] = field(default_factory=set)


# The batch's statements, built once (building a statement costs more than running it from the compiled cache).
_NODES, _ASSIGNMENTS = Node.__table__, AssignmentRow.__table__
_SELECT_NODES = select(*(_NODES.c[name] for name in (
    "id", "public_key", "revoked", "online", "last_seen", "online_seconds", "state", "mesh_address",
    "next_challenge_at", "mesh_unreachable"))).where(_NODES.c.id.in_(bindparam("ids", expanding=True)))
_SELECT_SEEN = select(SeenNonce.__table__.c.nonce).where(
    SeenNonce.__table__.c.nonce.in_(bindparam("nonces", expanding=True)))
_SELECT_ACTIVE = select(_ASSIGNMENTS.c.id, _ASSIGNMENTS.c.node_id, _ASSIGNMENTS.c.job_id).where(
    _ASSIGNMENTS.c.node_id.in_(bindparam("ids", expanding=True)),
    _ASSIGNMENTS.c.state == AssignmentState.ACTIVE.value)
_INSERT_NONCES = insert(SeenNonce.__table__)
_UPDATE_NODES: dict[tuple[str, ...], Update] = {}  # by the columns it sets


async def apply_heartbeats(session: AsyncSession, items: list[NodeMessage[Heartbeat]],
                           config: CoordinatorConfig, now: float) -> list[Outcome | ApiError]:
    """Apply a batch of verified heartbeats in the caller's transaction; one result per heartbeat, in order.

    The per-heartbeat writes of every heartbeat (the node's columns, the nonce) are plain Core statements, one
    executemany each for the whole batch, and the reads are three column SELECTs: the ORM's unit of work cost more
    than all the rest of a heartbeat. Progress, failures and going offline, which few heartbeats carry, go through
    the ORM as every other job change does."""
    node_ids = list({m.node_id for m in items})
    nodes = {r[0]: _NodeRow(*r) for r in (await session.execute(_SELECT_NODES, {"ids": node_ids})).all()}
    seen = set((await session.scalars(_SELECT_SEEN, {"nonces": [m.envelope.nonce for m in items]})).all())
    active: dict[str, dict[str, int]] = {}  # node -> job -> its active assignment's id
    for assignment_id, node_id, job_id in (await session.execute(_SELECT_ACTIVE, {"ids": node_ids})).all():
        active.setdefault(node_id, {})[job_id] = assignment_id
    points: set[tuple[str, int]] = set()  # (job, step) known to have its point, so one batch looks each up once
    ceilings: dict[tuple[str, str], int] = {}  # (job, reporter): the highest step it may move to (`_step_ceiling`)
    results: list[Outcome | ApiError] = []
    fresh_nonces: list[dict] = []
    for message in items:
        node = nodes.get(message.node_id)
        if (refusal := node_refusal(message, node, nonce_seen=message.envelope.nonce in seen)) is not None:
            results.append(refusal)
        else:
            seen.add(message.envelope.nonce)
            fresh_nonces.append({"nonce": message.envelope.nonce, "expires_at": message.nonce_expires_at})
            results.append(await _apply_one(session, node, message.payload, active.setdefault(node.id, {}), config,
                                            now, points, ceilings))
    if fresh_nonces:
        await session.execute(_INSERT_NONCES, fresh_nonces)
    await _write_nodes(session, nodes.values())
    return results


async def _write_nodes(session: AsyncSession, nodes: Iterable[_NodeRow]) -> None:
    """One executemany per set of changed columns (usually one set: last_seen and online_seconds). Only changed
    columns are written, as the ORM would: a concurrent writer's change to another column stays."""
    by_columns: dict[tuple[str, ...], list[dict]] = {}
    for node in nodes:
        if node.changed:
            columns = tuple(sorted(node.changed))
            by_columns.setdefault(columns, []).append(
                {"node_id": node.id, **{f"new_{c}": getattr(node, c) for c in columns}})
    for columns, rows in by_columns.items():
        if (statement := _UPDATE_NODES.get(columns)) is None:
            statement = _UPDATE_NODES[columns] = update(_NODES).where(_NODES.c.id == bindparam("node_id")).values(
                {c: bindparam(f"new_{c}") for c in columns})
        await session.execute(statement, rows)


def _set(node: _NodeRow, column: str, value: object) -> None:
    if getattr(node, column) != value:
        setattr(node, column, value)
        node.changed.add(column)


async def _apply_one(session: AsyncSession, node: _NodeRow, hb: Heartbeat, active: dict[str, int],
                     config: CoordinatorConfig, now: float, points: set[tuple[str, int]],
                     ceilings: dict[str, int]) -> Outcome:
    was_online = node.online
    if was_online and now - node.last_seen <= config.node_timeout:
        _set(node, "online_seconds", node.online_seconds + now - node.last_seen)  # only gaps under the timeout
    if hb.peer_rtt_ms:
        node.peer_rtt_ms = dict(hb.peer_rtt_ms)
        node.changed.add("peer_rtt_ms")
    unreachable = sorted(set(hb.unreachable_peers) - {node.id}) or None
    relays_changed = unreachable != node.mesh_unreachable  # the leader's next tick plans relays again
    _set(node, "mesh_unreachable", unreachable)
    _set(node, "last_seen", now)
    _set(node, "state", hb.state.value)
    _set(node, "online", hb.state is not NodeState.OFFLINE)
    outcome = Outcome(membership_changed=node.mesh_address is not None and was_online != node.online,
                      wake=bool(hb.failures) or hb.state is NodeState.OFFLINE or relays_changed)
    for p in hb.progress:
        job = await session.get(Job, p.job_id) if p.job_id in active else None
        # Only a member of a running job moves its progress, never backwards, and never far past the epochs its
        # members' claims were attested for: a member cannot put the job at step 2**53 and freeze it there.
        if job is None or job.state != JobState.RUNNING.value:
            continue
        if job.global_step <= p.global_step <= await _step_ceiling(session, job, node.id, ceilings):
            advanced = p.global_step > job.global_step
            job.epoch, job.global_step, job.accuracy, job.loss = p.epoch, p.global_step, p.accuracy, p.loss
            job.samples_per_second, job.peers = p.samples_per_second, p.peers
            job.metrics = dict(p.metrics) or None
            await _record_point(session, job.id, p, now, advanced, points)
    for f in hb.failures:
        assignment_id = active.pop(f.job_id, None)  # pop: one failure per assignment, however often it is listed
        if assignment_id is None:
            continue
        assignment = await session.get(AssignmentRow, assignment_id)
        assignment.state, assignment.ended_at = AssignmentState.FAILED.value, now
        assignment.reason = f.reason[-2000:]
        job = await session.get(Job, f.job_id)
        job.failures += 1
        session.add(JobEvent(job_id=job.id, at=now, message=f"node {node.id} failed: {f.reason[-300:]}"))
        if job.failures >= config.max_job_failures and jobs.allows(job, jobs.Event.TOO_MANY_FAILURES):
            await jobs.apply(session, job, jobs.Event.TOO_MANY_FAILURES, now,
                             f"failed after {job.failures} node failures", error=f.reason[-2000:])
    outcome.challenge = hb.state is not NodeState.OFFLINE and challenge_due(node, now, busy=bool(active))
    if hb.state is NodeState.OFFLINE:
        await lose_assignments(session, node.id, now, "node went offline")
        active.clear()
    return outcome


async def _step_ceiling(session: AsyncSession, job: Job, node_id: str, ceilings: dict[tuple[str, str], int]) -> int:
    """The highest global step `node_id`'s progress report may move the job to: the latest epoch a member's claim
    was attested (or credited) for, or the job's own step, plus PROGRESS_MARGIN. While the reporter is the job's
    only member, its own solo round reports count too: the ledger credits those once hivemind's records show the
    epoch, records a lone member writes itself, so waiting for that credit gave it no more safety, only a lag (a
    lone sweep trial of one-batch sync steps ended with no point at all). Looked up once per job, reporter and
    batch."""
    key = (job.id, node_id)
    if key in ceilings:
        return ceilings[key]
    attested = await session.scalar(select(func.max(Contribution.epoch)).join(
        Attestation, Attestation.claim_id == Contribution.id).where(Contribution.job_id == job.id))
    credited = await session.scalar(select(func.max(Contribution.epoch)).where(
        Contribution.job_id == job.id, Contribution.status == "credited"))
    others = await session.scalar(select(func.count()).select_from(AssignmentRow).where(
        AssignmentRow.job_id == job.id, AssignmentRow.node_id != node_id,
        AssignmentRow.state == AssignmentState.ACTIVE.value))
    own = None if others else await session.scalar(select(func.max(Contribution.epoch)).where(
        Contribution.job_id == job.id, Contribution.node_id == node_id, Contribution.solo.is_(True),
        Contribution.status != "rejected"))
    ceilings[key] = max(job.global_step, attested or 0, credited or 0, own or 0) + PROGRESS_MARGIN
    return ceilings[key]


async def _record_point(session: AsyncSession, job_id: str, p: Progress, now: float, advanced: bool,
                        points: set[tuple[str, int]]) -> None:
    """Append the job's progress point for `p.global_step`, unless that step has one already.

    A report that moved the job's step forward is the first at its step. A report at the job's current step (other
    members report the same step every heartbeat) adds a point only if there is none: the job's first report, at
    step 0, or a job running since before the history existed."""
    key = (job_id, p.global_step)
    if key in points:
        return
    points.add(key)
    if not advanced and await session.scalar(select(JobProgress.id).where(
            JobProgress.job_id == job_id, JobProgress.global_step == p.global_step).limit(1)) is not None:
        return
    values = {"job_id": job_id, "at": now, "epoch": p.epoch, "global_step": p.global_step, "loss": p.loss,
              "accuracy": p.accuracy, "samples_per_second": p.samples_per_second, "peers": p.peers,
              "metrics": dict(p.metrics) or None}
    # Another coordinator on the same database may have written this step meanwhile: keep its point, and do not
    # fail the whole batch of heartbeats over it. (SQLite and PostgreSQL are the two supported databases.)
    dialect = postgresql if session.bind.dialect.name == "postgresql" else sqlite
    await session.execute(dialect.insert(JobProgress).values(values).on_conflict_do_nothing(
        index_elements=["job_id", "global_step"]))


async def lose_assignments(session: AsyncSession, node_id: str, now: float, reason: str) -> None:
    rows = (await session.scalars(select(AssignmentRow).where(
        AssignmentRow.node_id == node_id, AssignmentRow.state == AssignmentState.ACTIVE.value))).all()
    for a in rows:
        a.state, a.ended_at, a.reason = AssignmentState.LOST.value, now, reason
        session.add(JobEvent(job_id=a.job_id, at=now, message=f"node {node_id}: {reason}"))

