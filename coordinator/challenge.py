"""The GPU challenge endpoints, their state (`db.Challenge`), and the sweep that fails unanswered challenges.

Owns /v1/challenges (start, commit, proof) and GET /v1/nodes/{node_id}/challenges, and records each result on the
node: `verified`, the pass/fail counters, `measured_gflops`, `last_challenge_at` and the next challenge time. The
protocol and its checks live in `gpuswarm.proto.challenge`; when a node is due, in `challenge_schedule`; the heartbeat
answer carries the "due" flag (`views.nodes.heartbeat`). Nodes authenticate like on every node route
(`auth.read_signed`, `auth.authenticate_node`). Checking a proof is O(n^2) and runs in a worker thread, at most
VERIFY_CONCURRENCY at a time, never on the event loop. Matching is not this module's: the matcher reads
`Node.verified`.

Every write is one transaction, and a refused request (4xx) changes nothing, the nonce included. A proof that does
not check out is not a refusal: it is a result (200, passed false), and the node is unverified from then on.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator

from aiohttp import web
from gpuswarm.coordinator import tasks
from gpuswarm.coordinator.auth import authenticate_node, read_signed
from gpuswarm.coordinator.challenge_schedule import challenge_due, next_challenge_time
from gpuswarm.coordinator.config import CONFIG, LEADERSHIP, SESSIONS, CoordinatorConfig
from gpuswarm.coordinator.db import Challenge, Node
from gpuswarm.coordinator.errors import BadRequest, Conflict, Forbidden, NotFound, Unprocessable
from gpuswarm.coordinator.openapi import describe, respond
from gpuswarm.proto.api import NodeChallenges
from gpuswarm.proto.challenge import (
    COMMIT_KIND,
    MAX_PROOF_BYTES,
    OPENED_ROWS,
    PROOF_KIND,
    START_KIND,
    ChallengeCommit,
    ChallengeIssue,
    ChallengeProof,
    ChallengeResult,
    ChallengeReveal,
    ChallengeStart,
    CommitAnswer,
    DeviceClass,
    Verdict,
    challenge_size,
    check_proof,
    decode_proof,
    device_class,
    measured_gflops,
    time_limit,
)
from gpuswarm.proto.models import Resources
from sqlalchemy import and_, or_, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

logger = logging.getLogger(__name__)
routes = web.RouteTableDef()
VERIFY_SLOTS = web.AppKey("challenge_verify_slots", asyncio.Semaphore)
VERIFY_CONCURRENCY = 1  # proofs checked at once: each takes one core for up to seconds (n = 16384)
COMMIT_GRACE = 5.0  # seconds past the time limit before the sweep fails a challenge nobody committed
HISTORY = 20  # challenges listed per node

ISSUED, REVEALED, PASSED, FAILED = "issued", "revealed", "passed", "failed"
OPEN_STATES = (ISSUED, REVEALED)


# ---------------------------------------------------------------------------------------------------- helpers


def node_device(node: Node) -> tuple[DeviceClass, int]:
    """The class the node is held to now, and the matrix size for it."""
    resources = Resources.model_validate(node.resources)
    return device_class(resources), challenge_size(resources)


def same_path_id(request: web.Request, challenge_id: str) -> None:
    if request.match_info["challenge_id"] != challenge_id:
        raise BadRequest(f"the path names challenge {request.match_info['challenge_id']!r}, the signed payload "
                         f"{challenge_id!r}", code="challenge_mismatch")


async def owned_challenge(session: AsyncSession, challenge_id: str, node_id: str, *, lock: bool = False) -> Challenge:
    row = await session.get(Challenge, challenge_id, with_for_update=lock)
    if row is None:
        raise NotFound(f"no challenge {challenge_id!r}", code="unknown_challenge")
    if row.node_id != node_id:
        raise Forbidden(f"challenge {challenge_id} belongs to another node", code="not_your_challenge")
    return row


async def open_challenge(session: AsyncSession, node_id: str) -> Challenge | None:
    return await session.scalar(select(Challenge).where(Challenge.node_id == node_id,
                                                        Challenge.state.in_(OPEN_STATES)).with_for_update())


def result_of(row: Challenge, node: Node) -> ChallengeResult:
    return ChallengeResult(
        challenge_id=row.id, node_id=row.node_id, passed=row.state == PASSED, reason=row.reason or "",
        device_class=row.device_class, n=row.n, time_limit=row.time_limit, measured_gflops=row.measured_gflops,
        seconds=None if row.committed_at is None else max(0.0, row.committed_at - row.issued_at),
        verified=bool(node.verified))


def challenge_json(row: Challenge) -> dict:
    return {"id": row.id, "state": row.state, "device_class": row.device_class, "n": row.n,
            "time_limit": row.time_limit, "issued_at": row.issued_at, "finished_at": row.finished_at,
            "seconds": None if row.committed_at is None else row.committed_at - row.issued_at,
            "measured_gflops": row.measured_gflops, "reason": row.reason}


def finish(row: Challenge, node: Node, *, passed: bool, reason: str, config: CoordinatorConfig, now: float) -> None:
    """Record a result on the challenge and its node, and schedule the node's next challenge."""
    row.state, row.finished_at, row.reason = (PASSED if passed else FAILED), now, reason[:2000]
    node.verified = passed
    if passed:
        node.challenges_passed = (node.challenges_passed or 0) + 1
    else:
        node.challenges_failed = (node.challenges_failed or 0) + 1
    if row.measured_gflops is not None:
        node.measured_gflops = row.measured_gflops
    node.last_challenge_at = now
    node.next_challenge_at = next_challenge_time(config, now)
    log = logger.info if passed else logger.warning
    log("GPU challenge %s of node %s (%s, n=%d) %s: %s", row.id, node.id, row.device_class, row.n,
        "passed" if passed else "FAILED", reason)


def _check(seed: str, n: int, root: str, r_seed: str, rows: list[int], proof: ChallengeProof) -> Verdict:
    """Decode and check a proof (worker thread). ValueError: the proof is malformed, which is bad input."""
    product, opened = decode_proof(proof, n, rows)
    return check_proof(seed, n, root, r_seed, product, opened)


# ---------------------------------------------------------------------------------------------------- routes


@routes.post("/v1/challenges")
@describe(auth="node", body=ChallengeStart, signed=START_KIND, response=ChallengeIssue, status=201)
async def start_challenge(request: web.Request) -> web.Response:
    """Start the GPU challenge a heartbeat answer asked for; the clock runs from this answer to the commitment.

    An open challenge of the same node is abandoned (and counts as failed): a restarted node asks again."""
    message = await read_signed(request, START_KIND, ChallengeStart)
    config = request.app[CONFIG]
    async with request.app[SESSIONS].begin() as session:
        node = await authenticate_node(session, message)
        now = time.time()
        still_open = await open_challenge(session, node.id)
        if still_open is None and not challenge_due(node, now, busy=False):
            when = "after its next registration" if node.next_challenge_at is None \
                else f"in {node.next_challenge_at - now:.0f}s"
            raise Conflict(f"no challenge is due for node {node.id}; the next one is {when}", code="not_due")
        if still_open is not None:
            finish(still_open, node, passed=False, reason="abandoned: the node started another challenge",
                   config=config, now=now)
        device, n = node_device(node)
        row = Challenge(id=f"c-{secrets.token_hex(8)}", node_id=node.id, state=ISSUED, device_class=device.name,
                        n=n, seed=secrets.token_hex(16), time_limit=time_limit(device, n), issued_at=time.time())
        session.add(row)
        node.next_challenge_at = None  # nothing more is due until this one ends
    logger.info("GPU challenge %s issued to node %s: %s, n=%d, %.2fs to commit", row.id, node.id, device.name, n,
                row.time_limit)
    issue = ChallengeIssue(challenge_id=row.id, node_id=node.id, seed=row.seed, n=n, device_class=device.name,
                           time_limit=row.time_limit, issued_at=row.issued_at,
                           deadline=row.issued_at + row.time_limit)
    return respond(issue, status=201)


@routes.post("/v1/challenges/{challenge_id}/commit")
@describe(auth="node", body=ChallengeCommit, signed=COMMIT_KIND, response=CommitAnswer)
async def commit_challenge(request: web.Request) -> web.Response:
    """Commit to C's rows (a Merkle root). In time: the answer reveals r and the rows to open. Late: the answer is
    the final result (failed)."""
    message = await read_signed(request, COMMIT_KIND, ChallengeCommit)
    commit = message.payload
    same_path_id(request, commit.challenge_id)
    now, config = time.time(), request.app[CONFIG]
    async with request.app[SESSIONS].begin() as session:
        node = await authenticate_node(session, message)
        row = await owned_challenge(session, commit.challenge_id, node.id, lock=True)
        if row.committed_at is not None:  # in time (revealed, maybe finished since) or late (failed)
            raise Conflict(f"challenge {row.id} is already committed", code="already_committed")
        if row.state != ISSUED:
            raise Conflict(f"challenge {row.id} is over ({row.state}: {row.reason})", code="challenge_closed")
        seconds = max(now - row.issued_at, 1e-6)
        row.committed_at, row.root, row.measured_gflops = now, commit.root, measured_gflops(row.n, seconds)
        if seconds > row.time_limit:
            finish(row, node, passed=False, config=config, now=now,
                   reason=f"late: committed after {seconds:.2f}s; the bound for {row.device_class} at n={row.n} is "
                          f"{row.time_limit:.2f}s ({row.measured_gflops:.0f} GFLOPS measured)")
            answer = CommitAnswer(challenge_id=row.id, result=result_of(row, node))
        else:
            row.state, row.revealed_at, row.r_seed = REVEALED, now, secrets.token_hex(16)
            row.rows = sorted(secrets.SystemRandom().sample(range(row.n), min(OPENED_ROWS, row.n)))
            answer = CommitAnswer(challenge_id=row.id, reveal=ChallengeReveal(
                challenge_id=row.id, r_seed=row.r_seed, rows=row.rows,
                proof_deadline=now + config.challenge_proof_timeout))
    return respond(answer)


@routes.post("/v1/challenges/{challenge_id}/proof")
@describe(auth="node", body=ChallengeProof, signed=PROOF_KIND, response=ChallengeResult)
async def prove_challenge(request: web.Request) -> web.Response:
    """Answer the reveal: C·r and the opened rows with Merkle paths. Returns the result; a wrong answer fails the
    challenge and unverifies the node. Bodies up to 2 MiB (proto.challenge.MAX_PROOF_BYTES)."""
    message = await read_signed(request, PROOF_KIND, ChallengeProof, MAX_PROOF_BYTES)
    proof = message.payload
    same_path_id(request, proof.challenge_id)
    config = request.app[CONFIG]
    # Cheap, read-only checks first: only the challenged node, with a fresh nonce, gets its proof checked.
    async with request.app[SESSIONS]() as session:
        node = await authenticate_node(session, message, record_nonce=False)
        row = await owned_challenge(session, proof.challenge_id, node.id)
        if row.state == ISSUED:
            raise Conflict(f"challenge {row.id} has no commitment yet: commit first", code="not_committed")
        if row.state != REVEALED:
            raise Conflict(f"challenge {row.id} is over ({row.state}: {row.reason})", code="challenge_closed")
        seed, n, root, r_seed, rows, revealed_at = row.seed, row.n, row.root, row.r_seed, list(row.rows), \
            row.revealed_at
    if time.time() > revealed_at + config.challenge_proof_timeout:
        verdict = Verdict(False, f"the proof came more than {config.challenge_proof_timeout:g}s after the reveal")
    else:
        try:
            async with request.app[VERIFY_SLOTS]:
                verdict = await asyncio.get_running_loop().run_in_executor(
                    None, _check, seed, n, root, r_seed, rows, proof)
        except ValueError as e:
            raise Unprocessable(f"malformed proof: {e}", code="bad_proof") from None
    now = time.time()
    async with request.app[SESSIONS].begin() as session:
        node = await authenticate_node(session, message)
        row = await owned_challenge(session, proof.challenge_id, node.id, lock=True)
        if row.state != REVEALED:  # another request or the sweep ended it while we were checking
            raise Conflict(f"challenge {row.id} is over ({row.state}: {row.reason})", code="challenge_closed")
        passed, reason = verdict.passed, verdict.reason
        device, size = node_device(node)
        if passed and (device.name != row.device_class or size != row.n):
            passed, reason = False, (f"the node re-registered as {device.name} during a challenge for "
                                     f"{row.device_class}")
        if passed:
            reason = (f"{reason}; committed in {row.committed_at - row.issued_at:.2f}s of {row.time_limit:.2f}s "
                      f"({row.measured_gflops:.0f} GFLOPS measured)")
        finish(row, node, passed=passed, reason=reason, config=config, now=now)
        result = result_of(row, node)
    return respond(result)


@routes.get("/v1/nodes/{node_id}/challenges")
@describe(auth="anyone", response=NodeChallenges)
async def node_challenges(request: web.Request) -> web.Response:
    """A node's verification standing and its latest GPU challenges, newest first."""
    node_id = request.match_info["node_id"]
    async with request.app[SESSIONS]() as session:
        # The challenges first, then the node: under READ COMMITTED (PostgreSQL) each statement sees the latest
        # commit, so a sweep committing in between leaves the node's counters at least as new as the rows shown
        # (the other order showed a failed challenge beside a node that had not failed one yet).
        rows = (await session.scalars(select(Challenge).where(Challenge.node_id == node_id)
                                      .order_by(Challenge.issued_at.desc()).limit(HISTORY))).all()
        node = await session.get(Node, node_id)
        if node is None:
            raise NotFound(f"node {node_id} is not registered", code="unknown_node")
    return respond(NodeChallenges, {
        "node_id": node.id, "verified": bool(node.verified), "challenges_passed": node.challenges_passed or 0,
        "challenges_failed": node.challenges_failed or 0, "measured_gflops": node.measured_gflops,
        "last_challenge_at": node.last_challenge_at, "next_challenge_at": node.next_challenge_at,
        "challenges": [challenge_json(r) for r in rows]})


# ---------------------------------------------------------------------------------------------------- sweep


async def expire_challenges(sessions: async_sessionmaker[AsyncSession], config: CoordinatorConfig,
                            now: float) -> list[str]:
    """Fail challenges whose node never committed (time limit plus COMMIT_GRACE) or never proved (proof
    timeout). Returns their ids."""
    async with sessions.begin() as session:
        rows = (await session.scalars(select(Challenge).where(or_(
            and_(Challenge.state == ISSUED, Challenge.issued_at + Challenge.time_limit < now - COMMIT_GRACE),
            and_(Challenge.state == REVEALED, Challenge.revealed_at < now - config.challenge_proof_timeout),
        )).with_for_update())).all()
        for row in rows:
            node = await session.get(Node, row.node_id)
            if row.state == ISSUED:
                reason = (f"no commitment within the time limit ({row.time_limit:.2f}s for {row.device_class} at "
                          f"n={row.n})")
            else:
                reason = f"no proof within {config.challenge_proof_timeout:g}s of the reveal"
            finish(row, node, passed=False, reason=reason, config=config, now=now)
    return [row.id for row in rows]


async def sweep(app: web.Application) -> None:
    """Every loop_interval: expire unanswered challenges. One failed pass never ends the loop."""
    config = app[CONFIG]
    while True:
        try:
            if app[LEADERSHIP].leader:  # one coordinator of a database sweeps (coordinator.leader)
                await expire_challenges(app[SESSIONS], config, time.time())
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("challenge sweep failed; retrying")
        await asyncio.sleep(config.loop_interval)


async def _challenges(app: web.Application) -> AsyncIterator[None]:
    app[VERIFY_SLOTS] = asyncio.Semaphore(VERIFY_CONCURRENCY)
    task = asyncio.create_task(sweep(app), name="challenge-sweep")
    try:
        yield
    finally:
        await tasks.stop(task)


def setup_routes(app: web.Application) -> None:
    """The challenge routes, and the sweep (after the database in cleanup_ctx: call this after it is added)."""
    app.add_routes(routes)
    app.cleanup_ctx.append(_challenges)
