"""ledger.throughput_cap, the pure rule: a claim is capped at THROUGHPUT_SLACK times its peers' median rate."""

from gpuswarm.coordinator.db import Contribution
from gpuswarm.coordinator.ledger import THROUGHPUT_SLACK, throughput_cap
from gpuswarm.proto.models import JobSpec

SPEC = JobSpec.model_validate({"workload": "digits-mlp"})


def contribution(id_: int, node: str, samples: int) -> Contribution:
    return Contribution(id=id_, node_id=node, samples=samples, window_start=0.0, window_end=1.0)


def test_equal_windows_cap_at_the_slack_times_the_median_peer():
    mine, peers = contribution(1, "a", 0), [contribution(2, "b", 100), contribution(3, "c", 300)]
    assert throughput_cap(mine, peers, {}, SPEC) == int(200 * THROUGHPUT_SLACK)


def test_a_member_that_trained_longer_than_its_peers_may_claim_in_proportion():
    # A node that started the round 30 s before its peer joined (diloco's long rounds) did four times the work.
    mine, peer = contribution(1, "a", 4000), contribution(2, "b", 1000)
    windows = {1: 40.0, 2: 10.0}
    assert throughput_cap(mine, [peer], {}, SPEC, windows) == int(4000 * THROUGHPUT_SLACK)
    assert throughput_cap(peer, [mine], {}, SPEC, windows) == int(1000 * THROUGHPUT_SLACK)


def test_faster_gpus_scale_the_cap_and_unknown_windows_count_as_equal():
    mine, peer = contribution(1, "a", 0), contribution(2, "b", 100)
    assert throughput_cap(mine, [peer], {"a": 20.0, "b": 10.0}, SPEC, {1: 0.0, 2: 5.0}) == int(200 * THROUGHPUT_SLACK)


def test_a_slower_measured_gpu_never_lowers_the_cap():
    # One challenge's GFLOP/s is noisy (2-38 on one machine): a node measured slower than its peer keeps the
    # peer's cap, and only a faster measure raises its own.
    slow, fast = contribution(1, "a", 0), contribution(2, "b", 100)
    assert throughput_cap(slow, [fast], {"a": 4.0, "b": 35.0}, SPEC) == int(100 * THROUGHPUT_SLACK)
    assert throughput_cap(fast, [contribution(1, "a", 100)], {"a": 4.0, "b": 35.0}, SPEC) == \
        int(100 * 35.0 / 4.0 * THROUGHPUT_SLACK)
