"""`reputation.score`, the pure part of a node's reputation, against the rule its module docstring states."""

from __future__ import annotations

from gpuswarm.coordinator.reputation import WEIGHTS, Record, score
from hypothesis import given
from hypothesis import strategies as st

counts = st.integers(0, 10**6)


def rule(r: Record) -> float:
    """The docstring's rule, written out part by part: each smoothed rate weighted and summed, to four places."""
    parts = {"uptime": min(max(r.uptime, 0.0), 1.0),
             "assignments": (r.completed + 1) / (r.completed + r.abandoned + 2),
             "challenges": (r.challenges_passed + 1) / (r.challenges_passed + r.challenges_failed + 2),
             "honesty": 1.0 / (1.0 + r.flagged_claims)}
    return round(sum(WEIGHTS[k] * v for k, v in parts.items()), 4)


@given(st.builds(Record, uptime=st.floats(-1.0, 2.0), completed=counts, abandoned=counts,
                 challenges_passed=counts, challenges_failed=counts, flagged_claims=counts))
def test_property_score_is_the_weighted_rule_within_zero_and_one(record):
    assert score(record) == rule(record)
    assert 0.0 <= score(record) <= 1.0


def test_a_new_node_starts_in_the_middle_and_one_bad_event_does_not_sink_a_good_record():
    assert score(Record()) == 0.6  # uptime 0.5, both rates 0.5, no flagged claims
    good = Record(uptime=1.0, completed=50, challenges_passed=10)
    assert score(good) > 0.9 and score(Record(uptime=1.0, completed=50, abandoned=1, challenges_passed=10)) > 0.9
