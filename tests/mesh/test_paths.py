"""The path selector as a state machine: exact decisions for scripted sequences of facts (no I/O, no clock)."""

from __future__ import annotations

import pytest
from gpuswarm.mesh.paths import (
    PathFacts,
    PathPhase,
    PathState,
    PathTimings,
    next_path,
    start,
    wants_probe,
    with_candidates,
)

A, B, C = "10.250.0.2:51820", "10.250.0.3:51820", "192.168.1.7:51820"
T = PathTimings(try_timeout_s=3, check_timeout_s=1, probe_interval_s=2, lost_probes=2, stale_after_s=1000,
                recheck_s=60, rtt_margin=0.2, rtt_window=3)
STALE = PathTimings(try_timeout_s=3, check_timeout_s=1, probe_interval_s=2, lost_probes=2, stale_after_s=30)
TRYING, SETTLED, CHECKING = PathPhase.TRYING, PathPhase.SETTLED, PathPhase.CHECKING


def step(state: PathState, now: float, *, device: str | None = "same", handshake: float | None = None,
         rtt: float | None = None, probed: bool | None = None, timings: PathTimings = T) -> PathState:
    """One tick. By default the device holds the state's endpoint (what the node configured) and an echo was
    sent when the state wanted one; `rtt` is its answer in ms."""
    facts = PathFacts(now=now, device_endpoint=state.endpoint if device == "same" else device,
                      latest_handshake=handshake,
                      probed=wants_probe(state, now, timings) if probed is None else probed, rtt_ms=rtt)
    return next_path(state, facts, timings)


def trace(state: PathState, ticks: list[dict]) -> tuple[PathState, list[tuple[PathPhase, str | None]]]:
    seen = []
    for tick in ticks:
        state = step(state, **tick)
        seen.append((state.phase, state.endpoint))
    return state, seen


def settled_on(endpoint: str, candidates=(A, B, C), rtt: float = 1.0, at: float = 0.0) -> PathState:
    state = start(candidates, at)
    while state.endpoint != endpoint:
        state = step(state, at := at + T.try_timeout_s)
    state = step(state, at, rtt=rtt)
    assert (state.phase, state.endpoint, state.rtt_ms) == (SETTLED, endpoint, rtt)
    return state


def test_a_new_peer_tries_its_first_candidate():
    state = start([A, B, A, C], now=100.0)
    assert (state.phase, state.endpoint, state.queue, state.since) == (TRYING, A, (B, C), 100.0)
    assert state.candidates == (A, B, C)  # duplicates dropped, order kept
    assert wants_probe(state, 100.0, T) and state.rtt_ms is None


def test_a_peer_without_candidates_waits_and_sends_nothing():
    state = start([], now=0.0)
    assert state.endpoint is None and not wants_probe(state, 0.0, T)
    assert step(state, 50.0, device=None) == state


def test_dead_first_candidate_then_the_second_answers():
    state, seen = trace(start([A, B], 0.0), [
        dict(now=1.0), dict(now=2.0),  # A: no echo, no handshake
        dict(now=3.0),  # the deadline: on to B
        dict(now=4.0), dict(now=5.0),  # B: still nothing (the handshake retry has not gone out yet)
        dict(now=6.0, rtt=0.8),  # B answers through the tunnel
    ])
    assert seen == [(TRYING, A), (TRYING, A), (TRYING, B), (TRYING, B), (TRYING, B), (SETTLED, B)]
    assert state.chosen == B and state.rtt_ms == 0.8 and state.answers_icmp
    assert state.next_check == 6.0 + T.recheck_s
    assert "no answer from 10.250.0.2:51820 within 3 s" in step(start([A, B], 0.0), 3.0).reason


def test_an_echo_that_waited_for_the_handshake_settles_but_gives_no_rtt():
    state = step(start([A, B], 0.0), 1.0, handshake=0.9, rtt=450.0)
    assert (state.phase, state.endpoint, state.rtt_ms, state.answers_icmp) == (SETTLED, A, None, True)
    assert step(state, 3.0, handshake=0.9, rtt=0.4).rtt_ms == 0.4  # the next probe measures the path


def test_a_handshake_after_the_switch_settles_without_rtt_and_an_older_one_does_not():
    state = step(start([A, B], 0.0), 3.0)  # on B since 3.0
    assert step(state, 4.0, handshake=2.5).phase is TRYING  # completed before B was configured: not B's
    settled = step(state, 4.0, handshake=3.5)
    assert (settled.phase, settled.endpoint, settled.rtt_ms, settled.answers_icmp) == (SETTLED, B, None, False)


def test_when_every_candidate_fails_the_round_starts_again():
    _, seen = trace(start([A, B, C], 0.0), [dict(now=t) for t in (3.0, 6.0, 9.0, 12.0)])
    assert [e for _, e in seen] == [B, C, A, B]


def test_settled_path_probes_every_interval_and_takes_the_median_rtt():
    state = settled_on(A, rtt=2.0, at=0.0)
    assert not wants_probe(state, 1.0, T) and wants_probe(state, 2.0, T)
    state = step(state, 2.0, rtt=4.0)
    assert state.rtt_ms == 3.0  # the median of 2 and 4
    assert step(state, 3.0).rtt_ms == 3.0  # not probed: unchanged
    state, _ = trace(state, [dict(now=4.0, rtt=60.0), dict(now=6.0, rtt=1.0)])
    assert state.samples == (4.0, 60.0, 1.0) and state.rtt_ms == 4.0  # a spike moves the median little
    state = step(state, 8.0, rtt=1.0)
    assert state.samples == (60.0, 1.0, 1.0) and state.rtt_ms == 1.0  # the window keeps the latest 3


def test_lost_echoes_fail_over_to_the_next_candidate_then_wrap_around():
    state = settled_on(B, rtt=1.0, at=0.0)  # settled at t=3 on the second candidate
    state, seen = trace(state, [
        dict(now=5.0),  # one echo lost: ordinary loss
        dict(now=6.0, probed=False),
        dict(now=7.0),  # two in a row: dead; the candidates after B come first
        dict(now=10.0),  # C does not answer: then those before B
        dict(now=13.0),  # A does not answer: B itself last (a link that blinked may come back)
        dict(now=16.0),  # a finished round starts again from the best candidate
    ])
    assert seen == [(SETTLED, B), (SETTLED, B), (TRYING, C), (TRYING, A), (TRYING, B), (TRYING, A)]
    failed = step(step(settled_on(B, rtt=1.0), 5.0), 7.0)
    assert failed.reason == "2 echoes over 10.250.0.3:51820 unanswered"
    assert failed.chosen is None and B not in failed.rtts


def test_an_answer_resets_the_lost_count():
    state = settled_on(A, rtt=1.0)
    state, seen = trace(state, [dict(now=2.0), dict(now=4.0, rtt=1.0), dict(now=6.0), dict(now=8.0, rtt=1.0)])
    assert seen == [(SETTLED, A)] * 4


def test_a_peer_that_never_answered_echoes_fails_over_only_on_a_stale_handshake():
    state = step(start([A, B], 0.0), 1.0, handshake=0.5)  # settled by handshake: no echo ever answered
    assert (state.phase, state.answers_icmp) == (SETTLED, False)
    for now in (3.0, 5.0, 7.0, 9.0):
        state = step(state, now, handshake=0.5, timings=STALE)  # echoes go unanswered: no conclusion
    assert (state.phase, state.endpoint) == (SETTLED, A)
    assert step(state, 30.0, handshake=0.5, timings=STALE).phase is SETTLED  # 29.5 s: not yet stale
    dead = step(state, 31.0, handshake=0.5, timings=STALE)
    assert (dead.phase, dead.endpoint) == (TRYING, B)
    assert dead.reason == "no handshake over 10.250.0.2:51820 for 30 s"


def test_a_fresh_handshake_keeps_a_settled_path_alive():
    state = step(start([A, B], 0.0), 1.0, handshake=0.5)
    assert step(state, 60.0, handshake=45.0, timings=STALE).phase is SETTLED


def test_recheck_moves_to_a_clearly_faster_candidate():
    state = settled_on(A, rtt=10.0)  # settled at t=0; next check at 60
    assert wants_probe(state, 60.0, T)
    state, seen = trace(state, [
        dict(now=60.0, rtt=10.0),  # the settled probe, then the check starts
        dict(now=61.0, rtt=9.0),  # B: 9 ms, not 20 % better
        dict(now=62.0, rtt=3.0),  # C: 3 ms
    ])
    assert seen == [(CHECKING, B), (CHECKING, C), (SETTLED, C)]
    assert state.chosen == C and state.rtt_ms == 3.0 and state.next_check == 62.0 + T.recheck_s
    assert state.samples == (3.0,)  # a new path's RTT starts from its check
    assert state.reason == "re-check: 192.168.1.7:51820 answers in 3.00 ms (was 10.00 ms)"


def test_recheck_keeps_the_settled_path_within_the_margin():
    state = settled_on(A, rtt=10.0)
    state, seen = trace(state, [dict(now=60.0, rtt=10.0), dict(now=61.0, rtt=8.5), dict(now=62.0, rtt=8.1)])
    assert seen == [(CHECKING, B), (CHECKING, C), (SETTLED, A)]
    assert state.rtts == {A: 10.0, B: 8.5, C: 8.1} and state.samples == (10.0, 10.0)


def test_a_candidate_that_fails_a_check_sits_out_the_next_one():
    state = settled_on(A, rtt=10.0, candidates=(A, B))
    state, seen = trace(state, [dict(now=60.0, rtt=10.0), dict(now=60.5), dict(now=61.0)])
    assert seen == [(CHECKING, B), (CHECKING, B), (SETTLED, A)]  # B silent for check_timeout_s: back to A
    assert state.check_failures == {B: (1, 61.0 + 2 * 60 - 30)}
    state = step(state, 121.0, rtt=10.0)  # the next check: B sits it out, so nothing to measure
    assert (state.phase, state.endpoint, state.next_check) == (SETTLED, A, 181.0)
    state = step(state, 181.0, rtt=10.0)  # and the one after measures B again
    assert (state.phase, state.endpoint) == (CHECKING, B)


def test_no_recheck_for_a_single_candidate_or_a_peer_without_echoes():
    state = settled_on(A, candidates=(A,))
    assert step(state, 60.0, rtt=1.0).phase is SETTLED
    quiet = step(start([A, B], 0.0), 1.0, handshake=0.5)
    assert step(quiet, 61.0, handshake=60.0).phase is SETTLED


def test_roaming_is_adopted_and_confirmed():
    state = step(start([A, B], 0.0), 1.0)  # trying A, which is dead
    roamed = step(state, 2.0, device=B)  # the peer reached us from B: WireGuard switched
    assert (roamed.phase, roamed.endpoint, roamed.queue) == (TRYING, B, (A,))
    assert roamed.reason == "the peer roamed to 10.250.0.3:51820"
    settled = step(roamed, 3.0, rtt=0.5)
    assert (settled.phase, settled.endpoint, settled.rtt_ms) == (SETTLED, B, 0.5)


def test_roaming_to_an_unlisted_address_then_losing_it_goes_back_to_the_candidates():
    state = settled_on(A, candidates=(A, B))
    nat = "203.0.113.9:40000"
    state = step(step(state, 1.0, device=nat), 2.0, rtt=1.0)
    assert (state.phase, state.endpoint, state.chosen) == (SETTLED, nat, nat)
    state = step(step(state, 4.0), 6.0)  # two lost echoes: the NAT mapping is gone
    assert (state.phase, state.endpoint, state.queue) == (TRYING, A, (B,))


def test_unchanged_candidates_keep_the_state():
    state = settled_on(B)
    assert with_candidates(state, [A, B, C], 9.0) is state


def test_new_candidates_keep_a_path_still_offered():
    state = settled_on(B)
    moved = with_candidates(state, [B, C], 9.0)
    assert (moved.phase, moved.endpoint, moved.candidates, moved.rtt_ms) == (SETTLED, B, (B, C), 1.0)
    trying = with_candidates(start([A, B], 0.0), [A, C], 1.0)
    assert (trying.endpoint, trying.queue) == (A, (C,))  # B dropped, C joins the round


def test_a_peer_that_moved_starts_over_from_its_new_first_candidate():
    state = settled_on(A)
    moved = with_candidates(state, [C, B], 9.0)
    assert (moved.phase, moved.endpoint, moved.queue, moved.since) == (TRYING, C, (B,), 9.0)
    assert moved.answers_icmp  # what we learnt about the peer stays


def test_new_candidates_abort_a_check_back_to_the_settled_path():
    checking = step(settled_on(A, rtt=10.0), 60.0, rtt=10.0)
    assert (checking.phase, checking.endpoint) == (CHECKING, B)
    back = with_candidates(checking, [A, C], 60.5)
    assert (back.phase, back.endpoint, back.rtt_ms) == (SETTLED, A, 10.0)


def test_timings_are_checked():
    with pytest.raises(ValueError):
        PathTimings(try_timeout_s=0)
    with pytest.raises(ValueError):
        PathTimings(lost_probes=0)
    with pytest.raises(ValueError):
        PathTimings(rtt_margin=1.0)
    with pytest.raises(ValueError):
        PathTimings(rtt_window=0)
