"""The tick's matching step: the market read from the database, `matcher.match` run on it, and what it decided written.

`matcher` is the pure function; this module feeds it and applies its answer inside the tick's transaction (decision
0040): open jobs, active assignments and online nodes read as plain rows, resources and specs validated once per
JSON text, the node views and the pass built in a worker thread so the event loop keeps running, the matched jobs
and nodes checked again afterwards (`_still_open`), budgets reserved from one balance read per owner, and the
assignments and their history lines written in bulk.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging

from gpuswarm.coordinator import jobs, ledger, reputation
from gpuswarm.coordinator.config import CoordinatorConfig
from gpuswarm.coordinator.db import AssignmentRow, Job, JobEvent, Node, in_chunks
from gpuswarm.coordinator.matcher import JobView, Match, NodeView, match, wants_nodes
from gpuswarm.proto.models import AssignmentState, JobSpec, JobState, Resources
from sqlalchemy import Text, cast, insert, select
from sqlalchemy.ext.asyncio import AsyncSession

logger = logging.getLogger(__name__)
# Distinct node resources (and, apart, job specs) whose validated models the tick keeps, each about 2 KB: nodes of one
# hardware and settings share one text, so a swarm has far fewer than nodes; the bound holds memory to ~130 MB each.
PARSED_CACHE = 1 << 16
ROWS_PER_PART = 10_000  # online nodes fetched between two turns of the event loop
LOGGED_MATCHES = 20  # a tick's log line names this many of its new assignments (a cold start may make 40,000)
OPEN = [JobState.PENDING.value, JobState.RUNNING.value]


@functools.lru_cache(maxsize=PARSED_CACHE)
def _resources(text: str) -> Resources:
    return Resources.model_validate(json.loads(text))


@functools.lru_cache(maxsize=PARSED_CACHE)
def _spec(text: str) -> JobSpec:
    return JobSpec.model_validate(json.loads(text))


async def _node_rows(session: AsyncSession) -> list:
    """Every online node as a plain row (no ORM objects to build, track and expire), with its JSON columns as text
    for `_node_views` to decode off the event loop. Fetched in parts, so the loop runs between them."""
    rows: list = []
    result = await session.stream(select(
        Node.id, cast(Node.resources, Text), Node.price_per_gpu_hour, Node.last_seen, Node.verified,
        Node.measured_gflops, cast(Node.peer_rtt_ms, Text), Node.online_seconds, Node.registered_at,
        Node.challenges_passed, Node.challenges_failed,
    ).where(Node.online.is_(True), Node.revoked.is_(False)))
    async for part in result.partitions(ROWS_PER_PART):
        rows += part
    return rows


def _node_views(rows: list, history: dict[str, tuple[int, int, int]], in_use: dict[str, int],
                now: float) -> list[NodeView]:
    """The matcher's view of each of `_node_rows`. A node's resources are validated once per distinct JSON text
    (`_resources`): they change only when it re-registers."""
    scores = reputation.scores_of(rows, history, now)
    return [NodeView(node_id, _resources(resources), price, last_seen, gpus_in_use=in_use.get(node_id, 0),
                     verified=bool(verified), reputation=scores[node_id], throughput=gflops,
                     rtt_ms=(json.loads(rtt) if rtt else None) or {})
            for node_id, resources, price, last_seen, verified, gflops, rtt, *_ in rows]


def _views_and_match(rows: list, history: dict[str, tuple[int, int, int]], in_use: dict[str, int],
                     job_views: list[JobView], now: float, liveness: float) -> list[Match]:
    return match(job_views, _node_views(rows, history, in_use, now), now, liveness=liveness)


async def _still_open(session: AsyncSession, matches: list[Match]) -> dict[str, Job]:
    """The ORM rows of the matched jobs that may still take their matches, read again (and locked, on PostgreSQL)
    after the matcher's thread: other requests ran meanwhile. A job cancelled since, or one of whose new nodes went
    offline or was revoked since, is left out with all its matches this tick (so a pending job never starts below
    its min_nodes); its owner's balance is read again by the caller, so a withdrawal made meanwhile counts too."""
    live: set[str] = set()
    for ids in in_chunks(dict.fromkeys(m.node_id for m in matches)):
        live.update((await session.scalars(select(Node.id).where(
            Node.id.in_(ids), Node.online.is_(True), Node.revoked.is_(False)))).all())
    gone = {m.job_id for m in matches if m.node_id not in live}
    wanted = [job_id for job_id in dict.fromkeys(m.job_id for m in matches) if job_id not in gone]
    by_id: dict[str, Job] = {}
    for ids in in_chunks(wanted):
        by_id.update((j.id, j) for j in (await session.scalars(
            select(Job).where(Job.id.in_(ids), Job.state.in_(OPEN))
            .with_for_update().execution_options(populate_existing=True))).all())
    return by_id


async def assign(session: AsyncSession, config: CoordinatorConfig, now: float) -> list[Match]:
    """Match the open jobs to the online nodes inside the tick's transaction: start the pending jobs that get their
    nodes (budget reserved, through `jobs.apply`) and add the new assignments. Returns the assignments made."""
    open_jobs = (await session.execute(select(
        Job.id, cast(Job.spec, Text).label("spec"), Job.state, Job.created_at, Job.owner_id,
    ).where(Job.state.in_(OPEN)))).all()
    if not open_jobs:
        return []
    in_use: dict[str, int] = {}
    members: dict[str, set[str]] = {}
    shards: dict[str, set[int]] = {}
    for node_id, job_id, gpus, shard in await session.execute(
            select(AssignmentRow.node_id, AssignmentRow.job_id, AssignmentRow.gpus, AssignmentRow.shard_index)
            .where(AssignmentRow.state == AssignmentState.ACTIVE.value)):
        in_use[node_id] = in_use.get(node_id, 0) + gpus
        members.setdefault(job_id, set()).add(node_id)
        shards.setdefault(job_id, set()).add(shard)
    banned = await ledger.banned(session, [j.id for j in open_jobs])
    specs = {j.id: _spec(j.spec) for j in open_jobs}
    balances: dict[str, int] = {}  # each owner with a pending job (read again for `reserve_budget`)
    for j in open_jobs:
        if j.state == JobState.PENDING.value and j.owner_id not in balances:
            balances[j.owner_id] = await ledger.balance(session, ledger.owner_account(j.owner_id))
    job_views = [JobView(j.id, specs[j.id], JobState(j.state), j.created_at, members=frozenset(members.get(j.id, ())),
                         active_shards=frozenset(shards.get(j.id, ())), excluded=frozenset(banned.get(j.id, ())),
                         funded=j.state != JobState.PENDING.value
                         or balances[j.owner_id] >= ledger.micro(specs[j.id].budget))
                 for j in open_jobs]
    if not any(map(wants_nodes, job_views)):
        return []  # every open job has its nodes, or cannot pay: the node views would go unread
    rows, history = await _node_rows(session), await reputation.history(session)
    # Seconds of pure Python at 100,000 nodes: in a thread, the event loop still gets the GIL every switch interval
    # (5 ms) and answers what does not need this transaction's connection (all of it, on PostgreSQL) meanwhile.
    # `match` turns the cyclic garbage collector off for the whole process while it runs.
    matches = await asyncio.to_thread(_views_and_match, rows, history, in_use, job_views, now, config.node_timeout)
    by_id = await _still_open(session, matches)
    for owner_id in {j.owner_id for j in by_id.values() if j.state == JobState.PENDING.value}:
        balances[owner_id] = await ledger.balance(session, ledger.owner_account(owner_id))  # as of now
    taken = []
    for m in matches:
        if (job := by_id.get(m.job_id)) is None:
            continue
        if jobs.allows(job, jobs.Event.START):
            # Several pending jobs of one owner may look funded alone; the reservation is the real check.
            if not ledger.reserve_budget(session, job, specs[job.id], now, balances):
                continue
            await jobs.apply(session, job, jobs.Event.START, now, f"running; budget {specs[job.id].budget} reserved")
        taken.append(m)
    if taken:
        # Bulk inserts (one executemany each): added as ORM objects, each row was a statement of its own on SQLite,
        # which cannot return the ids of a multi-row INSERT in order.
        await session.execute(insert(AssignmentRow), [
            {"job_id": m.job_id, "node_id": m.node_id, "state": AssignmentState.ACTIVE.value,
             "shard_index": m.shard_index, "num_shards": m.num_shards, "created_at": now, "gpus": m.gpus,
             "price_per_gpu_hour": m.price_per_gpu_hour} for m in taken])
        await session.execute(insert(JobEvent), [
            {"job_id": m.job_id, "at": now, "message": f"assigned node {m.node_id} (shard {m.shard_index}, "
             f"{m.gpus} GPU(s) at {m.price_per_gpu_hour}/GPU-hour)"} for m in taken])
        shown = ", ".join(f"{m.node_id}->{m.job_id}" for m in taken[:LOGGED_MATCHES])
        logger.info("matched %s%s", shown, f" and {len(taken) - LOGGED_MATCHES} more" * (len(taken) > LOGGED_MATCHES))
    return taken
