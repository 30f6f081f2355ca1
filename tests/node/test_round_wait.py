"""`membership.wait_for_round`: a DiLoCo member that took its share of a round's steps holds until every live
member's share is in (the round's target, re-read while it waits), the swarm's epoch moved on, training stops, or
its limit passes; meanwhile it reports no rate to the swarm. The optimizer is a stand-in with what the wait reads
and writes, around hivemind's real `PerformanceEMA`: the real tracker is exercised end to end by
tests/integration/test_local_swarm.py. How often a tracker reads the swarm's progress (`membership.reading_often`)
is tested on hivemind's real `ProgressTracker` over a real DHT, and so is `membership.wait_for_tracker`, the hold
after a member's first step until its tracker has seen the run's peers."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import hivemind
import pytest
from gpuswarm.node.membership import (
    REFRESH_COMPUTING,
    REFRESH_WAITING,
    reading_often,
    wait_for_round,
    wait_for_tracker,
)
from hivemind.optim.progress_tracker import ProgressTracker
from hivemind.utils.performance_ema import PerformanceEMA


class Tracker:
    def __init__(self, samples: int, target: int, global_epoch: int):
        self.global_progress = SimpleNamespace(samples_accumulated=samples, next_fetch_time=0.0)
        self.target_batch_size, self.global_epoch = target, global_epoch
        self.max_refresh_period, self.global_state_updated = REFRESH_COMPUTING, threading.Event()
        self.performance_ema = PerformanceEMA()
        self.performance_ema.samples_per_second = 500.0
        self.local_progress = SimpleNamespace(epoch=3, samples_accumulated=40)
        self.reported: list[tuple[int, int, float]] = []

    def report_local_progress(self, epoch: int, samples: int) -> None:
        self.reported.append((epoch, samples, self.performance_ema.samples_per_second))


def optimizer(samples: int = 40, target: int = 120, global_epoch: int = 3) -> SimpleNamespace:
    return SimpleNamespace(tracker=Tracker(samples, target, global_epoch), local_epoch=3,
                           due_if_group_full=lambda: False)


def waited(opt: SimpleNamespace, stop: threading.Event | None = None, limit: float = 10.0, change=None,
           after: float = 1.5, target=None) -> float:
    if change is not None:
        threading.Timer(after, change).start()
    began = time.monotonic()
    wait_for_round(opt, stop or threading.Event(), target, limit)
    return time.monotonic() - began


def test_it_returns_at_once_when_every_share_is_in_or_the_swarm_moved_on():
    assert waited(optimizer(samples=120)) < 1.0
    assert waited(optimizer(global_epoch=4)) < 1.0


@pytest.mark.parametrize("what", ["samples", "epoch", "stop", "a member left", "a full group"])
def test_it_holds_until_the_shares_are_in_the_epoch_moves_or_training_stops(what):
    opt, stop, target = optimizer(), threading.Event(), [120]
    change = {"samples": lambda: setattr(opt.tracker.global_progress, "samples_accumulated", 120),
              "epoch": lambda: setattr(opt.tracker, "global_epoch", 4), "stop": stop.set,
              "a member left": lambda: target.__setitem__(0, 40),
              # the round scheduled when this member's share was done found its whole group (hivemind_adapter)
              "a full group": lambda: setattr(opt, "due_if_group_full", lambda: True)}[what]
    assert 1.5 <= waited(opt, stop, change=change, target=lambda: target[0]) < 6.0
    if what == "a member left":
        assert opt.tracker.target_batch_size == 40  # the round's target follows the live members' shares


def test_it_gives_up_after_its_limit():
    assert 1.5 <= waited(optimizer(), limit=1.5) < 6.0


def test_while_it_waits_it_tells_the_swarm_it_adds_no_samples_and_then_goes_on_at_its_rate():
    opt = optimizer()
    waited(opt, change=lambda: setattr(opt.tracker, "global_epoch", 4), after=0.3)
    [(epoch, samples, rate)] = opt.tracker.reported
    assert (epoch, samples) == (3, 40) and rate < 1e-10  # its share, and no more to come
    assert opt.tracker.performance_ema.samples_per_second == 500.0  # its next steps count at its own pace


def test_a_waiting_member_reads_the_swarms_progress_at_once_and_every_second_and_rarely_while_it_computes():
    class CountingDHT:
        """The real DHT, with the times of the tracker's reads of the progress key."""

        def __init__(self, dht):
            self.dht, self.reads = dht, []

        def get(self, key, *args, **kwargs):
            if key.endswith("_progress"):
                self.reads.append(time.monotonic())
            return self.dht.get(key, *args, **kwargs)

        def __getattr__(self, name):
            return getattr(self.dht, name)

    dht = hivemind.DHT(start=True)
    counting = CountingDHT(dht)
    tracker = ProgressTracker(counting, "refresh-test", target_batch_size=10**6,
                              max_refresh_period=REFRESH_COMPUTING, start=True)
    try:
        # It computes: its own record is the swarm's progress, and the round's end is far away.
        tracker.report_local_progress(0, 32)
        time.sleep(2.0)
        tracker.report_local_progress(0, 64)
        computing = time.monotonic()
        time.sleep(4.0)
        assert len([t for t in counting.reads if t > computing]) <= 1, counting.reads
        with reading_often(tracker):
            waiting = time.monotonic()
            time.sleep(3.5)
            assert tracker.max_refresh_period == REFRESH_WAITING
        reads = [t - waiting for t in counting.reads if t > waiting]
        assert reads and reads[0] < 0.5, reads  # at once: its last read may be seconds old
        assert len(reads) >= 3, reads  # then every REFRESH_WAITING seconds or sooner
        assert tracker.max_refresh_period == REFRESH_COMPUTING
    finally:
        tracker.shutdown()
        dht.shutdown()


def held(tracker: ProgressTracker, min_nodes: int, bound: float = 10.0) -> float:
    """Seconds `wait_for_tracker` held a member whose tracker is `tracker`; training stops after `bound`."""
    stop = threading.Event()
    timer = threading.Timer(bound, stop.set)
    timer.start()
    began = time.monotonic()
    try:
        wait_for_tracker(SimpleNamespace(tracker=tracker), min_nodes, stop)
    finally:
        timer.cancel()
    return time.monotonic() - began


def test_a_member_of_a_job_that_may_run_alone_waits_only_for_its_trackers_next_read():
    dht = hivemind.DHT(start=True)
    other_dht = hivemind.DHT(start=True, initial_peers=dht.get_visible_maddrs())
    # A long default period: without the wait's own read, the tracker would not read again for a minute.
    tracker = ProgressTracker(dht, "lone-test", target_batch_size=10**6, default_refresh_period=60.0, start=True)
    other = None
    try:
        # Nothing in the run reported samples, this member included: no record to see, ever. A job of two waits on
        # (until training stops); a job of one goes on after the read, which found nobody.
        assert held(tracker, 2, bound=2.0) >= 2.0
        assert held(tracker, 1) < 5.0
        assert tracker.global_progress.num_peers == 0
        # Another member is in the run already: the read shows it.
        other = ProgressTracker(other_dht, "lone-test", target_batch_size=10**6, start=True)
        other.report_local_progress(0, 32)
        deadline = time.monotonic() + 10
        while not (dht.get("lone-test_progress", latest=True) or (None, 0))[0] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert held(tracker, 1) < 5.0
        assert tracker.global_progress.num_peers == 1
    finally:
        for t in (tracker, other):
            if t is not None:
                t.shutdown()
        other_dht.shutdown()
        dht.shutdown()
