"""ledger.throughput_cap, the pure rule (a claim is capped at THROUGHPUT_SLACK times its peers' upper median rate),
and the speeds it scales by (`stable_gflops`)."""

from gpuswarm.coordinator.db import Base, Challenge, Contribution, Node, make_engine, sessionmaker
from gpuswarm.coordinator.ledger import THROUGHPUT_SLACK, WINDOW_JITTER, stable_gflops, throughput_cap
from gpuswarm.proto.models import JobSpec

SPEC = JobSpec.model_validate({"workload": "digits-mlp"})


def contribution(id_: int, node: str, samples: int) -> Contribution:
    return Contribution(id=id_, node_id=node, samples=samples, window_start=0.0, window_end=1.0)


def test_equal_windows_cap_at_the_slack_times_the_upper_median_peer():
    mine, peers = contribution(1, "a", 0), [contribution(i, p, s) for i, p, s in ((2, "b", 100), (3, "c", 300),
                                                                                   (4, "d", 200), (5, "e", 900))]
    assert throughput_cap(mine, peers[:3], {}, SPEC) == int(200 * THROUGHPUT_SLACK)
    assert throughput_cap(mine, peers, {}, SPEC) == int(300 * THROUGHPUT_SLACK)


def test_a_straggling_peer_does_not_set_the_bar_for_the_other_two():
    # Seen in the fault suite (mode "sync", three nodes on two cores): a member that fell behind loaded the state and
    # stepped once in a round (32 samples in 6.0 s); the fastest covered for it (415 in 2.9 s), the third did its
    # usual 256 in 3.0 s. The median of the two (the old rule) capped the honest 415 at 394 and flagged it.
    mine, peers = contribution(1, "a", 415), [contribution(2, "b", 32), contribution(3, "c", 256)]
    assert throughput_cap(mine, peers, {}, SPEC, {1: 2.9, 2: 6.0, 3: 3.0}) >= 415


def test_a_member_that_trained_longer_than_its_peers_may_claim_in_proportion():
    # A node that started the round 30 s before its peer joined (diloco's long rounds) did four times the work.
    mine, peer = contribution(1, "a", 4000), contribution(2, "b", 1000)
    windows = {1: 40.0, 2: 10.0}
    ratio = (40.0 + WINDOW_JITTER) / (10.0 + WINDOW_JITTER)
    assert throughput_cap(mine, [peer], {}, SPEC, windows) == int(1000 * ratio * THROUGHPUT_SLACK) >= 4000
    assert throughput_cap(peer, [mine], {}, SPEC, windows) == int(4000 / ratio * THROUGHPUT_SLACK)


def test_sub_second_windows_do_not_swing_the_cap():
    # Seen in CI (mode "sync", one-second rounds): members see a round end up to about a second apart, so one
    # member's window was 0.7 s and its peer's 0.3 s for the same round. The bare ratio (2.3) let an inflating
    # node's flagged rounds be credited twice what its peers did.
    mine, peers = contribution(1, "a", 2560), [contribution(2, "b", 255), contribution(3, "c", 256)]
    windows = {1: 0.7, 2: 0.3, 3: 0.6}
    assert throughput_cap(mine, peers, {}, SPEC, windows, slack=1.0) < 1.4 * 256


def test_faster_gpus_scale_the_cap_and_unknown_windows_count_as_equal():
    mine, peer = contribution(1, "a", 0), contribution(2, "b", 100)
    assert throughput_cap(mine, [peer], {"a": 20.0, "b": 10.0}, SPEC, {1: 0.0, 2: 5.0}) == int(200 * THROUGHPUT_SLACK)


def test_without_slack_the_cap_is_the_median_share_and_never_below_one_round():
    mine, peers = contribution(1, "a", 0), [contribution(2, "b", 1000), contribution(3, "c", 3000)]
    assert throughput_cap(mine, peers, {}, SPEC, slack=1.0) == 3000
    one_round = SPEC.hyperparameters["target_batch_size"] + SPEC.hyperparameters["batch_size"]
    assert throughput_cap(mine, [contribution(2, "b", 10)], {}, SPEC, slack=1.0) == one_round


def test_a_slower_measured_gpu_never_lowers_the_cap():
    # GFLOP/s are noisy (one challenge measured 2-38 on one machine): a node measured slower than its peer keeps
    # the peer's cap, and only a faster measure raises its own.
    slow, fast = contribution(1, "a", 0), contribution(2, "b", 100)
    assert throughput_cap(slow, [fast], {"a": 4.0, "b": 35.0}, SPEC) == int(100 * THROUGHPUT_SLACK)
    assert throughput_cap(fast, [contribution(1, "a", 100)], {"a": 4.0, "b": 35.0}, SPEC) == \
        int(100 * 35.0 / 4.0 * THROUGHPUT_SLACK)


async def test_a_nodes_speed_is_the_median_of_its_recent_passed_challenges(tmp_path):
    engine = make_engine(f"sqlite+aiosqlite:///{tmp_path / 'speed.db'}")
    async with engine.begin() as connection:
        await connection.run_sync(Base.metadata.create_all)
    sessions = sessionmaker(engine)
    async with sessions.begin() as session:
        for node in ("a", "b"):
            session.add(Node(id=node, public_key=f"key-{node}", resources={}, software_version="t", endpoints=[],
                             state="idle", registered_at=0.0, last_seen=0.0))
        await session.flush()
        # Node a: an old outlier, then five recent measures (one wild) and a failed one; b never passed.
        measures = [(1.0, "passed", 400.0), (2.0, "passed", 10.0), (3.0, "passed", 12.0), (4.0, "passed", 38.8),
                    (5.0, "passed", 11.0), (6.0, "passed", 2.2), (7.0, "failed", 900.0)]
        for i, (at, state, gflops) in enumerate(measures):
            session.add(Challenge(id=f"c-{i}", node_id="a", state=state, device_class="cpu", n=64, seed="0" * 32,
                                  time_limit=1.0, issued_at=at, finished_at=at, measured_gflops=gflops))
        session.add(Challenge(id="c-b", node_id="b", state="failed", device_class="cpu", n=64, seed="0" * 32,
                              time_limit=1.0, issued_at=1.0, finished_at=1.0, measured_gflops=50.0))
    async with sessions() as session:
        assert await stable_gflops(session, ["a", "b"]) == {"a": 11.0, "b": None}
    await engine.dispose()
