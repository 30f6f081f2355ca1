"""`membership.leave_last_record`: a member whose run met its stop rule puts its last progress record back in the
DHT after hivemind's tracker shut down (which overwrote it with None), so the coordinator, reading the run's epoch
from another DHT peer up to seconds later, still sees the epoch the run ended at. Real hivemind DHTs and tracker."""

from __future__ import annotations

import time

import hivemind
from gpuswarm.node.membership import leave_last_record
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.optim.progress_tracker import ProgressTracker


def epochs_seen(dht: hivemind.DHT, key: str) -> list:
    """The members' epochs as the coordinator reads them (`coordinator.app.observe_progress`)."""
    found = dht.get(key, latest=True)
    items = found.value.values() if found is not None and isinstance(found.value, dict) else []
    return [item.value.get("epoch") for item in items if isinstance(item.value, dict)]


def eventually(read, want, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while (got := read()) != want and time.monotonic() < deadline:
        time.sleep(0.1)
    return got


def test_a_finished_members_last_epoch_stays_readable_after_its_tracker_and_dht_shut_down():
    coordinator = hivemind.DHT(start=True, record_validators=[RSASignatureValidator()])
    member = hivemind.DHT(start=True, initial_peers=coordinator.get_visible_maddrs())
    tracker = ProgressTracker(member, "finished-run", target_batch_size=10**6, start=True)
    key = "finished-run_progress"
    try:
        with tracker.pause_updates():
            tracker.update_epoch(7)
        tracker.report_local_progress(7, 32)
        assert eventually(lambda: epochs_seen(coordinator, key), [7]) == [7]
        tracker.shutdown()
        # hivemind's shutdown leaves None in the member's place: the epoch is gone (what the ledger saw before).
        assert eventually(lambda: epochs_seen(coordinator, key), []) == []
        leave_last_record(tracker)
        member.shutdown()
        assert epochs_seen(coordinator, key) == [7]
    finally:
        if tracker.is_alive():
            tracker.shutdown()
        member.shutdown()
        coordinator.shutdown()
