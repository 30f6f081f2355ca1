"""DiLoCo's inner loop (gpuswarm.node.local_updates) against a real hivemind.Optimizer: the pseudo-gradient that
hivemind averages is exactly anchor − inner, whichever step ends the epoch and whatever the batch sizes; two real
peers end a round with the same parameters, the outer step of their averaged deltas; and the round-size choice
stays in its bounds, grows by at most half a round after a slow one, and every member of a group reads the same
pace from the group's claims."""

from __future__ import annotations

import math
import threading
import time

import hivemind
import pytest
import torch
from gpuswarm.node.local_updates import (
    MAX_INNER_STEPS,
    MAX_ROUND_COMPUTE,
    MAX_ROUND_GROWTH,
    MAX_ROUND_PASSES,
    MIN_INNER_STEPS,
    MIN_ROUND_COMPUTE,
    LocalUpdates,
    choose_inner_steps,
    first_round_estimate,
    group_pace,
    group_samples,
    lands_on_inner,
    lone_inner_steps,
    lone_round_steps,
    next_inner_steps,
    round_steps_cap,
    steps_to_target,
    swarm_samples_after,
)
from gpuswarm.proto.trainer import OptimizerSpec
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.mpfuture import MPFuture
from hypothesis import given
from hypothesis import strategies as st

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module", autouse=True)
def hivemind_backend():
    """Start hivemind's MPFuture backend (and torch's shared-memory manager) before any test, so that conftest's
    guard against leftover children never kills the manager under a later test (see tests/node/test_attest.py)."""
    MPFuture()
    yield


class Peer:
    """One member: an anchor that hivemind owns with the outer optimizer, and the inner loop over a copy."""

    def __init__(self, dht, run_id: str, target: int, outer: OptimizerSpec, seed: int = 0):
        torch.manual_seed(seed)
        self.anchor = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
        torch.manual_seed(0)  # every peer starts from the same anchor, as a run's members do
        with torch.no_grad():
            for p in self.anchor:
                p.copy_(torch.randn_like(p))
        # The trainer's side of the inner loop: the workload's optimizer over its own copy of the parameters.
        self.local = LocalUpdates(self.anchor)
        self.inner = [torch.nn.Parameter(p.detach().clone()) for p in self.anchor]
        self.inner_optimizer = OptimizerSpec(name="adamw", lr=0.05).build(self.inner)
        self.optimizer = hivemind.Optimizer(
            dht=dht, run_id=run_id, target_batch_size=target, batch_size_per_step=4, params=self.anchor,
            optimizer=outer.build, matchmaking_time=1.0, averaging_timeout=10.0,
            tracker_opts={"private_key": RSAPrivateKey(), "max_refresh_period": 0.5},
            averager_opts={"request_timeout": 1.0}, verbose=False)

    def step(self, batch: int, rng: torch.Generator) -> None:
        """One chunk of inner steps (one step here) handed over as the worker takes it."""
        for p in self.inner:
            p.grad = torch.randn(p.shape, generator=rng)
        self.inner_optimizer.step()
        with torch.no_grad():
            self.local.flat.copy_(torch.cat([p.reshape(-1) for p in self.inner]))
        self.local.advance(batch)
        self.optimizer.step(batch_size=batch)

    def restart(self) -> None:
        self.local.restart()
        with torch.no_grad():
            for p, a in zip(self.inner, self.anchor, strict=True):
                p.copy_(a)


def test_a_solo_round_with_outer_sgd_at_rate_one_lands_exactly_on_the_inner_parameters():
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    peer = Peer(dht, "local_updates_solo", target=40, outer=OptimizerSpec(name="sgd", lr=1.0))
    try:
        rng = torch.Generator().manual_seed(1)
        batches = [4, 4, 3, 5, 4, 2, 6, 4, 4, 4, 4, 4]  # uneven batches: hivemind weighs them; the sum must not
        inner_before = None
        for batch in batches:
            epoch = peer.optimizer.local_epoch
            inner_before = [p.detach().clone() for p in peer.local.params]
            peer.step(batch, rng)
            if peer.optimizer.local_epoch != epoch:
                break
        else:
            pytest.fail("the epoch never ended")
        # anchor − 1.0 × (anchor − inner) == inner: the step that ended the epoch included its own inner step. Up to
        # float rounding: the telescoped pseudo-gradient and hivemind's division leave it a rounding away.
        inner_at_end = [p.detach().clone() for p in peer.local.params]
        assert not all(torch.equal(a, b) for a, b in zip(inner_before, inner_at_end, strict=True))
        for anchor, inner in zip(peer.anchor, inner_at_end, strict=True):
            torch.testing.assert_close(anchor.detach(), inner, rtol=1e-5, atol=1e-5)
        # What the worker does after a round it took alone with this outer step: the anchor is the inner
        # parameters, bit for bit, so the trainer starts the next round exactly where it stopped.
        assert lands_on_inner(OptimizerSpec(name="sgd", lr=1.0))
        peer.local.land_on_inner()
        for anchor, inner in zip(peer.anchor, inner_at_end, strict=True):
            assert torch.equal(anchor.detach(), inner)
        peer.restart()
        for anchor, inner in zip(peer.anchor, peer.local.params, strict=True):
            assert torch.equal(anchor.detach(), inner.detach())
    finally:
        peer.optimizer.shutdown()
        dht.shutdown()


def test_only_plain_sgd_at_rate_one_lands_a_solo_round_on_the_inner_parameters():
    assert lands_on_inner(OptimizerSpec(name="sgd", lr=1.0))  # mode "diloco"'s default, and "fedavg"'s outer step
    assert not lands_on_inner(OptimizerSpec(name="sgd", lr=0.7))
    assert not lands_on_inner(OptimizerSpec(name="sgd", lr=1.0, momentum=0.9, nesterov=True))
    assert not lands_on_inner(OptimizerSpec(name="sgd", lr=1.0, weight_decay=0.01))
    assert not lands_on_inner(OptimizerSpec(name="adam", lr=1.0))


def test_two_peers_end_a_round_on_the_same_parameters_the_outer_step_of_their_average():
    root = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    dhts = [hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=root.get_visible_maddrs())
            for _ in range(2)]
    peers = [Peer(dht, "local_updates_pair", target=64, outer=OptimizerSpec(name="sgd", lr=1.0), seed=i)
             for i, dht in enumerate(dhts)]
    inner_at_end: list[list[torch.Tensor] | None] = [None, None]
    errors: list[BaseException] = []

    def train(i: int) -> None:
        try:
            rng = torch.Generator().manual_seed(10 + i)
            peer = peers[i]
            peer.step(4, rng)  # a tracker publishes its peer once it has samples: both must see two peers first
            while peer.optimizer.tracker.global_progress.num_peers < 2:
                time.sleep(0.1)
            for _ in range(200):
                epoch = peer.optimizer.local_epoch
                peer.step(4, rng)
                if peer.optimizer.local_epoch != epoch:
                    inner_at_end[i] = [p.detach().clone() for p in peer.local.params]
                    return
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    try:
        threads = [threading.Thread(target=train, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        assert not errors, errors
        assert all(inner is not None for inner in inner_at_end), "a peer never ended the round"
        # Both took the same averaged outer step: same anchor, and (outer SGD at rate 1) it lies between the two
        # peers' inner parameters, at their sample-weighted mean, not at either one's own.
        for a, b in zip(peers[0].anchor, peers[1].anchor, strict=True):
            torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-4, atol=1e-4)
        own = [torch.allclose(peers[0].anchor[0].detach(), inner[0], atol=1e-4) for inner in inner_at_end]
        assert not any(own), "the round did not average: a peer kept its own inner parameters"
    finally:
        for peer in peers:
            peer.optimizer.shutdown()
        for dht in [*dhts, root]:
            dht.shutdown()


@given(step=st.floats(1e-4, 100), round_=st.floats(0, 1000), fixed=st.none() | st.integers(1, 100_000))
def test_inner_steps_stay_in_bounds_and_a_fixed_count_wins(step, round_, fixed):
    h = choose_inner_steps(step, round_, fixed)
    if fixed is not None:
        assert h == fixed
        return
    assert MIN_INNER_STEPS <= h <= MAX_INNER_STEPS
    if MIN_INNER_STEPS < h < MAX_INNER_STEPS:
        # the round's compute is between the bounds and at least three times the averaging, within one step
        assert MIN_ROUND_COMPUTE <= h * step < MAX_ROUND_COMPUTE + step
        assert h * step >= min(3 * round_, MAX_ROUND_COMPUTE) - 1e-9


@given(step=st.floats(1e-3, 10), outside=st.floats(0, 100))
def test_a_lone_member_takes_the_longest_rounds(step, outside):
    # Its rounds average nothing: each buys only an evaluation. Under 0.4 CPU, tinylm's lone member took rounds of
    # 8 steps (MIN_ROUND_COMPUTE) and evaluated two and a half times as often as the plain loop.
    h = next_inner_steps(None, None, (step, outside), True, None, lambda: None)
    assert h == lone_inner_steps(step)
    if MIN_INNER_STEPS < h < MAX_INNER_STEPS:
        assert MAX_ROUND_COMPUTE <= h * step < MAX_ROUND_COMPUTE + step
    assert h >= choose_inner_steps(step, outside)  # never shorter than a member of a group with that averaging


@given(step=st.floats(1e-3, 10), a=st.floats(0, 100), b=st.floats(0, 100))
def test_a_slower_round_never_means_fewer_inner_steps(step, a, b):
    slow, fast = max(a, b), min(a, b)
    assert choose_inner_steps(step, slow) >= choose_inner_steps(step, fast)


def test_nonsense_timings_fall_back_to_the_minimum():
    assert choose_inner_steps(0.0, 5.0) == MIN_INNER_STEPS
    assert choose_inner_steps(float("nan"), 5.0) == MIN_INNER_STEPS
    assert choose_inner_steps(0.1, float("inf")) == choose_inner_steps(0.1, 0.0)


def test_the_first_round_estimate_grows_with_the_model_and_the_members():
    assert first_round_estimate(1_000_000, 3.0, 1) == 3.0  # alone: no transfer
    assert first_round_estimate(1_000_000, 3.0, 4) > first_round_estimate(1_000_000, 3.0, 2) > 3.0
    assert first_round_estimate(10_000_000, 3.0, 2) > first_round_estimate(1_000_000, 3.0, 2)


paces = st.tuples(st.floats(1e-3, 10), st.floats(0, 100))


@given(a=paces, b=paces, own=paces, last=st.integers(1, 1000))
def test_two_groups_of_one_swarm_take_the_same_count_and_meet_again(a, b, own, last):
    # Four members met as two pairs, each with its own pace: both pairs keep the count of the last round of all.
    counts = {next_inner_steps(None, pace, own, False, last, lambda: None) for pace in (a, b)}
    assert counts == {last}
    # A round of all sets a new count from that group's pace, alike on every member.
    assert next_inner_steps(None, a, own, True, last, lambda: None) == choose_inner_steps(*a)


@given(group=st.none() | paces, own=paces, whole=st.booleans(), last=st.none() | st.integers(1, 1000),
       agreed=st.none() | st.integers(1, 1000), fixed=st.integers(1, 100_000))
def test_next_inner_steps_a_fixed_count_wins_and_a_newcomer_takes_the_published_one(group, own, whole, last, agreed,
                                                                                   fixed):
    assert next_inner_steps(fixed, group, own, whole, last, lambda: agreed) == fixed
    h = next_inner_steps(None, group, own, whole, None, lambda: agreed)
    if whole and group:
        assert h == choose_inner_steps(*group)
    elif whole:  # a lone member: its own step time, and its rounds average nothing
        assert h == lone_inner_steps(own[0])
    else:
        assert h == (agreed or choose_inner_steps(*(group or own)))


def test_a_round_of_several_members_takes_at_most_eight_passes_over_a_members_share():
    # The digits demo: 1,437 training images over 3 members, batches of 32. Its steps took a few milliseconds, so
    # rounds were MAX_INNER_STEPS long (67 passes over each member's share).
    assert round_steps_cap(1437, 32, 3) == 120 == math.ceil(MAX_ROUND_PASSES * 1437 / 3 / 32)
    assert round_steps_cap(1437, 32, 1) is None  # one node averages nothing: its rounds are only evaluations
    assert round_steps_cap(None, 32, 3) is None and round_steps_cap(0, 32, 3) is None  # no train_size
    assert round_steps_cap(10, 32, 8) == MIN_INNER_STEPS
    fast = (0.004, 0.9)  # the demo's pace: 4 ms a step, 0.9 s of averaging
    assert next_inner_steps(None, fast, fast, True, None, lambda: None) == MAX_INNER_STEPS
    assert next_inner_steps(None, fast, fast, True, None, lambda: None, most=120) == 120
    assert next_inner_steps(None, None, fast, False, None, lambda: 500, most=120) == 120
    assert next_inner_steps(None, None, fast, True, None, lambda: None, most=120) == lone_inner_steps(0.004)
    assert next_inner_steps(700, fast, fast, True, None, lambda: None, most=120) == 700  # the job's own count


@given(group=st.none() | paces, own=paces, whole=st.booleans(), last=st.none() | st.integers(1, 1000),
       agreed=st.none() | st.integers(1, 1000), most=st.integers(MIN_INNER_STEPS, 5000))
def test_no_round_of_several_members_passes_the_cap(group, own, whole, last, agreed, most):
    h = next_inner_steps(None, group, own, whole, last, lambda: agreed, most)
    assert h == next_inner_steps(None, group, own, whole, last, lambda: agreed) if whole and not group \
        else h == min(most, next_inner_steps(None, group, own, whole, last, lambda: agreed))


@given(pace=paces, own=paces, last=st.integers(1, 1000))
def test_a_member_that_missed_a_round_its_leader_counted_whole_takes_the_leaders_count(pace, own, last):
    # The leader assembled both and counts the round whole; the follower's join timed out and it went alone.
    leader = next_inner_steps(None, pace, own, True, last, lambda: None)
    assert next_inner_steps(None, None, own, False, last, lambda: leader) == leader
    # Nobody published yet: the count of the last round of all.
    assert next_inner_steps(None, None, own, False, last, lambda: None) == last


claim_payloads = st.lists(st.fixed_dictionaries({
    "steps": st.integers(0, 10_000), "compute_seconds": st.floats(0, 1e4),
    "window_start": st.floats(0, 1e6), "window_end": st.floats(0, 1e6)}), max_size=8)


@given(claims=claim_payloads, order=st.randoms())
def test_every_member_reads_the_same_pace_from_its_group(claims, order):
    shuffled = list(claims)
    order.shuffle(shuffled)
    assert group_pace(shuffled) == group_pace(claims)  # members hold the claims in different orders


@given(honest=claim_payloads.filter(lambda c: sum(x["steps"] > 0 and x["compute_seconds"] > 0 for x in c) >= 2),
       steps=st.integers(1, 10_000), compute=st.floats(1e-6, 1e9))
def test_one_liar_moves_the_step_time_no_further_than_an_honest_members(honest, steps, compute):
    counted = [c["compute_seconds"] / c["steps"] for c in honest if c["steps"] > 0 and c["compute_seconds"] > 0]
    step, _ = group_pace([*honest, {"steps": steps, "compute_seconds": compute, "window_start": 0.0,
                                    "window_end": compute}])
    assert min(counted) <= step <= max(counted)


def test_the_pace_of_a_group_and_what_it_ignores():
    members = [{"steps": 100, "compute_seconds": 10.0, "window_start": 10.0, "window_end": 24.0},
               {"steps": 50, "compute_seconds": 10.0, "window_start": 10.0, "window_end": 23.0},
               {"steps": 10, "compute_seconds": 10.0, "window_start": 10.0, "window_end": 26.0}]
    assert group_pace(members) == (0.2, 3.0)  # median seconds per step; the slowest member's idle time
    # A round slowed by a failure: the idle time read is at most what makes the next round 1.5 times as long.
    slowed = [{**m, "window_end": m["window_end"] + 20.0} for m in members]
    assert group_pace(slowed) == (0.2, MAX_ROUND_GROWTH * 10.0 / 3)
    assert group_pace([]) is None
    assert group_pace([{"steps": 0, "compute_seconds": 1.0, "window_start": 0.0, "window_end": 1.0},
                       {"steps": 5, "compute_seconds": float("nan"), "window_start": 0.0, "window_end": 1.0},
                       {"steps": "5", "compute_seconds": 1.0}]) is None


def test_a_member_that_loaded_the_swarms_state_counts_the_samples_the_others_published():
    # The demo's failure: the others took 62 inner steps a round (3 members, batch 32: 5,952 samples); this member
    # had set 1000 (96,000), missed a round and loaded the state of epoch 3 from a peer.
    assert swarm_samples_after(11_904, 1, 96_000, published=17_856) == 17_856
    assert swarm_samples_after(11_904, 1, 96_000) == 107_904  # what it counted before: past 60 passes of 1,437
    assert swarm_samples_after(20_000, 2, 96_000, published=17_856) == 20_000  # never fewer than it had
    # An averaged round counts its group's claims, each further epoch (none here) the target.
    claims = [{"samples": 1984}, {"samples": 1984}, {"samples": 2016}, {"samples": True}, {"samples": -5}, {}]
    assert group_samples(claims) == 5984
    assert swarm_samples_after(100, 1, 96_000, averaged=group_samples(claims)) == 6084
    assert swarm_samples_after(100, 3, 50, averaged=10) == 210


@given(before=st.integers(0, 10**9), epochs=st.integers(1, 50), target=st.integers(1, 10**6),
       averaged=st.none() | st.integers(0, 10**7), published=st.none() | st.integers(0, 10**10))
def test_the_swarms_count_of_samples_never_goes_back(before, epochs, target, averaged, published):
    assert swarm_samples_after(before, epochs, target, averaged, published) >= before


@given(n=st.integers(1, 1000), computes=st.lists(st.floats(1e-3, 1e4), min_size=1, max_size=8),
       idle=st.lists(st.floats(0, 1e5), min_size=8, max_size=8))
def test_one_slow_round_makes_the_next_at_most_half_as_long_again(n, computes, idle):
    # A whole round: every member took the same n steps, in its own compute time, and waited any time at all.
    claims = [{"steps": n, "compute_seconds": c, "window_start": 0.0, "window_end": c + i}
              for c, i in zip(computes, idle, strict=False)]
    step, averaging = group_pace(claims)
    least = choose_inner_steps(step, 0.0)  # MIN_ROUND_COMPUTE of steps, within the step bounds
    assert choose_inner_steps(step, averaging) <= max(math.ceil(MAX_ROUND_GROWTH * n) + 1, least)


def test_steps_to_target_follows_the_line_through_the_last_two_evaluations():
    targets = [("val_bpb", "<=", 3.75)]
    # 0.5 lower over 320 samples (10 steps of 32): 0.25 to go is 5 steps
    assert steps_to_target(targets, (0, {"val_bpb": 4.5}), (320, {"val_bpb": 4.0}), 32) == 5
    assert steps_to_target([("accuracy", ">=", 0.9)], (0, {"accuracy": 0.5}), (100, {"accuracy": 0.8}), 10) == 4
    # the first of several targets counts
    both = [*targets, ("accuracy", ">=", 0.9)]
    assert steps_to_target(both, (0, {"val_bpb": 5.0, "accuracy": 0.5}), (10, {"val_bpb": 4.0, "accuracy": 0.89}),
                           1) == 1
    # no line to follow: no earlier evaluation, no progress, met already, a metric missing or not finite
    assert steps_to_target(targets, None, (320, {"val_bpb": 3.95}), 32) is None
    assert steps_to_target(targets, (0, {"val_bpb": 3.95}), (320, {"val_bpb": 3.97}), 32) is None
    assert steps_to_target(targets, (0, {"val_bpb": 4.0}), (320, {"val_bpb": 3.7}), 32) is None
    assert steps_to_target(targets, (0, {"loss": 4.0}), (320, {"loss": 3.95}), 32) is None
    assert steps_to_target(targets, (0, {"val_bpb": float("nan")}), (320, {"val_bpb": 3.95}), 32) is None
    assert steps_to_target(targets, (320, {"val_bpb": 4.0}), (320, {"val_bpb": 3.95}), 32) is None


def test_a_lone_round_is_cut_to_the_line_and_stays_short_once_the_target_is_near():
    short = MIN_ROUND_COMPUTE / 0.5  # steps in MIN_ROUND_COMPUTE seconds at 0.5 s a step
    assert lone_round_steps(60, None, False, 0.5) == 60  # far from the target, no line: a whole round
    assert lone_round_steps(60, 90, False, 0.5) == 60  # the line points beyond the round
    assert lone_round_steps(60, 12, False, 0.5) == 12  # the line cuts it
    assert lone_round_steps(60, 1, False, 0.5) == MIN_INNER_STEPS
    # near (a round was cut): short rounds, whether the metric stalled (no line) or the line points far again
    assert lone_round_steps(60, None, True, 0.5) == short
    assert lone_round_steps(60, 90, True, 0.5) == short
    assert lone_round_steps(60, 45, True, 0.5) == short
    assert lone_round_steps(60, 5, True, 0.5) == 5
    assert lone_round_steps(8, None, True, 0.5) == 8
    assert lone_round_steps(60, None, True, float("nan")) == 60  # no step time: the whole round


@given(a=st.floats(-1e6, 1e6), b=st.floats(-1e6, 1e6), threshold=st.floats(-1e6, 1e6),
       samples=st.integers(1, 10**7), batch=st.integers(1, 4096), op=st.sampled_from(["<=", ">="]))
def test_steps_to_target_is_a_positive_count_only_while_moving_towards_an_unmet_target(a, b, threshold, samples,
                                                                                       batch, op):
    steps = steps_to_target([("m", op, threshold)], (0, {"m": a}), (samples, {"m": b}), batch)
    towards = b < a if op == "<=" else b > a
    unmet = b > threshold if op == "<=" else b < threshold
    if steps is None:  # or the line is so flat that the steps overflow a float (a move of a subnormal amount)
        assert not (towards and unmet) or not math.isfinite(abs(b - threshold) / abs(a - b) * samples / batch)
    else:
        assert towards and unmet and steps >= 1


def test_steps_to_target_of_a_metric_that_moved_a_subnormal_amount_is_none():
    """Found by the property above: 1.0 / 2.2e-309 overflows to inf, which math.ceil cannot take (OverflowError in
    the worker's loop)."""
    assert steps_to_target([("m", "<=", -1.0)], (0, {"m": 0.0}), (1, {"m": -2.225073858507203e-309}), 1) is None
