"""Refereed re-execution, the coordinator's half: which credited rounds are audited, who referees them, and what
a verdict does (docs/security.md, decision 0030). The node's half is gpuswarm.node.evidence.

Owns the `audits` rows. An audit goes
  requested  (the node must upload the round's evidence within EVIDENCE_TIMEOUT, else: unanswered)
  waiting    (evidence in; a referee is wanted)
  assigned   (a referee re-computes the round within VERDICT_TIMEOUT, else waiting again without it)
  passed | failed | unanswered | void (no referee could take it, or its node is banned from the job already).
A passed verdict closes it. A failed one is a witness against the node (`ledger.witness`); once CONVICTION
distinct referees failed its rounds (this one's or others'), the audit closes as failed: the node is banned from
the job and has forfeited what the job paid it, and its round-mates' claims of that epoch are audited too (a
partner in a collusion has to show its own evidence). An unanswered audit forfeits the job's pay: evidence is kept
on the node's disk for its last rounds, so an honest node that is online can always answer.

A referee is never the audited node nor its round-mates, and no member of the job for as long as the audit may
wait for another node (`MEMBER_REFEREE_AFTER`). Pure decisions (`drawn`, `can_referee`, `pick_referee`) are keyed
by the authority's secret, so a node can neither predict which of its rounds are checked nor steer which node
referees it.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Iterable

from gpuswarm.coordinator import ledger
from gpuswarm.coordinator.db import AssignmentRow, Attestation, Audit, Contribution, Job, JobEvent, Node
from gpuswarm.coordinator.matcher import meets_requirements
from gpuswarm.proto.audits import AuditRequest, AuditVerdict, RefereeTask
from gpuswarm.proto.models import AssignmentState, JobSpec, Resources
from pydantic import ValidationError
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

AUDITED_MODES = ("diloco", "fedavg")  # rounds of local steps, which a node keeps evidence of
AUDIT_WINDOW = 120.0  # seconds after its report a credited claim can be drawn (its evidence is on disk by then)
EVIDENCE_TIMEOUT = 300.0  # seconds a node has to upload a round's evidence
VERDICT_TIMEOUT = 300.0  # seconds a referee has to re-compute a round
AUDIT_LIFETIME = 3600.0  # an audit no referee could take for this long is void
# Seconds an audit waits for a referee outside its job before the job's own members may take it. A member's
# re-computation takes the compute the job is paying for, and every round waits for its slowest member: in a 4-node
# tinylm run one member refereed another's round for 2 minutes, its trainer fell to a fifth of its CPU, and the
# next two rounds waited 44 s and 20 s for it. Long jobs with no node outside them are still audited.
MEMBER_REFEREE_AFTER = 600.0
MAX_REFEREE_TRIES = 4  # referees that let their deadline pass before an audit is void
CONVICTION = ledger.BAN_QUORUM  # distinct referees whose verdicts on a node's rounds failed: it is banned


def drawn(key: bytes, signature: str, rate: float) -> bool:
    """Is the claim with this signature audited? A keyed hash of the signature read as a number in [0, 1), under
    `rate`: the same answer however often it is asked, and no node can tell which of its claims will be."""
    if rate <= 0:
        return False
    digest = hmac.new(key, signature.encode(), hashlib.sha256).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < rate


def can_referee(resources: Resources, spec: JobSpec) -> bool:
    """Can a node with `resources` re-compute a round of the job: its code (owners' code needs the opt-in) on the
    hardware the job asks for? (Price and verification do not matter: a referee is not paid by the job.)"""
    if spec.custom_code and not resources.custom_code:
        return False
    return meets_requirements(resources, spec.requirements, spec.gpus_per_node)


def pick_referee(candidates: Iterable[str], excluded: set[str], key: bytes, draw: str) -> str | None:
    """The referee for `draw` (an audit and its attempt) among `candidates` not `excluded`: the highest keyed hash
    (rendezvous hashing), so no node can make itself or a friend the one chosen."""
    eligible = set(candidates) - excluded
    if not eligible:
        return None
    return max(sorted(eligible), key=lambda n: hmac.new(key, f"{draw}:{n}".encode(), hashlib.sha256).digest())


async def advance_all(sessions: async_sessionmaker[AsyncSession], key: bytes, rate: float, now: float) -> None:
    """One pass: draw newly credited claims, expire what is overdue, find referees for what waits."""
    async with sessions.begin() as session:
        await draw(session, key, rate, now)
        await expire(session, now)
        await assign(session, key, now)


async def draw(session: AsyncSession, key: bytes, rate: float, now: float) -> list[Audit]:
    """Open audits for the credited claims of the last AUDIT_WINDOW seconds that the draw picks (rounds with a
    group, in jobs whose rounds a third node can re-compute: local steps, data it can fetch)."""
    if rate <= 0:
        return []
    rows = (await session.execute(
        select(Contribution, Job).join(Job, Job.id == Contribution.job_id)
        .outerjoin(Audit, Audit.claim_id == Contribution.id)
        .where(Contribution.status == "credited", Contribution.solo.is_(False),
               Contribution.received_at >= now - AUDIT_WINDOW, Audit.id.is_(None)))).all()
    banned = await ledger.banned(session, list({job.id for _, job in rows}))
    auditable: dict[str, bool] = {}
    opened = []
    for claim, job in rows:
        if claim.node_id in banned.get(job.id, set()):
            continue
        if job.id not in auditable:
            spec = JobSpec.model_validate(job.spec)
            auditable[job.id] = spec.training.mode in AUDITED_MODES and spec.local_dataset is None
        if auditable[job.id] and drawn(key, claim.signature, rate):
            opened.append(open_audit(session, claim, now))
    return opened


def open_audit(session: AsyncSession, claim: Contribution, now: float) -> Audit:
    audit = Audit(id=f"a-{secrets.token_hex(6)}", job_id=claim.job_id, node_id=claim.node_id, epoch=claim.epoch,
                  claim_id=claim.id, state="requested", referees=[], excluded=[], failures=0, reason="",
                  requested_at=now, deadline=now + EVIDENCE_TIMEOUT)
    session.add(audit)
    return audit


async def expire(session: AsyncSession, now: float) -> None:
    """Overdue evidence makes an audit unanswered (the node forfeits the job); an overdue verdict puts it back
    to waiting without that referee; an audit nobody could referee for AUDIT_LIFETIME is void."""
    overdue = (await session.scalars(select(Audit).where(
        (Audit.state.in_(("requested", "assigned")) & (Audit.deadline < now))
        | ((Audit.state == "waiting") & (Audit.requested_at < now - AUDIT_LIFETIME))))).all()
    for audit in overdue:
        if audit.state == "requested":
            audit.state, audit.reason = "unanswered", f"no evidence within {EVIDENCE_TIMEOUT:.0f}s"
            job = await session.get(Job, audit.job_id)
            events = await ledger.forfeit(session, job, audit.node_id, f"forfeited: showed no evidence of its round "
                                                                      f"{audit.epoch} when audited", now)
            _log(session, audit.job_id, now, *events)
        elif audit.state == "assigned":
            audit.excluded = [*audit.excluded, audit.referee_id]
            audit.state, audit.referee_id = "waiting", None
            if len(audit.excluded) >= MAX_REFEREE_TRIES:
                audit.state, audit.reason = "void", f"{MAX_REFEREE_TRIES} referees gave no verdict in time"
        else:
            audit.state, audit.reason = "void", "no node could referee it"


async def round_mates(session: AsyncSession, audit: Audit) -> set[str]:
    """The nodes in the audited round's group: those that reported its claim, and those whose claims for that
    epoch of the job the audited node reported."""
    attesters = set((await session.scalars(select(Attestation.attester).where(
        Attestation.claim_id == audit.claim_id))).all())
    vouched = set((await session.scalars(
        select(Contribution.node_id).join(Attestation, Attestation.claim_id == Contribution.id)
        .where(Contribution.job_id == audit.job_id, Contribution.epoch == audit.epoch,
               Attestation.attester == audit.node_id))).all())
    return attesters | vouched


async def assign(session: AsyncSession, key: bytes, now: float) -> None:
    """Give waiting audits referees, those waiting for a second opinion first, then the oldest: an online node that
    can run the job, was neither in the round, nor banned from the job, nor asked before for this audit, never
    failed an audit itself, is not re-computing another round (one at a time: a referee is a node doing its
    own work too), and is not training the job, unless the audit has waited MEMBER_REFEREE_AFTER for anyone else."""
    waiting = (await session.scalars(select(Audit).where(Audit.state == "waiting")
                                     .order_by(Audit.failures.desc(), Audit.requested_at))).all()
    if not waiting:
        return
    resources: dict[str, Resources] = {}
    for node in (await session.scalars(select(Node).where(Node.online.is_(True), Node.revoked.is_(False)))).all():
        try:
            resources[node.id] = Resources.model_validate(node.resources)
        except ValidationError:
            continue
    busy = set((await session.scalars(select(Audit.referee_id).where(Audit.state == "assigned"))).all())
    banned = await ledger.banned(session, list({a.job_id for a in waiting}))
    convicted = set((await session.scalars(select(Audit.node_id).where(Audit.state == "failed"))).all())
    candidates: dict[str, list[str]] = {}  # by job: the online nodes that can run it
    members: dict[str, set[str]] = {}  # by job: the nodes training it now
    for audit in waiting:
        if audit.node_id in banned.get(audit.job_id, set()):  # convicted already: nothing more to learn
            audit.state, audit.reason = ("failed", audit.reason) if audit.failures else (
                "void", "the node is banned from the job already")
            continue
        if not resources.keys() - busy - convicted:
            continue  # every possible referee is busy: the audits wait for the next tick
        if audit.job_id not in candidates:
            spec = JobSpec.model_validate((await session.get(Job, audit.job_id)).spec)
            candidates[audit.job_id] = [n for n, r in resources.items() if can_referee(r, spec)]
            members[audit.job_id] = set((await session.scalars(select(AssignmentRow.node_id).where(
                AssignmentRow.job_id == audit.job_id, AssignmentRow.state == AssignmentState.ACTIVE.value))).all())
        excluded = ({audit.node_id} | await round_mates(session, audit) | banned.get(audit.job_id, set())
                    | set(audit.excluded) | set(audit.referees) | busy | convicted)
        if now - audit.requested_at < MEMBER_REFEREE_AFTER:
            excluded |= members[audit.job_id]
        referee = pick_referee(candidates[audit.job_id], excluded, key,
                               f"{audit.id}:{len(audit.referees) + len(audit.excluded)}")
        if referee is not None:
            audit.state, audit.referee_id, audit.deadline = "assigned", referee, now + VERDICT_TIMEOUT
            busy.add(referee)


async def requests_for(session: AsyncSession, node_id: str) -> list[AuditRequest]:
    """The audits of this node's rounds waiting for its evidence."""
    rows = (await session.scalars(select(Audit).where(Audit.node_id == node_id, Audit.state == "requested"))).all()
    return [AuditRequest(audit_id=a.id, job_id=a.job_id, epoch=a.epoch) for a in rows]


async def tasks_for(session: AsyncSession, node_id: str) -> list[RefereeTask]:
    """The rounds this node is to re-compute."""
    rows = (await session.execute(select(Audit, Job).join(Job, Job.id == Audit.job_id).where(
        Audit.referee_id == node_id, Audit.state == "assigned"))).all()
    return [RefereeTask(audit_id=a.id, job_id=a.job_id, node_id=a.node_id, epoch=a.epoch,
                        spec=JobSpec.model_validate(j.spec), evidence_sha256=a.evidence_sha256,
                        evidence_size=a.evidence_size) for a, j in rows]


async def judge(session: AsyncSession, audit: Audit, verdict: AuditVerdict, now: float) -> list[str]:
    """Apply a referee's verdict (the route checked it is the assigned referee's). Returns ledger events."""
    audit.referees = [*audit.referees, verdict.node_id]
    audit.distance, audit.referee_id = verdict.distance, None
    who = f"node {audit.node_id}'s round {audit.epoch}"
    if verdict.passed:
        audit.state, audit.reason = "passed", ""
        events = [f"audit of {who}: re-computed by node {verdict.node_id}, passed"]
    else:
        audit.failures += 1
        audit.reason = verdict.reason
        job = await session.get(Job, audit.job_id)
        events = [f"audit of {who}: re-computed by node {verdict.node_id}, FAILED: {verdict.reason}"]
        events += await ledger.witness(session, job, audit.node_id, verdict.node_id, audit.epoch, now,
                                       f"banned: {CONVICTION} referees' re-computations of its rounds failed")
        if audit.node_id in (await ledger.banned(session, [job.id])).get(job.id, set()):
            audit.state = "failed"  # this verdict was the second witness, on this audit or another of the node's
            for claim in (await session.scalars(
                    select(Contribution).outerjoin(Audit, Audit.claim_id == Contribution.id).where(
                        Contribution.job_id == audit.job_id, Contribution.epoch == audit.epoch,
                        Contribution.node_id.in_(await round_mates(session, audit)), Audit.id.is_(None)))).all():
                open_audit(session, claim, now)
        else:
            audit.state = "waiting"  # another referee must confirm before it counts as failed
    _log(session, audit.job_id, now, *events)
    return events


def _log(session: AsyncSession, job_id: str, now: float, *events: str) -> None:
    for message in dict.fromkeys(events):
        session.add(JobEvent(job_id=job_id, at=now, message=message))
