"""Which progress a heartbeat carries (node/runner.reportable): the newest within PROGRESS_MARGIN of the epochs the
coordinator took claims for, since it drops a report past that ceiling (coordinator/heartbeats.py)."""

from __future__ import annotations

from collections import deque

from gpuswarm.node.runner import reportable
from gpuswarm.proto.models import PROGRESS_MARGIN, Progress
from hypothesis import given
from hypothesis import strategies as st


def history(steps: list[int]) -> deque[Progress]:
    return deque(Progress(job_id="j-000000000001", epoch=s / 10, global_step=s) for s in steps)


@given(st.lists(st.integers(0, 10_000), max_size=50).map(sorted), st.none() | st.integers(0, 10_000))
def test_the_newest_progress_within_the_claims_is_reported(steps, claimed):
    chosen = reportable(history(steps), claimed)
    # Before the first claim is taken, the node's own first step is where the job was when it joined.
    limit = (claimed if claimed is not None else steps[0] if steps else 0) + PROGRESS_MARGIN
    within = [s for s in steps if s <= limit]
    if not within:
        assert chosen is None
    else:
        assert chosen is not None and chosen.global_step == max(within) <= limit


def test_a_node_stepping_faster_than_it_heartbeats_still_reports():
    """35 steps a second, a heartbeat every 2 s: the latest step is 70 past the claims the coordinator has."""
    steps = history(list(range(0, 141)))
    assert reportable(steps, 70).global_step == 70 + PROGRESS_MARGIN
    assert reportable(steps, None).global_step == PROGRESS_MARGIN
    assert reportable(history([]), 70) is None
    assert reportable(history(list(range(500, 520))), None).global_step == 500 + PROGRESS_MARGIN  # resumed at 500
