"""The money side: accounts, escrow, the round ingest, crediting peer-attested claims, paying nodes, statements.

Owns the double-entry ledger (`db.LedgerEntry`, integer micro-credits), the escrow rule, the credit rule, and the
round ingest (`verify_claims`, then `ingest_round`: the claim rows `db.Contribution`, their attestations, crediting
and paying what can be, and failing the job through `jobs.apply` when its budget runs out). It does not know
HTTP (claims are validated with `requests.parse`; refusals are `errors.ApiError`s); the views call it inside their
transaction, after authenticating the reporting node.

Escrow: a job's budget moves from its owner to `escrow:JOB` when the job starts. Each credited claim pays its
node `credited hours x GPUs x the assignment's clearing price` (the node's ask: a pay-as-bid reverse
auction) out of that escrow. When the escrow cannot pay, the job ends ("budget exhausted"). Once a job has ended
and its last reports had time to arrive (`settle_grace`), claims nobody attested are rejected (unpaid, not
flagged: a round that failed mid-way leaves honest claims unattested) and what is left in escrow goes back to the
owner.

Credit rule (one claim per node and hivemind epoch, signed by its node, see `proto.models.ContributionClaim`):
- a claim is credited when another member of its round reported it (it came through the averager's gather), or
  when it is solo and no other node was in the job during its window;
- several different claims from one node for one epoch over overlapping windows are an equivocation: they are
  flagged; of all its claims for the epoch the smallest attested one is credited, the others rejected (claims one
  after the other, from a node that restarted, are not flagged);
- credited samples are capped by the node's measured throughput (`throughput_cap`): `THROUGHPUT_SLACK` times the
  median rate (samples per second of its window) of the round's other members, scaled up (never down) by the ratio
  of the nodes' GFLOP/s (`stable_gflops`: the median of each node's last `GFLOPS_HISTORY` passed challenges, not
  one noisy measure), over the claim's own billable window, and never below one round's worth. A solo claim is
  capped at one round's worth. A claim over its cap is flagged, except in a round where a member (the claimant or
  a peer) makes its first claim since it was assigned, having just started or rejoined (its shares say nothing
  about honesty; the cap still holds), and a flagged claim earns no slack: it is credited the median share alone
  (so inflating pays less than honesty);
- the paid time is the claim's wall-clock window (the node's GPUs were the job's for that long), only while the node
  held an assignment in the job (not before it was matched, not after a loss, a cancel or the job's end), never
  before its previous paid claim, and scaled like the samples (`billable_seconds`); a claim whose window began
  after the node's assignments in the job had all ended is rejected, attested or not;
- a claim for an epoch that hivemind's own progress records (read from the DHT) never reached stays pending and
  is rejected at settlement;
- a report's `suspects` (peers its reducer clipped as Byzantine outliers) get no attestation from it, and a node
  that two members name is banned from the job (`_suspect`): nothing more credited, its pay forfeited.
"""

from __future__ import annotations

import math
import secrets
import statistics
from collections import defaultdict
from dataclasses import dataclass

from gpuswarm.coordinator import jobs
from gpuswarm.coordinator.db import (
    AssignmentRow,
    Attestation,
    Challenge,
    Contribution,
    Job,
    JobEvent,
    LedgerEntry,
    Node,
    Suspicion,
    in_chunks,
)
from gpuswarm.coordinator.errors import Conflict, Unprocessable
from gpuswarm.coordinator.requests import parse
from gpuswarm.proto.models import CLAIM_KIND, AssignmentState, ContributionClaim, JobSpec, RoundReport
from gpuswarm.proto.signing import MAX_CLOCK_SKEW, SignatureError, SignedEnvelope, verify
from sqlalchemy import case, func, select
from sqlalchemy.ext.asyncio import AsyncSession

MICRO = 1_000_000
THROUGHPUT_SLACK = 3.0  # a member may do this much more than its round's median peer (per GFLOP/s) unflagged
# Seconds of slack on each side of the window ratio: a window runs from when its member saw one round end to when it
# saw the next, and members see it up to about a second apart (the averaging, the tracker's refresh); with
# sub-second rounds, bare ratios of 0.7 s to 0.3 s let a liar's flagged rounds be credited twice a peer's share.
WINDOW_JITTER = 1.0
GFLOPS_HISTORY = 5  # passed challenges whose median is a node's speed (one measured 2.2 to 38.8 on one machine)
DHT_EPOCH_MARGIN = 5  # epochs a claim may run ahead of the DHT's progress records (they are read every 5 s)
MINT = "mint"
# Every credit ever issued, less those withdrawn, at most: any sum of ledger amounts (a balance, the mint's) then
# stays nine times inside a signed 64-bit integer of micro-credits, so no database overflows summing them.
MAX_SUPPLY = 10**12 * MICRO
BUDGET_EXHAUSTED = "budget exhausted"  # the ledger event of a payment the escrow could not cover


def micro(credits: float) -> int:
    return round(credits * MICRO)


def credits(amount: int) -> float:
    return amount / MICRO


def owner_account(owner_id: str) -> str:
    return f"owner:{owner_id}"


def node_account(node_id: str) -> str:
    return f"node:{node_id}"


def escrow_account(job_id: str) -> str:
    return f"escrow:{job_id}"


async def balance(session: AsyncSession, account: str) -> int:
    return int(await session.scalar(
        select(func.coalesce(func.sum(LedgerEntry.amount), 0)).where(LedgerEntry.account == account)))


def transfer(session: AsyncSession, src: str, dst: str, amount: int, kind: str, now: float, *,
             job_id: str | None = None, memo: str = "") -> None:
    """Move `amount` micro-credits from `src` to `dst` as two legs of one transfer. Nothing for amount <= 0."""
    if amount <= 0:
        return
    transfer_id = secrets.token_hex(8)
    session.add_all([
        LedgerEntry(transfer=transfer_id, at=now, account=src, amount=-amount, kind=kind, job_id=job_id, memo=memo),
        LedgerEntry(transfer=transfer_id, at=now, account=dst, amount=amount, kind=kind, job_id=job_id, memo=memo),
    ])


async def mint(session: AsyncSession, dst: str, amount: int, kind: str, now: float, *, memo: str = "") -> None:
    """Issue `amount` new micro-credits to `dst`, within MAX_SUPPLY (409 `supply_limit` beyond it)."""
    if amount > 0 and amount - await balance(session, MINT) > MAX_SUPPLY:
        raise Conflict(f"issuing {credits(amount):.6f} credits would put more than {credits(MAX_SUPPLY):.0f} in "
                       "circulation", code="supply_limit")
    transfer(session, MINT, dst, amount, kind, now, memo=memo)


def reserve_budget(session: AsyncSession, job: Job, spec: JobSpec, now: float, balances: dict[str, int]) -> bool:
    """Move the job's budget from its owner into escrow; False (and nothing moved) if the owner cannot cover it.
    `balances`: the owner's balance as read in this transaction (by owner id), kept current here, so that a tick
    that starts many jobs sums each owner's entries once instead of once per job (and flushing before each)."""
    amount = micro(spec.budget)
    if balances[job.owner_id] < amount:
        return False
    balances[job.owner_id] -= amount
    transfer(session, owner_account(job.owner_id), escrow_account(job.id), amount, "reserve", now,
             job_id=job.id, memo="budget reserved at start")
    return True


# ---------------------------------------------------------------------------------------------------- round ingest


@dataclass(frozen=True)
class Ignored:
    """A claim of a round report that was not recorded: its node is not a member of the job, or it is another's."""

    node_id: str
    epoch: int
    reason: str


def verify_claims(report: RoundReport, now: float) -> list[tuple[SignedEnvelope, ContributionClaim]]:
    """The report's claims, each a valid claim signed by its node (422 `bad_claim` or `invalid` otherwise: one bad
    claim refuses the whole report). The report must hold its reporter's own claim; a solo report only that."""
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
    return claims


async def ingest_round(session: AsyncSession, job: Job, report: RoundReport,
                       claims: list[tuple[SignedEnvelope, ContributionClaim]],
                       now: float) -> tuple[list[Contribution], list[Ignored]]:
    """Record a member's report of one round (claims from `verify_claims`) and credit what can be credited.

    Claims by nodes that are not members of the job, or for another job, are ignored (a peer's bad gather data
    must not void an honest report). Each other member's claim the reporter passes on is attested by it. The
    same claim reported again is the same row, and the same attestation is not added twice. Returns the rows of
    the recorded claims, in the report's order, and the ignored ones."""
    await jobs.require_member(session, job, report.node_id)
    members = set((await session.scalars(select(AssignmentRow.node_id).where(
        AssignmentRow.job_id == job.id))).all())
    # The suspects this report names, by node: a peer id is known only from a claim its node signed, in this
    # report or an earlier one of the job.
    by_peer = {c.peer_id: c.node_id for _, c in claims if c.peer_id and c.job_id == job.id}
    if unknown := set(report.suspects) - by_peer.keys():
        by_peer |= dict((await session.execute(select(Contribution.peer_id, Contribution.node_id).where(
            Contribution.job_id == job.id, Contribution.peer_id.in_(sorted(unknown))).distinct())).all())
    suspects = {by_peer[p] for p in report.suspects if p in by_peer} - {report.node_id}
    results: list[Contribution] = []
    ignored: list[Ignored] = []
    for claim_envelope, claim in claims:
        if claim.job_id != job.id or claim.node_id not in members:
            ignored.append(Ignored(claim.node_id, claim.epoch,
                                   "not a member of this job" if claim.job_id == job.id else "another job"))
            continue
        row = await session.scalar(select(Contribution).where(
            Contribution.job_id == job.id, Contribution.node_id == claim.node_id,
            Contribution.epoch == claim.epoch, Contribution.signature == claim_envelope.signature))
        if row is None:
            row = Contribution(**claim.model_dump(), solo=report.solo,
                               signature=claim_envelope.signature, received_at=now,
                               envelope=claim_envelope.model_dump(mode="json"), status="pending")
            session.add(row)
            await session.flush()
        if claim.node_id != report.node_id and claim.node_id not in suspects:  # no vouching for an outlier
            seen = await session.scalar(select(Attestation.id).where(
                Attestation.claim_id == row.id, Attestation.attester == report.node_id))
            if seen is None:
                session.add(Attestation(claim_id=row.id, attester=report.node_id, at=now))
        results.append(row)
    await session.flush()
    events: list[str] = []
    for suspect in sorted(suspects & members):
        events += await _suspect(session, job, suspect, report, now)
    waiting = set((await session.scalars(select(Contribution.epoch).where(
        Contribution.job_id == job.id, Contribution.status == "pending").distinct())).all())
    events += await credit_epochs(session, job, waiting | {r.epoch for r in results}, now)
    for message in dict.fromkeys(events):
        session.add(JobEvent(job_id=job.id, at=now, message=message))
    if BUDGET_EXHAUSTED in events and jobs.allows(job, jobs.Event.BUDGET_EXHAUSTED):
        await jobs.apply(session, job, jobs.Event.BUDGET_EXHAUSTED, now, "failed: budget exhausted",
                         error="the job's budget is spent")
    return results, ignored


BAN_QUORUM = 2  # distinct witnesses (members whose reducers clipped it, referees whose replay failed) ban a node


async def banned(session: AsyncSession, job_ids: list[str]) -> dict[str, set[str]]:
    """{job: the nodes banned from it}: those BAN_QUORUM distinct witnesses named. The one source of a ban, read by
    crediting and by the matcher (a banned node is never given the job again, whatever its assignment's state)."""
    found: dict[str, set[str]] = {}
    for ids in in_chunks(job_ids):  # the matcher's tick asks for every open job
        rows = await session.execute(select(Suspicion.job_id, Suspicion.node_id).where(Suspicion.job_id.in_(ids))
                                     .group_by(Suspicion.job_id, Suspicion.node_id)
                                     .having(func.count() >= BAN_QUORUM))
        for job_id, node_id in rows.all():
            found.setdefault(job_id, set()).add(node_id)
    return found


async def _suspect(session: AsyncSession, job: Job, node_id: str, report: RoundReport, now: float) -> list[str]:
    """`report`'s node named `node_id` an outlier (see `witness`)."""
    return await witness(session, job, node_id, report.node_id, report.epoch, now,
                         f"banned: {BAN_QUORUM} members' reducers clipped its averaging data as an outlier")


async def witness(session: AsyncSession, job: Job, node_id: str, reporter: str, epoch: int, now: float,
                  why: str) -> list[str]:
    """Record that `reporter` saw `node_id` cheat in the job; at BAN_QUORUM distinct witnesses it is banned from
    the job and forfeits (`forfeit`, for `why`). Returns ledger events (none once it was banned already)."""
    if await session.get(Suspicion, (job.id, node_id, reporter)) is not None:
        return []  # this witness named it before
    session.add(Suspicion(job_id=job.id, node_id=node_id, reporter=reporter, epoch=epoch, at=now))
    await session.flush()
    reporters = await session.scalar(select(func.count()).select_from(Suspicion).where(
        Suspicion.job_id == job.id, Suspicion.node_id == node_id))
    if reporters != BAN_QUORUM:
        return []  # not yet, or banned already when the quorum was reached
    return await forfeit(session, job, node_id, why, now)


async def forfeit(session: AsyncSession, job: Job, node_id: str, why: str, now: float) -> list[str]:
    """A node loses the job: its active assignment, if it still has one, ends as "banned", its claims in the job
    are rejected and flagged, and what the job paid it goes back to the escrow (so to the owner). Returns ledger
    events."""
    active = (await session.scalars(select(AssignmentRow).where(
        AssignmentRow.job_id == job.id, AssignmentRow.node_id == node_id,
        AssignmentRow.state == AssignmentState.ACTIVE.value))).all()
    for a in active:
        a.state, a.ended_at, a.reason = AssignmentState.BANNED.value, now, why
    # Everything it claimed in the job goes: pending claims are rejected, and what earlier rounds paid it (rounds
    # before the first report named it) is forfeited back to the escrow, and so to the owner.
    forfeited = 0
    # Back to the escrow, or to the owner once the job's books closed (an audit can end after that).
    to = escrow_account(job.id) if job.settled_at is None else owner_account(job.owner_id)
    for c in (await session.scalars(select(Contribution).where(
            Contribution.job_id == job.id, Contribution.node_id == node_id,
            Contribution.status.in_(("pending", "credited"))))).all():
        if c.paid:
            amount = min(c.paid, await balance(session, node_account(node_id)))
            transfer(session, node_account(node_id), to, amount, "forfeit", now,
                     job_id=job.id, memo=f"epoch {c.epoch}: {why}")
            forfeited += amount
            c.paid = c.paid - amount
        c.status, c.flag = "rejected", c.flag or why
        c.credited_samples, c.credited_seconds = 0, 0.0
    return [f"node {node_id} {why}" + (f"; {credits(forfeited):.6f} credits forfeited" if forfeited else "")]


# ---------------------------------------------------------------------------------------------------- crediting


def throughput_cap(claim: Contribution, peers: list[Contribution], gflops: dict[str, float | None],
                   spec: JobSpec, windows: dict[int, float] | None = None,
                   slack: float = THROUGHPUT_SLACK) -> int | None:
    """The most samples this claim can be credited with (None: no cap).

    The members of a round train side by side, so a member's share follows its speed and the time it trained: it
    may claim up to `slack` times the upper median of its peers' claims (with two peers the larger: one that fell
    behind and stepped once after loading the state must not set the bar for the one that covered for it), each
    scaled up by the ratio of the nodes' GFLOP/s (`stable_gflops`) when that says this node is faster (never down:
    an honest node measured slow must not be flagged; 1 when unknown) and by the ratio of the claims' `windows` (by
    claim id: seconds of its window while its node was in the job, each counted `WINDOW_JITTER` longer): a member
    that joined a round late, or started training before the others arrived, claims in proportion to its time. One
    round's worth (target batch plus one local batch, in mode "sync") is always plausible, which covers a node that
    trained alone while waiting for its group."""
    hp = spec.hyperparameters
    one_round = int(hp["target_batch_size"]) + int(hp.get("batch_size", 0)) if "target_batch_size" in hp else 0
    if peers:
        mine = gflops.get(claim.node_id)

        def share(p: Contribution) -> float:
            speed = max(1.0, mine / theirs) if mine and (theirs := gflops.get(p.node_id)) else 1.0
            mine_s, theirs_s = (windows.get(claim.id, 0.0), windows.get(p.id, 0.0)) if windows else (0.0, 0.0)
            ratio = (mine_s + WINDOW_JITTER) / (theirs_s + WINDOW_JITTER) if mine_s > 0 and theirs_s > 0 else 1.0
            return p.samples * speed * ratio

        return max(one_round, int(statistics.median_high(map(share, peers)) * slack))
    return one_round if claim.solo and one_round else None


async def stable_gflops(session: AsyncSession, node_ids: list[str]) -> dict[str, float | None]:
    """Each node's speed for the throughput cap: the median GFLOP/s of its last GFLOPS_HISTORY passed challenges
    (None without one)."""
    rows = (await session.execute(
        select(Challenge.node_id, Challenge.measured_gflops)
        .where(Challenge.node_id.in_(node_ids), Challenge.state == "passed", Challenge.measured_gflops.is_not(None))
        .order_by(Challenge.finished_at.desc()))).all()
    history: dict[str, list[float]] = defaultdict(list)
    for node_id, gflops in rows:
        if len(history[node_id]) < GFLOPS_HISTORY:
            history[node_id].append(gflops)
    return {n: statistics.median(history[n]) if history[n] else None for n in node_ids}


Intervals = list[tuple[float, float]]  # a node's assignments in a job: (start, end), end inf while active


def billable_seconds(claim: Contribution, since: float, assigned: Intervals) -> float:
    """Wall-clock seconds the claim may be paid for: its window, cut to start no earlier than `since` (its previous
    paid claim), so windows are never paid twice, to end when it was received, and to the time its node held an
    assignment in the job (`assigned`): nothing before it was matched, nothing after a loss, a cancel or the end."""
    start, end = max(claim.window_start, since), min(claim.window_end, claim.received_at)
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in assigned)


def overlap(a: Contribution, b: Contribution) -> bool:
    """Do two claims' windows share time? Two claims of one node for one epoch over the same time are two stories
    about one piece of work; one after the other they are a retry (a node that restarted re-enters the epoch it
    left), and only one of them is credited either way."""
    return a.window_start < b.window_end and b.window_start < a.window_end


async def first_epochs_since_assigned(session: AsyncSession, job_id: str) -> dict[str, int]:
    """Each node's first epoch with a claim that ended after its newest assignment in the job began: the round in
    which it started or rejoined."""
    newest = (select(AssignmentRow.node_id, func.max(AssignmentRow.created_at).label("began"))
              .where(AssignmentRow.job_id == job_id).group_by(AssignmentRow.node_id).subquery())
    return dict((await session.execute(
        select(Contribution.node_id, func.min(Contribution.epoch))
        .join(newest, newest.c.node_id == Contribution.node_id)
        .where(Contribution.job_id == job_id, Contribution.window_end > newest.c.began)
        .group_by(Contribution.node_id))).all())


async def credit_epochs(session: AsyncSession, job: Job, epochs: set[int], now: float) -> list[str]:
    """Credit what can be credited among the job's claims for `epochs`, and pay for it. Returns ledger events."""
    rows = (await session.scalars(select(Contribution).where(
        Contribution.job_id == job.id, Contribution.epoch.in_(sorted(epochs))))).all()
    if not rows:
        return []
    attested = set((await session.scalars(select(Attestation.claim_id).where(
        Attestation.claim_id.in_([r.id for r in rows])))).all())
    assignments = (await session.scalars(select(AssignmentRow).where(AssignmentRow.job_id == job.id))).all()
    nodes = {n.id: n for n in (await session.scalars(select(Node).where(
        Node.id.in_({r.node_id for r in rows})))).all()}
    gflops = await stable_gflops(session, list(nodes))
    spec = JobSpec.model_validate(job.spec)
    events: list[str] = []
    paid_until = dict((await session.execute(
        select(Contribution.node_id, func.max(Contribution.window_end))
        .where(Contribution.job_id == job.id, Contribution.status == "credited")
        .group_by(Contribution.node_id))).all())

    assigned: dict[str, Intervals] = defaultdict(list)
    for a in assignments:
        assigned[a.node_id].append((a.created_at, math.inf if a.ended_at is None else a.ended_at))

    excluded = (await banned(session, [job.id])).get(job.id, set())

    def alone(claim: Contribution) -> bool:
        return not any(a.node_id != claim.node_id and a.created_at <= claim.window_end
                       and (a.ended_at is None or a.ended_at >= claim.window_start) for a in assignments)

    by_epoch: dict[int, dict[str, list[Contribution]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        by_epoch[r.epoch][r.node_id].append(r)
    joined_at: dict[str, int] | None = None  # read only when a claim goes over its cap
    for epoch, by_node in sorted(by_epoch.items()):
        for node_id, versions in sorted(by_node.items()):
            for v in versions:
                if rivals := [w for w in versions if w is not v and overlap(v, w)]:
                    v.flag = v.flag or f"equivocation: {len(rivals) + 1} different claims for epoch {epoch}"
            if any(v.status == "credited" for v in versions):
                for v in versions:
                    if v.status == "pending":
                        v.status = "rejected"
                continue
            if job.dht_epoch is not None and epoch > job.dht_epoch + DHT_EPOCH_MARGIN:
                continue  # hivemind's progress records have not reached this epoch (yet)
            if node_id in excluded:  # a node banned from the job is credited nothing more in it
                for v in versions:
                    if v.status == "pending":
                        v.status, v.flag = "rejected", v.flag or "banned from the job"
                continue
            ended = max(b for _, b in assigned[node_id]) if assigned[node_id] else -math.inf
            for v in versions:  # work after the node's assignments ended is no work for the job, attested or not
                if v.status == "pending" and v.window_start >= ended:
                    v.status = "rejected"
                    events.append(f"node {node_id}'s claim for epoch {epoch} began after its assignment ended; "
                                  "not paid")
            eligible = [v for v in versions if v.status == "pending" and (v.id in attested or (v.solo and alone(v)))]
            if not eligible:
                continue
            chosen = min(eligible, key=lambda v: (v.samples, v.id))
            for v in versions:
                if v is not chosen and v.status == "pending":
                    v.status = "rejected"
            peers = [p for other, vs in by_node.items() if other != node_id for p in vs if p.status != "rejected"]
            since = paid_until.get(node_id) or -math.inf
            # Its own window starts no earlier than its previous paid claim: one claimed over time already paid
            # for would raise its own cap.
            windows = {c.id: billable_seconds(c, since if c is chosen else -math.inf, assigned[c.node_id])
                       for c in (chosen, *peers)}
            cap = throughput_cap(chosen, peers, gflops, spec, windows)
            credited = chosen.samples if cap is None else min(chosen.samples, cap)
            # A round in which a member (this one or a peer) makes its first claim since it was assigned is capped
            # but not flagged: members start at different times, and while the first wait for the others (hivemind's
            # tracker) a late one steps on; a member that rejoins loads the state from a peer, which steps less
            # meanwhile. The shares of such a round say nothing about honesty.
            if credited < chosen.samples:
                if joined_at is None:
                    joined_at = await first_epochs_since_assigned(session, job.id)
                if not any(joined_at.get(c.node_id) == epoch for c in (chosen, *peers)) and node_id in paid_until:
                    credited = min(credited, throughput_cap(chosen, peers, gflops, spec, windows, slack=1.0))
                    chosen.flag = chosen.flag or (f"exceeds measured throughput: claimed {chosen.samples} samples, "
                                                  f"credited {credited}")
                events.append(f"node {node_id} claimed {chosen.samples} samples for epoch {epoch}; "
                              f"credited {credited} (measured throughput)")
            fraction = credited / chosen.samples if chosen.samples else 1.0
            chosen.status, chosen.credited_samples = "credited", credited
            chosen.credited_seconds = billable_seconds(chosen, since, assigned[node_id]) * fraction
            paid_until[node_id] = max(since, chosen.window_end)
            events += await _pay(session, job, chosen, assignments, now)
    return events


async def _pay(session: AsyncSession, job: Job, claim: Contribution, assignments, now: float) -> list[str]:
    """Pay a credited claim from the job's escrow; end the job when the escrow runs dry."""
    held = [a for a in assignments if a.node_id == claim.node_id]
    if not held or job.settled_at is not None:
        return []
    assignment = max(held, key=lambda a: a.id)
    owed = micro(claim.credited_seconds / 3600 * assignment.gpus * assignment.price_per_gpu_hour)
    if owed <= 0:
        return []
    available = await balance(session, escrow_account(job.id))
    claim.paid = min(owed, available)
    transfer(session, escrow_account(job.id), node_account(claim.node_id), claim.paid, "pay", now,
             job_id=job.id, memo=f"epoch {claim.epoch}: {claim.credited_seconds:.1f} s x "
                                 f"{assignment.gpus} x {assignment.price_per_gpu_hour}/h")
    if claim.paid < owed:
        return [BUDGET_EXHAUSTED]
    return []


async def settle(session: AsyncSession, job: Job, now: float) -> None:
    """Close a finished job's books: reject the claims nobody attested, refund what is left in escrow."""
    pending = (await session.scalars(select(Contribution).where(
        Contribution.job_id == job.id, Contribution.status == "pending"))).all()
    if pending:
        await credit_epochs(session, job, {c.epoch for c in pending}, now)
    attested = set((await session.scalars(select(Attestation.claim_id).where(
        Attestation.claim_id.in_([c.id for c in pending])))).all()) if pending else set()
    for claim in pending:
        if claim.status != "pending":
            continue
        claim.status = "rejected"
        # Unattested is unpaid, not a lie: a round that failed after its group formed (a partition, a peer that
        # died mid-round) leaves an honest member's claim unattested, and an unattested claim earns nothing. A
        # node cut off from its peers counts its own epochs alone, past the swarm's: unpaid, not flagged either.
        # Peers vouching for an epoch the swarm never reached are another matter.
        if job.dht_epoch is not None and claim.epoch > job.dht_epoch + DHT_EPOCH_MARGIN and claim.id in attested:
            claim.flag = claim.flag or "attested for an epoch never reached in hivemind's progress records"
    left = await balance(session, escrow_account(job.id))
    transfer(session, escrow_account(job.id), owner_account(job.owner_id), left, "refund", now,
             job_id=job.id, memo="unspent budget")
    job.settled_at = now


# ---------------------------------------------------------------------------------------------------- statements


async def contributions(session: AsyncSession, job_id: str) -> list[dict]:
    """Per node: what it claimed, what was credited and paid, and how many of its claims are flagged."""
    rows = await session.execute(
        select(Contribution.node_id, func.count(), func.sum(Contribution.samples),
               func.sum(Contribution.credited_samples), func.sum(Contribution.steps),
               func.sum(Contribution.compute_seconds), func.sum(Contribution.credited_seconds),
               func.sum(Contribution.paid), func.count(Contribution.flag),
               func.sum(case((Contribution.status == "pending", 1), else_=0)))
        .where(Contribution.job_id == job_id).group_by(Contribution.node_id).order_by(Contribution.node_id))
    return [{"node_id": n, "claims": k, "claimed_samples": int(s), "samples": int(cs), "steps": int(st),
             "claimed_seconds": round(sec, 3), "compute_seconds": round(csec, 3), "paid": credits(int(paid)),
             "flagged": int(flagged), "pending": int(pending or 0)}
            for n, k, s, cs, st, sec, csec, paid, flagged, pending in rows]


async def entries(session: AsyncSession, *, account: str | None = None, job_id: str | None = None) -> list[dict]:
    query = select(LedgerEntry).order_by(LedgerEntry.id)
    if account is not None:
        query = query.where(LedgerEntry.account == account)
    if job_id is not None:
        query = query.where(LedgerEntry.job_id == job_id)
    return [{"at": e.at, "account": e.account, "amount": credits(e.amount), "kind": e.kind, "job_id": e.job_id,
             "memo": e.memo} for e in (await session.scalars(query)).all()]


async def job_statement(session: AsyncSession, job: Job) -> dict:
    spec = JobSpec.model_validate(job.spec)
    legs = await entries(session, job_id=job.id)
    escrow_legs = [e for e in legs if e["account"] == escrow_account(job.id)]
    reserved = sum(e["amount"] for e in escrow_legs if e["kind"] == "reserve")
    # What nodes were paid, less what a banned node forfeited back.
    paid = -sum(e["amount"] for e in escrow_legs if e["kind"] in ("pay", "forfeit"))
    refunded = -sum(e["amount"] for e in escrow_legs if e["kind"] == "refund")
    return {"job_id": job.id, "state": job.state, "owner_id": job.owner_id, "budget": spec.budget,
            "reserved": round(reserved, 6), "paid": round(paid, 6), "refunded": round(refunded, 6),
            "escrow": credits(await balance(session, escrow_account(job.id))), "settled": job.settled_at is not None,
            "nodes": await contributions(session, job.id), "entries": escrow_legs}


async def node_statement(session: AsyncSession, node_id: str) -> dict:
    legs = await entries(session, account=node_account(node_id))
    by_job: dict[str, float] = defaultdict(float)
    for e in legs:
        by_job[e["job_id"]] += e["amount"]
    claims = await session.execute(
        select(Contribution.job_id, func.count(), func.sum(Contribution.credited_samples),
               func.sum(Contribution.credited_seconds), func.count(Contribution.flag))
        .where(Contribution.node_id == node_id).group_by(Contribution.job_id).order_by(Contribution.job_id))
    jobs = [{"job_id": j, "claims": k, "samples": int(s), "compute_seconds": round(sec, 3),
             "flagged": int(f), "earned": round(by_job.get(j, 0.0), 6)} for j, k, s, sec, f in claims]
    return {"node_id": node_id, "balance": credits(await balance(session, node_account(node_id))), "jobs": jobs,
            "entries": legs}
