"""Peer-attested contribution claims: one signed claim per hivemind epoch, exchanged inside the all-reduce round.

Owns, for one training process: the meter of work done since the last claim (fed by the training loop), signing
this node's `ContributionClaim` for an epoch (at most one per (job, node, epoch)), attaching it to the gradient
all-reduce as the averager's gather data, and turning each finished round into a `RoundResult`: this node's claim
first, then every groupmate's claim that verifies. A round that failed or was cancelled shares nothing and resets
nothing; an epoch that ended without a successful round (the node stepped alone) yields a solo result. What
happens to a result (an event on stdout, a report to the coordinator) is the caller's `on_round` callback; a
round that failed (not one hivemind cancelled) is told to the optional `on_failed` callback, for metrics.

How it hooks into hivemind 1.1.12 (`hivemind.Optimizer(grad_averager_factory=attestor.averager_factory)`):
- Gather data is serialised when a round is scheduled (`DecentralizedAverager.step`, averaging/averager.py:403-404)
  and travels with matchmaking (averaging/matchmaking.py:196), so the claim must be fixed at schedule time. The
  Optimizer pre-schedules with `grad_averager.schedule_step(timeout=...)` (optim/optimizer.py:567), and
  `GradientAverager.step(control=None)` schedules through `self.schedule_step` too (optim/grad_averager.py:182):
  overriding `schedule_step` covers both.
- A round's StepControl resolves to `{PeerID: gathered data}` (averaging/averager.py:517-531). Controls are kept
  here and polled from the training thread (`poll()` after each `optimizer.step()`), not handled in MPFuture
  callbacks, so the meter and the epoch bookkeeping have one owner.

This module must not touch the model, the optimizer's state or the daemon: it only reads `optimizer.local_epoch`.
Everything it receives from peers is untrusted; bad data is dropped (logged at debug), never raised.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from gpuswarm.proto.models import CLAIM_KIND, ContributionClaim
from gpuswarm.proto.signing import (
    MAX_CLOCK_SKEW,
    SignedEnvelope,
    canonical_json,
    node_id_for,
    public_key_b64,
    sign,
    verify,
)
from hivemind.averaging.control import StepControl
from hivemind.optim.grad_averager import GradientAverager

logger = logging.getLogger(__name__)

# A groupmate's claim is checked for signature and payload, not for the 120 s freshness of a request: a claim
# for an epoch is signed once and reused while that epoch's round is retried, so it may be minutes old. Replays
# are caught by (job, node, epoch), which the coordinator credits at most once.
CLAIM_MAX_AGE = 3600.0
MAX_CLAIM_BYTES = 4096  # a canonical claim payload is about 300 bytes; a peer cannot make our reports huge
MAX_COMPUTE_SECONDS = 86_400 * 366  # ContributionClaim's bound
MAX_COUNT = 2**53
CLAIM_HISTORY = 64  # signed claims kept per epoch, so an epoch seen again never gets a second, different claim
MAX_CLAIMS_PER_ROUND = 64  # RoundReport's bound; in practice a group is far smaller


@dataclass(frozen=True)
class Mark:
    """The meter's totals at one moment: a claim covers the work between two marks."""

    samples: int = 0
    steps: int = 0
    compute_seconds: float = 0.0
    time: float = 0.0


class ContributionMeter:
    """What the training loop did: running totals, and the mark up to which a shared or reported claim covers
    them. Work recorded after a claim was signed stays unclaimed until the next claim."""

    def __init__(self, now: float | None = None) -> None:
        self.samples = self.steps = 0
        self.compute_seconds = 0.0
        self.claimed = Mark(time=time.time() if now is None else now)

    def record(self, samples: int, compute_seconds: float, steps: int = 1) -> None:
        if samples < 0 or steps < 0 or not math.isfinite(compute_seconds) or compute_seconds < 0:
            raise ValueError(f"bad work record: {samples} samples, {steps} steps, {compute_seconds} s")
        self.samples += samples
        self.steps += steps
        self.compute_seconds += compute_seconds

    def mark(self, now: float | None = None) -> Mark:
        return Mark(self.samples, self.steps, self.compute_seconds, time.time() if now is None else now)

    @property
    def unclaimed_samples(self) -> int:
        return self.samples - self.claimed.samples

    @property
    def has_unclaimed(self) -> bool:
        return self.samples > self.claimed.samples or self.steps > self.claimed.steps

    def settle(self, covered: Mark) -> None:
        """Drop what a claim covered. Idempotent, and never moves back: settling an older claim again is a no-op."""
        if covered.samples >= self.claimed.samples and covered.time >= self.claimed.time:
            self.claimed = covered


@dataclass(frozen=True)
class SignedClaim:
    epoch: int
    envelope: SignedEnvelope
    covered: Mark  # the meter's totals when it was signed

    @property
    def wire(self) -> dict[str, Any]:
        return self.envelope.model_dump(mode="json")


@dataclass(frozen=True)
class RoundResult:
    """One finished round as this node saw it. `claims` are envelope dicts, this node's own first."""

    epoch: int
    solo: bool
    claims: list[dict[str, Any]]
    group_size: int = 1  # members in the round, whether or not their claims verified


def verified_claim(data: Any, *, sender: str, job_id: str, now: float | None = None) -> SignedEnvelope:
    """A groupmate's gathered data as a verified claim envelope; ValueError (or a pydantic error) otherwise.

    Checks: a well-formed envelope of kind CLAIM_KIND, a small payload, a valid signature, a valid
    ContributionClaim for this job, signed by the node it names, sent by the hivemind peer it names, and no window
    ending in the future (the coordinator refuses a whole report over such a claim, so one bad groupmate could
    otherwise void this node's own report)."""
    if not isinstance(data, dict):
        raise ValueError(f"gathered data is a {type(data).__name__}, not a claim envelope")
    envelope = SignedEnvelope.model_validate(data)
    if len(canonical_json(envelope.payload)) > MAX_CLAIM_BYTES:
        raise ValueError("claim payload is too large")
    signer = verify(envelope, kind=CLAIM_KIND, now=now, max_skew=CLAIM_MAX_AGE)
    claim = ContributionClaim.model_validate(envelope.payload)
    if claim.node_id != signer:
        raise ValueError(f"claim for node {claim.node_id} is signed by node {signer}")
    if claim.job_id != job_id:
        raise ValueError(f"claim is for job {claim.job_id}, not {job_id}")
    if claim.peer_id != sender:
        raise ValueError(f"claim names peer {claim.peer_id!r} but came from {sender!r}")
    if claim.window_end > (time.time() if now is None else now) + MAX_CLOCK_SKEW:
        raise ValueError("claim window ends in the future")
    return envelope


def collect_claims(gathered: Any, own: SignedClaim, job_id: str, now: float | None = None) -> list[dict[str, Any]]:
    """Every verified claim of a round's group, this node's own first, at most one per node. Never raises."""
    own_node = own.envelope.payload["node_id"]
    claims, seen = [own.wire], {own_node}
    if not isinstance(gathered, dict):
        logger.debug("round result is a %s, not gathered data; keeping only our own claim", type(gathered).__name__)
        return claims
    for peer, data in gathered.items():
        sender = str(peer)
        if sender == own.envelope.payload.get("peer_id"):
            continue  # our own data, as the group leader relayed it: we already hold the original
        try:
            envelope = verified_claim(data, sender=sender, job_id=job_id, now=now)
        except Exception as e:  # a groupmate's bad data is its problem, never ours
            logger.debug("ignoring gathered data from %s: %s", sender, e)
            continue
        node = envelope.payload["node_id"]
        if len(claims) >= MAX_CLAIMS_PER_ROUND:
            logger.debug("more than %d claims in one round; dropping the rest", MAX_CLAIMS_PER_ROUND)
            break
        if node in seen:
            logger.debug("ignoring a second claim for node %s from %s", node, sender)
            continue
        seen.add(node)
        claims.append(envelope.model_dump(mode="json"))
    return claims


def _round_outcome(control: StepControl) -> tuple[Any, BaseException | None]:
    """(gathered data, None) of a round that succeeded, (None, error) of one that failed, (None, None) of one that
    was cancelled: hivemind cancels a pre-scheduled round it skips (no other peer) or abandons at shutdown."""
    if control.cancelled():
        return None, None
    try:
        return control.result(0), None
    except (Exception, asyncio.CancelledError) as e:
        logger.debug("gradient round failed: %r", e)
        return None, e


def key_signer(private_key: Ed25519PrivateKey) -> tuple[Callable[[dict[str, Any]], SignedEnvelope], str]:
    """A claim signer that holds the key itself (the daemon's, and tests'), and the node id it signs as."""
    return functools.partial(sign, private_key, CLAIM_KIND), node_id_for(public_key_b64(private_key.public_key()))


class ClaimAttestor:
    """Signs this node's claim for each epoch, tracks the rounds that carry it, and reports finished rounds.

    Call `attach(epoch_source)` once the optimizer exists, `meter.record(...)` for each local batch, `poll()`
    after each `optimizer.step()`, and `finish()` after the optimizer shut down. `on_round` runs in the thread
    that calls `poll()` (or that scheduled a round) and must not raise."""

    def __init__(
        self,
        signer: Callable[[dict[str, Any]], SignedEnvelope],
        node_id: str,
        job_id: str,
        peer_id: str,
        on_round: Callable[[RoundResult], None],
        *,
        meter: ContributionMeter | None = None,
        inflate: float = 1.0,
        on_failed: Callable[[int, BaseException], None] | None = None,
    ) -> None:
        if not (math.isfinite(inflate) and inflate > 0):
            raise ValueError(f"claim inflation factor must be a positive number, not {inflate}")
        # `signer` turns a claim payload into its envelope signed with the node's key; in a training process it
        # asks the daemon (gpuswarm.node.worker.DaemonSigner), so the key never enters the process.
        self.signer, self.node_id, self.job_id, self.peer_id, self.on_round = signer, node_id, job_id, peer_id, on_round
        self.on_failed = on_failed  # (epoch, error) of each round that failed; for metrics, must not raise
        self.meter = meter if meter is not None else ContributionMeter()
        self.inflate = inflate  # test-only fault injection: see gpuswarm.node.worker
        self._epoch_source: Callable[[], int] | None = None
        self._open_epoch: int | None = None
        self._claims: dict[int, SignedClaim] = {}
        self._pending: list[tuple[StepControl, SignedClaim]] = []
        self._closed: set[int] = set()  # epochs that ended while a round carrying their claim was still running
        self._reported: set[int] = set()
        self._lock = threading.Lock()

    @property
    def averager_factory(self) -> Callable[..., AttestingGradientAverager]:
        """For `hivemind.Optimizer(grad_averager_factory=...)`."""
        return functools.partial(AttestingGradientAverager, attestor=self)

    def attach(self, epoch_source: Callable[[], int]) -> None:
        """Where the current epoch comes from: `lambda: optimizer.local_epoch`."""
        with self._lock:
            self._epoch_source = epoch_source
            self._open_epoch = epoch_source()

    # --- claims -----------------------------------------------------------------------------------------------

    def claim_for_round(self) -> SignedClaim:
        """This node's claim for the current epoch: signed on first use, the same claim on every retry."""
        with self._lock:
            epoch = self._advance_epoch()  # an epoch that just ended leaves the meter before this claim is signed
            return self._claims.get(epoch) or self._sign(epoch)

    def _sign(self, epoch: int, now: float | None = None) -> SignedClaim:
        covered = self.meter.mark(now)
        start = self.meter.claimed
        samples = min(MAX_COUNT, round((covered.samples - start.samples) * self.inflate))
        compute = min(MAX_COMPUTE_SECONDS, round((covered.compute_seconds - start.compute_seconds) * self.inflate, 4))
        claim = ContributionClaim(
            job_id=self.job_id, node_id=self.node_id, epoch=epoch, samples=samples,
            steps=covered.steps - start.steps, compute_seconds=max(0.0, compute),
            window_start=start.time, window_end=max(covered.time, start.time), peer_id=self.peer_id,
        )
        signed = SignedClaim(epoch, self.signer(claim.model_dump(mode="json")), covered)
        self._claims[epoch] = signed
        for old in sorted(self._claims)[:-CLAIM_HISTORY]:
            del self._claims[old]
        return signed

    def gather_data(self, claim: SignedClaim) -> Any:
        """What this node sends its groupmates in a round: the claim envelope as a plain dict (msgpack-able)."""
        return claim.wire

    # --- rounds -----------------------------------------------------------------------------------------------

    def track(self, control: StepControl, claim: SignedClaim) -> None:
        with self._lock:
            self._pending.append((control, claim))

    def poll(self) -> None:
        """Report rounds that finished and epochs that ended alone. Cheap; call after every optimizer step."""
        results: list[RoundResult] = []
        failures: list[tuple[int, BaseException]] = []
        with self._lock:
            self._collect_finished(results, failures)
            self._advance_epoch()
            self._resolve_closed(results)
        self._deliver(results, failures)

    def finish(self) -> None:
        """After the optimizer shut down: report what finished, and report an ended epoch whose round never
        finished as solo (its claim is already off the meter, so it must be reported somehow)."""
        results: list[RoundResult] = []
        failures: list[tuple[int, BaseException]] = []
        with self._lock:
            self._collect_finished(results, failures)
            self._advance_epoch()
            self._pending = [(c, claim) for c, claim in self._pending if claim.epoch not in self._closed]
            self._resolve_closed(results)
        self._deliver(results, failures)

    def _collect_finished(self, results: list[RoundResult], failures: list[tuple[int, BaseException]]) -> None:
        still_pending = []
        for control, claim in self._pending:
            if not control.done():
                still_pending.append((control, claim))
                continue
            gathered, error = _round_outcome(control)
            if error is not None:
                failures.append((claim.epoch, error))
            if gathered is None:
                continue  # a failed or cancelled round shares nothing and resets nothing
            if claim.epoch in self._reported:
                logger.debug("another successful round for epoch %d; already reported", claim.epoch)
                continue
            claims = collect_claims(gathered, claim, self.job_id)
            size = len(gathered) if isinstance(gathered, dict) else 1
            logger.debug("round for epoch %d: %d members, %d verified claims", claim.epoch, size, len(claims))
            self._reported.add(claim.epoch)
            self.meter.settle(claim.covered)
            results.append(RoundResult(claim.epoch, solo=False, claims=claims, group_size=size))
        self._pending = still_pending

    def _advance_epoch(self) -> int:
        if self._epoch_source is None:
            raise RuntimeError("ClaimAttestor.attach(epoch_source) was not called")
        epoch = self._epoch_source()
        previous, self._open_epoch = self._open_epoch, epoch
        if previous is None or previous == epoch or previous in self._reported:
            return epoch
        claim = self._claims.get(previous)
        if claim is None:
            if not self.meter.has_unclaimed:
                return epoch
            claim = self._sign(previous)  # the epoch ended with no round scheduled at all: the node was alone
        # Whatever becomes of a round still carrying this claim, the claim will be reported (shared or solo), so
        # its work leaves the meter now and cannot also land in the next epoch's claim.
        self.meter.settle(claim.covered)
        self._closed.add(previous)
        return epoch

    def _resolve_closed(self, results: list[RoundResult]) -> None:
        running = {claim.epoch for _, claim in self._pending}
        for epoch in sorted(self._closed):
            if epoch in running:
                continue  # a round carrying this epoch's claim may still succeed: wait for it
            self._closed.discard(epoch)
            if epoch in self._reported:
                continue
            claim = self._claims.get(epoch)
            if claim is None:
                continue
            self._reported.add(epoch)
            results.append(RoundResult(epoch, solo=True, claims=[claim.wire]))
        if len(self._reported) > 4 * CLAIM_HISTORY:
            self._reported = set(sorted(self._reported)[-CLAIM_HISTORY:])

    def _deliver(self, results: list[RoundResult], failures: list[tuple[int, BaseException]]) -> None:
        for epoch, error in failures if self.on_failed is not None else ():
            try:
                self.on_failed(epoch, error)
            except Exception:
                logger.exception("the failed-round callback failed for epoch %d", epoch)
        for result in results:
            try:
                self.on_round(result)
            except Exception:
                logger.exception("the round callback failed for epoch %d", result.epoch)


class AttestingGradientAverager(GradientAverager):
    """hivemind's GradientAverager that sends this node's signed claim as the gather data of every round it
    schedules, and hands each round's StepControl to its ClaimAttestor.

    The class name is part of the wire protocol: hivemind names an averager's RPC handlers after its class
    (p2p/servicer.py:147-150, "<prefix>::AttestingGradientAverager.rpc_join_group"), so only peers running a class
    of this exact name can form a group with each other. Never rename it, and never run a job's nodes with
    different averager classes."""

    def __init__(self, *args: Any, attestor: ClaimAttestor, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Set after the averager's process has started, so the key never travels into that process.
        self.attestor = attestor

    def schedule_step(self, scheduled_time: float | None = None, **kwargs: Any) -> StepControl:
        claim = None
        if kwargs.get("gather") is None:  # a caller's own gather data wins; hivemind.Optimizer passes none
            try:
                claim = self.attestor.claim_for_round()
                kwargs["gather"] = self.attestor.gather_data(claim)
            except Exception:
                logger.exception("could not sign a claim; this round carries none")
        control = super().schedule_step(scheduled_time, **kwargs)
        if claim is not None:
            self.attestor.track(control, claim)
        return control
