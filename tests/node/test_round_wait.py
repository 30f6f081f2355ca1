"""`membership.wait_for_round`: a DiLoCo member that took its share of a round's steps holds until the round is due,
the swarm's epoch moved on, training stops, or its limit passes. The optimizer is a stand-in with the two things
the wait reads (its tracker's readiness and global epoch, and its own epoch): the real tracker is exercised end to
end by tests/integration/test_local_swarm.py."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
from gpuswarm.node.membership import wait_for_round


def optimizer(ready: bool = False, global_epoch: int = 3, local_epoch: int = 3) -> SimpleNamespace:
    return SimpleNamespace(tracker=SimpleNamespace(ready_to_update_epoch=ready, global_epoch=global_epoch),
                           local_epoch=local_epoch)


def waited(opt: SimpleNamespace, stop: threading.Event | None = None, limit: float = 10.0,
           change=None, after: float = 1.5) -> float:
    if change is not None:
        threading.Timer(after, change).start()
    began = time.monotonic()
    wait_for_round(opt, stop or threading.Event(), limit)
    return time.monotonic() - began


def test_it_returns_at_once_when_the_round_is_due_or_the_swarm_moved_on():
    assert waited(optimizer(ready=True)) < 1.0
    assert waited(optimizer(global_epoch=4)) < 1.0


@pytest.mark.parametrize("what", ["ready", "epoch", "stop"])
def test_it_holds_until_the_round_is_due_the_epoch_moves_or_training_stops(what):
    opt, stop = optimizer(), threading.Event()
    change = {"ready": lambda: setattr(opt.tracker, "ready_to_update_epoch", True),
              "epoch": lambda: setattr(opt.tracker, "global_epoch", 4), "stop": stop.set}[what]
    assert 1.5 <= waited(opt, stop, change=change) < 6.0


def test_it_gives_up_after_its_limit():
    assert 1.5 <= waited(optimizer(), limit=1.5) < 6.0
