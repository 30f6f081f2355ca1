"""Path choice for one WireGuard peer: which of its candidate endpoints to configure, as a pure state machine.

A peer's candidates come from the coordinator, best first: the addresses the peer reported (its interfaces and
listen port), then the address the coordinator saw it from. WireGuard holds one endpoint per peer, so the node
tries candidates one at a time, keeps the first that works, fails over when it dies, and now and then measures
the others to move to the one with the lowest RTT.

Evidence that the configured endpoint works, per tick:
- an ICMP echo to the peer's mesh address through the tunnel was answered (this also gives the path's RTT):
  only the configured endpoint carries our echo there, so a reply proves that direction and measures the path
  the data takes, WireGuard's own cost included. WireGuard has no ping of its own, and a handshake proves
  nothing about a switch made inside a live session (it needs no new handshake), so the echo is the main signal;
- or a handshake completed after the endpoint was configured (the fallback when the peer answers no ICMP).

States (`PathPhase`), and what moves them (one comment per case in `next_path`):
- TRYING: a candidate is configured and on trial; it settles on evidence, or the next candidate is tried after
  `try_timeout_s`. When the round runs out it starts again from the first candidate.
- SETTLED: the path works; probed every `probe_interval_s`. It fails over to the next candidate after
  `lost_probes` unanswered echoes in a row (only for a peer that has answered echoes before), or when no
  handshake happened for `stale_after_s`; every `recheck_s` it starts a CHECKING round.
- CHECKING: inside a live session, each other candidate is configured for at most `check_timeout_s` to measure
  its RTT; then the lowest RTT wins (it must beat the settled path by `rtt_margin`, so noise does not flap it).
  A candidate that fails a check sits out the next checks, for twice as long each time.
- Roaming: WireGuard itself moves a peer's endpoint to the address an authenticated packet came from. The
  device's endpoint then differs from the one configured; the state machine adopts it and puts it on trial.

Pure: no I/O, no clock (the caller passes `now`, in Unix seconds like WireGuard's handshake times), no imports of
the mesh's other modules. The node's `MeshLink` runs the loop: it probes, reads the device, calls `next_path`,
and writes the endpoint it returns.
"""

from __future__ import annotations

import enum
import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace


class PathPhase(enum.StrEnum):
    TRYING = "trying"
    SETTLED = "settled"
    CHECKING = "checking"


@dataclass(frozen=True)
class PathTimings:
    """Thresholds in seconds. The defaults follow WireGuard's own timers; tests shrink them."""

    # A fresh peer's first handshake initiation goes out when traffic (our echo, or the persistent keepalive)
    # asks for it; wireguard-go retransmits it after REKEY_TIMEOUT (5 s) plus up to 1/3 s of jitter. 6 s covers
    # the first initiation and one retransmit, so one lost packet does not make us drop a good path.
    try_timeout_s: float = 6.0
    # In a live session, a switched endpoint needs no handshake: a working one answers an echo within one RTT.
    # 2 s bounds the traffic lost while a re-check tries a dead candidate.
    check_timeout_s: float = 2.0
    # One 64-byte echo per settled peer every 5 s: fresh RTTs, quick failure detection, negligible load.
    probe_interval_s: float = 5.0
    # Three unanswered echoes in a row (about 15 s) mean the path is dead; one or two are ordinary loss.
    lost_probes: int = 3
    # The backstop for peers that answer no ICMP. With persistent keepalive (25 s) on both ends, traffic flows
    # at least every 25 s, so WireGuard re-handshakes every REKEY_AFTER_TIME (120 s) + 25 s + a 5 s retry:
    # a live path's latest handshake is never older than about 150 s. At REJECT_AFTER_TIME (180 s) the session
    # is unusable anyway, so a path with no handshake for 180 s is dead.
    stale_after_s: float = 180.0
    # How often a settled peer's other candidates are measured for a lower RTT.
    recheck_s: float = 300.0
    # A checked candidate replaces the settled path only when its RTT is this fraction lower.
    rtt_margin: float = 0.2
    # The settled path's RTT is the median of its latest echoes (25 s of them at the default interval): a
    # scheduling hiccup or a queue behind a burst inflates one sample, never most of them.
    rtt_window: int = 5
    # Longest a candidate that keeps failing checks sits out, in units of `recheck_s`.
    max_check_backoff: int = 16

    def __post_init__(self) -> None:
        for name in ("try_timeout_s", "check_timeout_s", "probe_interval_s", "stale_after_s", "recheck_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"{name} must be a number of seconds > 0, not {value!r}")
        if not isinstance(self.lost_probes, int) or self.lost_probes < 1:
            raise ValueError(f"lost_probes must be an integer >= 1, not {self.lost_probes!r}")
        if not 0 <= self.rtt_margin < 1:
            raise ValueError(f"rtt_margin is in [0, 1), not {self.rtt_margin!r}")
        if not isinstance(self.rtt_window, int) or self.rtt_window < 1:
            raise ValueError(f"rtt_window must be an integer >= 1, not {self.rtt_window!r}")
        if not isinstance(self.max_check_backoff, int) or self.max_check_backoff < 1:
            raise ValueError(f"max_check_backoff must be an integer >= 1, not {self.max_check_backoff!r}")


@dataclass(frozen=True)
class PathFacts:
    """What the node saw this tick for one peer."""

    now: float
    device_endpoint: str | None  # the endpoint the WireGuard device holds now (ours, or where the peer roamed)
    latest_handshake: float | None  # Unix time of the latest completed handshake, None if none
    probed: bool = False  # an echo went through the tunnel this tick, to the endpoint in the state
    rtt_ms: float | None = None  # its round-trip time; None when it was not answered (or not probed)


@dataclass(frozen=True)
class PathState:
    """One peer's path. Immutable: every transition returns a new state (mappings are never changed in place)."""

    candidates: tuple[str, ...]
    phase: PathPhase
    endpoint: str | None  # the endpoint to configure (or adopted from roaming); None: no candidate known
    since: float  # when `endpoint` was configured
    queue: tuple[str, ...] = ()  # candidates still to try in this round (TRYING) or to measure (CHECKING)
    chosen: str | None = None  # the path known to work: SETTLED's endpoint; the one CHECKING returns to
    rtts: Mapping[str, float] = field(default_factory=dict)  # ms per endpoint: the settled path's RTT (median
    # of `samples`), and the latest check of each other candidate
    samples: tuple[float, ...] = ()  # the latest echo RTTs over `chosen`, oldest first
    lost: int = 0  # echoes unanswered in a row on a settled path
    answers_icmp: bool = False  # the peer has answered an echo, so unanswered ones mean something
    last_probe: float = -math.inf
    next_check: float = math.inf
    check_failures: Mapping[str, tuple[int, float]] = field(default_factory=dict)  # endpoint: (failures, skip
    # re-checks until this time)
    reason: str = ""  # why the state last changed path or phase, for logs and `gpuswarm mesh status`

    @property
    def rtt_ms(self) -> float | None:
        """The peer's RTT over its settled path; None while no path is settled or none was measured."""
        return self.rtts.get(self.endpoint) if self.phase is PathPhase.SETTLED and self.endpoint else None


def _unique(candidates: Iterable[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(candidates))


def _without(mapping: Mapping[str, object], key: str | None) -> dict:
    return {k: v for k, v in mapping.items() if k != key}


def start(candidates: Iterable[str], now: float) -> PathState:
    """A new peer: try its candidates from the first."""
    candidates = _unique(candidates)
    return PathState(candidates=candidates, phase=PathPhase.TRYING, endpoint=candidates[0] if candidates else None,
                     since=now, queue=candidates[1:], reason="new peer")


def with_candidates(state: PathState, candidates: Iterable[str], now: float) -> PathState:
    """The coordinator announced a different candidate list for the peer."""
    candidates = _unique(candidates)
    if candidates == state.candidates:
        return state
    rtts = {k: v for k, v in state.rtts.items() if k in candidates or k == state.endpoint}
    failures = {k: v for k, v in state.check_failures.items() if k in candidates}
    roamed = state.endpoint is not None and state.endpoint not in state.candidates
    if state.phase is PathPhase.CHECKING:
        # A measuring round is moot: back to the settled path if it is still a candidate.
        if state.chosen in candidates:
            return replace(state, candidates=candidates, phase=PathPhase.SETTLED, endpoint=state.chosen, since=now,
                           queue=(), rtts=rtts, check_failures=failures, lost=0, reason="candidates changed")
    elif state.endpoint in candidates or (roamed and state.phase is PathPhase.SETTLED):
        # The current path is still offered (or is a working address the peer roamed to): keep it; a TRYING
        # round goes on with what is left of its queue, and any new candidate joins the end.
        queue = ()
        if state.phase is PathPhase.TRYING:
            kept = tuple(c for c in state.queue if c in candidates)
            added = tuple(c for c in candidates if c not in state.candidates and c != state.endpoint)
            queue = _unique(kept + added)
        return replace(state, candidates=candidates, queue=queue, rtts=rtts, check_failures=failures)
    # The peer no longer reports the address in use (it moved): start over from its first candidate.
    return replace(start(candidates, now), rtts=rtts, check_failures=failures, answers_icmp=state.answers_icmp,
                   reason="the peer's candidates changed")


def wants_probe(state: PathState, now: float, timings: PathTimings) -> bool:
    """Whether to send the peer an echo this tick: every tick while a candidate is on trial, else every
    `probe_interval_s`."""
    if state.endpoint is None:
        return False
    if state.phase is PathPhase.SETTLED:
        return now - state.last_probe >= timings.probe_interval_s
    return True


def _round_after(state: PathState, endpoint: str | None) -> tuple[str, ...]:
    """Failover order: the candidates after `endpoint`, then those before it, then `endpoint` itself last (a link
    that blinked may come back). A roamed-to endpoint that died is not tried again."""
    if endpoint in state.candidates:
        i = state.candidates.index(endpoint)
        return state.candidates[i + 1:] + state.candidates[:i] + (endpoint,)
    return state.candidates


def _try_next(state: PathState, now: float, reason: str) -> PathState:
    queue = state.queue or state.candidates  # a finished round starts again from the best candidate
    if not queue:  # nothing else to try: try the same endpoint again
        return replace(state, phase=PathPhase.TRYING, since=now, lost=0, reason=reason)
    return replace(state, phase=PathPhase.TRYING, endpoint=queue[0], queue=queue[1:], since=now, lost=0,
                   reason=reason)


def _settle(state: PathState, now: float, timings: PathTimings, rtt_ms: float | None, reason: str) -> PathState:
    rtts = _without(state.rtts, state.endpoint)  # an older measurement of this endpoint is not news
    if rtt_ms is not None:
        rtts[state.endpoint] = rtt_ms
    return replace(state, phase=PathPhase.SETTLED, chosen=state.endpoint, queue=(), rtts=rtts, lost=0,
                   samples=() if rtt_ms is None else (rtt_ms,),
                   answers_icmp=state.answers_icmp or rtt_ms is not None, next_check=now + timings.recheck_s,
                   reason=reason)


def _start_check(state: PathState, now: float, timings: PathTimings) -> PathState:
    queue = tuple(c for c in state.candidates
                  if c != state.endpoint and now >= state.check_failures.get(c, (0, -math.inf))[1])
    if not state.answers_icmp or not queue:
        # Nothing to measure (a single candidate, or all sitting out), or no way to measure: look again later.
        return replace(state, next_check=now + timings.recheck_s)
    return replace(state, phase=PathPhase.CHECKING, endpoint=queue[0], queue=queue[1:], since=now,
                   reason="periodic re-check")


def _checked(state: PathState, now: float, timings: PathTimings, rtt_ms: float | None) -> PathState:
    """Record the measured candidate's result, then measure the next or pick the winner."""
    rtts, failures = dict(state.rtts), dict(state.check_failures)
    if rtt_ms is None:
        rtts.pop(state.endpoint, None)
        count = failures.get(state.endpoint, (0, 0.0))[0] + 1
        backoff = min(2 ** count, timings.max_check_backoff)
        failures[state.endpoint] = (count, now + backoff * timings.recheck_s - timings.recheck_s / 2)
    else:
        rtts[state.endpoint] = rtt_ms
        failures.pop(state.endpoint, None)
    state = replace(state, rtts=rtts, check_failures=failures)
    if state.queue:
        return replace(state, endpoint=state.queue[0], queue=state.queue[1:], since=now)
    settled_rtt = rtts.get(state.chosen)
    measured = {c: r for c, r in rtts.items() if c in state.candidates and c != state.chosen}
    winner, reason = state.chosen, "re-check: the settled path is still the fastest"
    if measured:
        best = min(measured, key=lambda c: (measured[c], state.candidates.index(c)))
        if settled_rtt is None or measured[best] < settled_rtt * (1 - timings.rtt_margin):
            winner = best
            reason = f"re-check: {best} answers in {measured[best]:.2f} ms" + (
                f" (was {settled_rtt:.2f} ms)" if settled_rtt is not None else "")
    samples = state.samples if winner == state.chosen else (measured[winner],)
    return replace(state, phase=PathPhase.SETTLED, endpoint=winner, chosen=winner, since=now, queue=(), lost=0,
                   samples=samples, next_check=now + timings.recheck_s, reason=reason)


def next_path(state: PathState, facts: PathFacts, timings: PathTimings) -> PathState:
    """The peer's next path state; the caller configures `result.endpoint` wherever the device holds another."""
    now = facts.now
    if facts.probed:
        state = replace(state, last_probe=now)

    # Roaming: an authenticated packet from the peer came from another address, and WireGuard now sends there.
    # The peer evidently reaches us from it; put it on trial (the echo of the next tick settles it) instead of
    # fighting WireGuard. This tick's echo cannot be told apart between the two addresses, so it is not counted.
    if facts.device_endpoint is not None and facts.device_endpoint != state.endpoint:
        fallback = () if state.chosen in (None, facts.device_endpoint) else (state.chosen,)
        queue = _unique(fallback + tuple(c for c in state.candidates if c != facts.device_endpoint))
        return replace(state, phase=PathPhase.TRYING, endpoint=facts.device_endpoint, since=now, queue=queue,
                       chosen=None, samples=(), lost=0, reason=f"the peer roamed to {facts.device_endpoint}")

    answered = facts.probed and facts.rtt_ms is not None
    shook = facts.latest_handshake is not None and facts.latest_handshake > state.since

    if state.phase is PathPhase.TRYING:
        if state.endpoint is None:
            # No candidate at all: wait for the coordinator to name one, or for the peer to reach us (roaming).
            return state
        if answered:
            # The echo came back through the tunnel: this candidate carries traffic. Keep it. If a handshake
            # completed meanwhile, the echo waited in WireGuard's queue for it: its time is not the path's RTT.
            return _settle(replace(state, answers_icmp=True), now, timings, None if shook else facts.rtt_ms,
                           f"{state.endpoint} answered")
        if shook:
            # A handshake completed after we configured it: the path works (no RTT yet).
            return _settle(state, now, timings, None, f"handshake over {state.endpoint}")
        if now - state.since >= timings.try_timeout_s:
            # Nothing within the deadline: the next candidate (a finished round starts over).
            return _try_next(replace(state, rtts=_without(state.rtts, state.endpoint)), now,
                             f"no answer from {state.endpoint} within {timings.try_timeout_s:g} s")
        return state  # still waiting for the handshake

    if state.phase is PathPhase.CHECKING:
        if answered:
            return _checked(state, now, timings, facts.rtt_ms)  # measured; the next candidate or the verdict
        if now - state.since >= timings.check_timeout_s:
            return _checked(state, now, timings, None)  # this candidate does not work; it sits out a while
        return state

    # SETTLED.
    rtts, lost, samples = state.rtts, state.lost, state.samples
    if answered:
        samples = (*samples, facts.rtt_ms)[-timings.rtt_window:]
        rtts, lost = {**rtts, state.endpoint: statistics.median(samples)}, 0
    elif facts.probed:
        lost += 1
    state = replace(state, rtts=rtts, lost=lost, samples=samples, answers_icmp=state.answers_icmp or answered)
    if state.answers_icmp and lost >= timings.lost_probes:
        # A peer that answers echoes stopped answering: the path died. Fail over to the next candidate.
        return _fail_over(state, now, f"{lost} echoes over {state.endpoint} unanswered")
    last_sign = max(state.since, facts.latest_handshake or -math.inf)
    if now - last_sign > timings.stale_after_s:
        # No handshake for longer than a live session allows: the session expired, so the path is dead.
        return _fail_over(state, now, f"no handshake over {state.endpoint} for {now - last_sign:.0f} s")
    if now >= state.next_check:
        # Time to measure the other candidates (inside the live session, each briefly).
        return _start_check(state, now, timings)
    return state


def _fail_over(state: PathState, now: float, reason: str) -> PathState:
    order = _round_after(state, state.endpoint)
    state = replace(state, rtts=_without(state.rtts, state.endpoint), chosen=None, samples=(), queue=order)
    return _try_next(state, now, reason)


__all__ = ["PathFacts", "PathPhase", "PathState", "PathTimings", "next_path", "start", "wants_probe",
           "with_candidates"]
