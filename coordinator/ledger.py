"""The money side: accounts, escrow, crediting peer-attested claims, paying nodes, and statements.

Owns the double-entry ledger (`db.LedgerEntry`, integer micro-credits), the escrow rule and the credit rule. It
does not parse requests or know HTTP; views call it inside their transaction.

Escrow: a job's budget moves from its owner to `escrow:JOB` when the job starts. Each credited claim pays its
node `credited hours x GPUs x the assignment's clearing price` (the node's ask: a pay-as-bid reverse
auction) out of that escrow. When the escrow cannot pay, the job ends ("budget exhausted"). Once a job has ended
and its last reports had time to arrive (`settle_grace`), claims nobody attested are rejected and what is left
in escrow goes back to the owner.

Credit rule (one claim per node and hivemind epoch, signed by its node, see `proto.models.ContributionClaim`):
- a claim is credited when another member of its round reported it (it came through the averager's gather), or
  when it is solo and no other node was in the job during its window;
- several different claims from one node for one epoch are an equivocation: all are flagged, the smallest
  attested one is credited, the others rejected;
- credited samples are capped by the node's measured throughput (`throughput_cap`): `THROUGHPUT_SLACK` times the
  median claim of the round's other members, scaled by the ratio of challenge-measured GFLOP/s, and never below
  one round's worth. A solo claim is capped at one round's worth. A claim over its cap is flagged;
- the paid time is the claim's wall-clock window (the node's GPUs were the job's for that long), never before the
  node joined or before its previous paid claim, and scaled like the samples (`billable_seconds`);
- a claim for an epoch that hivemind's own progress records (read from the DHT) never reached stays pending and
  is rejected at settlement.
"""

from __future__ import annotations

import secrets
import statistics
from collections import defaultdict

from gpuswarm.coordinator.db import AssignmentRow, Attestation, Contribution, Job, LedgerEntry, Node
from gpuswarm.proto.models import JobSpec
from sqlalchemy import case, func, select
from sqlalchemy.ext.asyncio import AsyncSession

MICRO = 1_000_000
THROUGHPUT_SLACK = 3.0  # a member may do this much more than its round's median peer (per GFLOP/s) unflagged
DHT_EPOCH_MARGIN = 5  # epochs a claim may run ahead of the DHT's progress records (they are read every 5 s)
MINT = "mint"


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


async def transfer(session: AsyncSession, src: str, dst: str, amount: int, kind: str, now: float, *,
                   job_id: str | None = None, memo: str = "") -> None:
    """Move `amount` micro-credits from `src` to `dst` as two legs of one transfer. Nothing for amount <= 0."""
    if amount <= 0:
        return
    transfer_id = secrets.token_hex(8)
    session.add_all([
        LedgerEntry(transfer=transfer_id, at=now, account=src, amount=-amount, kind=kind, job_id=job_id, memo=memo),
        LedgerEntry(transfer=transfer_id, at=now, account=dst, amount=amount, kind=kind, job_id=job_id, memo=memo),
    ])


async def reserve_budget(session: AsyncSession, job: Job, spec: JobSpec, now: float) -> bool:
    """Move the job's budget from its owner into escrow; False (and nothing moved) if the owner cannot cover it."""
    amount = micro(spec.budget)
    if await balance(session, owner_account(job.owner_id)) < amount:
        return False
    await transfer(session, owner_account(job.owner_id), escrow_account(job.id), amount, "reserve", now,
                   job_id=job.id, memo="budget reserved at start")
    return True


# ---------------------------------------------------------------------------------------------------- crediting


def throughput_cap(claim: Contribution, peers: list[Contribution], gflops: dict[str, float | None],
                   spec: JobSpec) -> int | None:
    """The most samples this claim can be credited with (None: no cap).

    The members of a round train side by side until the swarm reaches its target batch, so a member's share of the
    round follows its speed: it may claim up to `THROUGHPUT_SLACK` times the median of its peers' claims, each
    scaled by the ratio of challenge-measured GFLOP/s (1 when unknown). One round's worth (target batch plus one
    local batch) is always plausible, which covers a node that trained alone while waiting for its group."""
    hp = spec.hyperparameters
    one_round = int(hp["target_batch_size"]) + int(hp.get("batch_size", 0)) if "target_batch_size" in hp else 0
    if peers:
        mine = gflops.get(claim.node_id)
        scaled = [p.samples * (mine / theirs if mine and (theirs := gflops.get(p.node_id)) else 1.0) for p in peers]
        return max(one_round, int(statistics.median(scaled) * THROUGHPUT_SLACK))
    return one_round if claim.solo and one_round else None


def billable_seconds(claim: Contribution, since: float) -> float:
    """Wall-clock seconds the claim may be paid for: its window, cut to start no earlier than `since` (the node's
    assignment, or its previous paid claim), so windows are never paid twice, and to end when it was received."""
    return max(0.0, min(claim.window_end, claim.received_at) - max(claim.window_start, since))


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
    gflops = {node_id: node.measured_gflops for node_id, node in nodes.items()}
    spec = JobSpec.model_validate(job.spec)
    events: list[str] = []
    paid_until = dict((await session.execute(
        select(Contribution.node_id, func.max(Contribution.window_end))
        .where(Contribution.job_id == job.id, Contribution.status == "credited")
        .group_by(Contribution.node_id))).all())

    def alone(claim: Contribution) -> bool:
        return not any(a.node_id != claim.node_id and a.created_at <= claim.window_end
                       and (a.ended_at is None or a.ended_at >= claim.window_start) for a in assignments)

    by_epoch: dict[int, dict[str, list[Contribution]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        by_epoch[r.epoch][r.node_id].append(r)
    for epoch, by_node in sorted(by_epoch.items()):
        for node_id, versions in sorted(by_node.items()):
            if len(versions) > 1:
                for v in versions:
                    v.flag = v.flag or f"equivocation: {len(versions)} different claims for epoch {epoch}"
            if any(v.status == "credited" for v in versions):
                for v in versions:
                    if v.status == "pending":
                        v.status = "rejected"
                continue
            if job.dht_epoch is not None and epoch > job.dht_epoch + DHT_EPOCH_MARGIN:
                continue  # hivemind's progress records have not reached this epoch (yet)
            eligible = [v for v in versions if v.status == "pending" and (v.id in attested or (v.solo and alone(v)))]
            if not eligible:
                continue
            chosen = min(eligible, key=lambda v: (v.samples, v.id))
            for v in versions:
                if v is not chosen and v.status == "pending":
                    v.status = "rejected"
            peers = [p for other, vs in by_node.items() if other != node_id for p in vs if p.status != "rejected"]
            cap = throughput_cap(chosen, peers, gflops, spec)
            credited = chosen.samples if cap is None else min(chosen.samples, cap)
            if credited < chosen.samples:
                chosen.flag = chosen.flag or (f"exceeds measured throughput: claimed {chosen.samples} samples, "
                                              f"credited {credited}")
                events.append(f"node {node_id} claimed {chosen.samples} samples for epoch {epoch}; "
                              f"credited {credited} (measured throughput)")
            fraction = credited / chosen.samples if chosen.samples else 1.0
            joined = min((a.created_at for a in assignments if a.node_id == node_id), default=chosen.window_start)
            since = max(joined, paid_until.get(node_id) or 0.0)
            chosen.status, chosen.credited_samples = "credited", credited
            chosen.credited_seconds = billable_seconds(chosen, since) * fraction
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
    await transfer(session, escrow_account(job.id), node_account(claim.node_id), claim.paid, "pay", now,
                   job_id=job.id, memo=f"epoch {claim.epoch}: {claim.credited_seconds:.1f} s x "
                                       f"{assignment.gpus} x {assignment.price_per_gpu_hour}/h")
    if claim.paid < owed:
        return ["budget exhausted"]
    return []


async def settle(session: AsyncSession, job: Job, now: float) -> None:
    """Close a finished job's books: reject the claims nobody attested, refund what is left in escrow."""
    pending = (await session.scalars(select(Contribution).where(
        Contribution.job_id == job.id, Contribution.status == "pending"))).all()
    if pending:
        await credit_epochs(session, job, {c.epoch for c in pending}, now)
    for claim in pending:
        if claim.status != "pending":
            continue
        claim.status = "rejected"
        if job.dht_epoch is not None and claim.epoch > job.dht_epoch + DHT_EPOCH_MARGIN:
            claim.flag = claim.flag or "epoch never reached in hivemind's progress records"
        elif not claim.solo:  # a solo claim beside other members is a failed round, not a lie: unpaid, unflagged
            claim.flag = claim.flag or "no other member of its round attested it"
    left = await balance(session, escrow_account(job.id))
    await transfer(session, escrow_account(job.id), owner_account(job.owner_id), left, "refund", now,
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
    paid = -sum(e["amount"] for e in escrow_legs if e["kind"] == "pay")
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
