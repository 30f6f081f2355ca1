"""Peer-attested claims (gpuswarm.node.attest): the meter and one-claim-per-epoch rules on real hivemind
StepControls, the checks on a groupmate's gathered data, and a real three-peer hivemind swarm (DHTs, Optimizers,
averager processes on 127.0.0.1) in which two honest nodes exchange signed claims in every all-reduce round while
the third sends garbage as its gather data."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import hivemind
import pytest
import torch
import torch.nn.functional as F
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from gpuswarm.node.attest import (
    MAX_CLAIM_BYTES,
    MAX_CLAIMS_PER_ROUND,
    ClaimAttestor,
    ContributionMeter,
    RoundResult,
    SignedClaim,
    collect_claims,
    key_signer,
)
from gpuswarm.node.membership import wait_for_tracker
from gpuswarm.proto.models import CLAIM_KIND, ContributionClaim
from gpuswarm.proto.signing import SignedEnvelope, node_id_for, public_key_b64, sign, verify
from hivemind.averaging.control import StepControl
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.mpfuture import MPFuture

JOB = "j-0123456789ab"
pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module", autouse=True)
def hivemind_backend():
    """Start hivemind's per-process MPFuture backend, and with it torch's shared-memory manager (a child process),
    before any test: the autouse guard in conftest kills children a test leaves behind, and a killed manager
    aborts the whole test process when the next shared tensor is freed."""
    MPFuture()
    yield


def node_of(key: Ed25519PrivateKey) -> str:
    return node_id_for(public_key_b64(key.public_key()))


def payload(envelope: dict) -> ContributionClaim:
    return ContributionClaim.model_validate(envelope["payload"])


def signature_holds(envelope: dict) -> str:
    return verify(SignedEnvelope.model_validate(envelope), kind=CLAIM_KIND, max_skew=3600)


def control() -> StepControl:
    """A real hivemind StepControl, triggered, whose outcome the test sets as the averager process would."""
    # Plain MPFutures first: in hivemind 1.1.12, a StepControl that is a process's first MPFuture breaks the backend
    # (its initialisation sets class attributes on StepControl instead of MPFuture).
    trigger, cancel = MPFuture(), MPFuture()
    step = StepControl(scheduled_time=get_dht_time() + 1, deadline=get_dht_time() + 60,
                       allow_retries=False, weight=1.0, data_for_gather=b"")
    step.attach(trigger, cancel)
    step.allow_allreduce()
    return step


def peer_claim(key: Ed25519PrivateKey, peer_id: str, epoch: int, samples: int = 7, **changes) -> dict:
    claim = dict(job_id=JOB, node_id=node_of(key), epoch=epoch, samples=samples, steps=1, compute_seconds=0.5,
                 window_start=time.time() - 1, window_end=time.time(), peer_id=peer_id) | changes
    return sign(key, CLAIM_KIND, claim).model_dump(mode="json")


class Clock:
    def __init__(self) -> None:
        self.epoch = 0


def attestor(inflate: float = 1.0) -> tuple[ClaimAttestor, Clock, list[RoundResult]]:
    clock, results = Clock(), []
    att = ClaimAttestor(*key_signer(Ed25519PrivateKey.generate()), JOB, "QmSelf", results.append, inflate=inflate)
    att.attach(lambda: clock.epoch)
    return att, clock, results


def test_one_claim_per_epoch_and_the_meter_drops_only_what_a_shared_claim_covered():
    att, clock, results = attestor()
    att.meter.record(10, 0.5)
    first = att.claim_for_round()
    step = control()
    att.track(step, first)
    att.meter.record(4, 0.25)  # accrues after signing: belongs to the next claim

    step.set_exception(TimeoutError("no group"))  # a failed round shares nothing and resets nothing
    att.poll()
    assert results == [] and att.meter.claimed.samples == 0

    retry = att.claim_for_round()  # the same epoch's round again: the very same signed claim
    assert retry is first and payload(retry.wire).samples == 10 and payload(retry.wire).epoch == 0
    step = control()
    att.track(step, retry)
    peer_key = Ed25519PrivateKey.generate()
    step.set_result({"QmSelf": retry.wire, "QmPeer": peer_claim(peer_key, "QmPeer", 0)})
    att.poll()
    (result,) = results
    assert result.epoch == 0 and not result.solo and result.group_size == 2
    assert [payload(c).node_id for c in result.claims] == [att.node_id, node_of(peer_key)]
    assert result.claims[0] == first.wire
    assert att.meter.claimed.samples == 10 and att.meter.unclaimed_samples == 4

    clock.epoch = 1
    att.poll()
    assert len(results) == 1  # epoch 0 was reported by its round: no solo report on top
    nxt = att.claim_for_round()
    assert payload(nxt.wire).epoch == 1 and payload(nxt.wire).samples == 4 and payload(nxt.wire).steps == 1
    assert payload(nxt.wire).window_start == first.covered.time


def test_an_epoch_that_ends_without_a_successful_round_is_reported_solo_with_its_one_claim():
    att, clock, results = attestor()
    att.meter.record(8, 0.1)
    signed = att.claim_for_round()
    step = control()
    att.track(step, signed)
    step.cancel()  # hivemind cancels the pre-scheduled round when it finds no other peer
    att.meter.record(3, 0.1)
    clock.epoch = 1
    att.poll()
    assert [(r.epoch, r.solo) for r in results] == [(0, True)]
    assert results[0].claims == [signed.wire]  # the claim it had signed for epoch 0, not a second one
    assert att.meter.unclaimed_samples == 3

    att.meter.record(2, 0.1)  # no round scheduled at all in epoch 1: a claim is signed when the epoch ends
    clock.epoch = 2
    att.poll()
    assert [(r.epoch, r.solo, payload(r.claims[0]).samples) for r in results[1:]] == [(1, True, 5)]
    clock.epoch = 3
    att.poll()  # nothing done in epoch 2: nothing to report
    assert len(results) == 2
    assert sum(payload(r.claims[0]).samples for r in results) == att.meter.claimed.samples == 13


def test_a_round_still_running_when_the_epoch_ends_is_waited_for_and_never_double_counted():
    att, clock, results = attestor()
    att.meter.record(6, 0.1)
    signed = att.claim_for_round()
    step = control()
    att.track(step, signed)
    att.meter.record(6, 0.1)
    clock.epoch = 1
    att.poll()
    assert results == [] and att.meter.claimed.samples == 6  # off the meter: it will be reported either way
    later = att.claim_for_round()
    assert payload(later.wire).samples == 6 and payload(later.wire).epoch == 1
    step.set_result({"QmSelf": signed.wire})
    att.poll()
    assert [(r.epoch, r.solo) for r in results] == [(0, False)]

    # The same, but the late round fails: epoch 0's claim is then reported solo, still exactly once.
    att, clock, results = attestor()
    att.meter.record(6, 0.1)
    signed = att.claim_for_round()
    step = control()
    att.track(step, signed)
    clock.epoch = 1
    att.poll()
    step.set_exception(TimeoutError())
    att.poll()
    att.poll()
    assert [(r.epoch, r.solo, r.claims) for r in results] == [(0, True, [signed.wire])]


def test_finish_reports_an_ended_epoch_whose_round_never_finished():
    att, clock, results = attestor()
    att.meter.record(5, 0.1)
    signed = att.claim_for_round()
    step = control()
    att.track(step, signed)
    clock.epoch = 1
    att.poll()
    att.finish()
    assert [(r.epoch, r.solo) for r in results] == [(0, True)]
    step.cancel()


def test_fault_injection_inflates_only_the_numbers_this_node_claims():
    att, clock, results = attestor(inflate=3.0)
    att.meter.record(10, 2.0)
    att.meter.record(10, 2.0)
    claim = payload(att.claim_for_round().wire)
    assert (claim.samples, claim.steps, claim.compute_seconds) == (60, 2, 12.0)
    clock.epoch = 1
    att.poll()
    assert att.meter.claimed.samples == 20  # the meter itself keeps the truth
    with pytest.raises(ValueError):
        attestor(inflate=0.0)


def test_meter_refuses_nonsense():
    meter = ContributionMeter()
    for samples, seconds in ((-1, 0.0), (1, float("nan")), (1, -2.0)):
        with pytest.raises(ValueError):
            meter.record(samples, seconds)


def test_a_groupmates_bad_data_is_dropped_and_never_raises():
    own_key, honest_key, liar_key = (Ed25519PrivateKey.generate() for _ in range(3))
    own = SignedClaim(4, sign(own_key, CLAIM_KIND, payload(peer_claim(own_key, "QmOwn", 4)).model_dump()),
                      ContributionMeter().mark())
    good = peer_claim(honest_key, "QmGood", 4)
    tampered = peer_claim(liar_key, "QmTampered", 4)
    tampered["payload"]["samples"] = 10**6
    impostor = peer_claim(liar_key, "QmImpostor", 4, node_id=node_of(honest_key))  # signed by another key
    padded = peer_claim(liar_key, "QmPadded", 4, padding="x" * MAX_CLAIM_BYTES)
    gathered = {
        "QmOwn": {"relayed": "by the leader"},
        "QmNone": None, "QmText": "garbage", "QmBytes": b"\x00\xff", "QmList": [1, b"x", None], "QmEmpty": {},
        "QmInf": {"kind": "claim", "payload": {"x": float("inf")}, "public_key": "A" * 44, "timestamp": 1.0,
                  "nonce": "0" * 32, "signature": "B" * 88},
        "QmTampered": tampered, "QmImpostor": impostor, "QmPadded": padded,
        "QmOtherJob": peer_claim(liar_key, "QmOtherJob", 4, job_id="j-ffffffffffff"),
        "QmWrongPeer": peer_claim(liar_key, "QmSomeoneElse", 4),
        "QmFuture": peer_claim(liar_key, "QmFuture", 4, window_end=time.time() + 600),
        "QmNotAClaim": sign(liar_key, CLAIM_KIND, {"hello": "world"}).model_dump(mode="json"),
        "QmOtherKind": sign(liar_key, "advert", payload(peer_claim(liar_key, "QmOtherKind", 4)).model_dump())
        .model_dump(mode="json"),
        "QmGood": good,
        "QmGoodAgain": peer_claim(honest_key, "QmGoodAgain", 4),  # a second claim for the same node
    }
    claims = collect_claims(gathered, own, JOB)
    assert claims == [own.wire, good]
    assert collect_claims("not a dict", own, JOB) == [own.wire]
    crowd = {f"Qm{i}": peer_claim(Ed25519PrivateKey.generate(), f"Qm{i}", 4) for i in range(MAX_CLAIMS_PER_ROUND + 5)}
    assert len(collect_claims(crowd, own, JOB)) == MAX_CLAIMS_PER_ROUND  # what a RoundReport can hold


# --- a real swarm ---------------------------------------------------------------------------------------------

TARGET_BATCH, BATCH = 32, 4
ROUNDS_WANTED = 3


class GarbageAttestor(ClaimAttestor):
    """A groupmate that takes part in every round but sends junk as its gather data: a forged claim in an honest
    node's name, a tampered claim, and values of every shape, one per round."""

    junk: list = []
    calls = 0

    def gather_data(self, claim: SignedClaim):
        self.calls += 1
        return self.junk[self.calls % len(self.junk)]


@dataclass
class Peer:
    name: str
    dht: hivemind.DHT
    model: torch.nn.Module
    optimizer: hivemind.Optimizer | None = None
    attestor: ClaimAttestor | None = None
    results: list[RoundResult] = field(default_factory=list)
    steps: int = 0  # local batches trained, counted apart from the meter
    error: BaseException | None = None


def train(peer: Peer, stop: threading.Event, features: torch.Tensor, targets: torch.Tensor) -> None:
    try:
        torch.manual_seed(hash(peer.name) % 1000)
        first = True
        while not stop.is_set():
            t0 = time.perf_counter()
            idx = torch.randint(0, len(features), (BATCH,))
            F.mse_loss(peer.model(features[idx]), targets[idx]).backward()
            peer.attestor.meter.record(BATCH, time.perf_counter() - t0)
            peer.steps += 1
            peer.optimizer.step()
            peer.optimizer.zero_grad()
            peer.attestor.poll()
            if first:
                wait_for_tracker(peer.optimizer, 3, stop)
                first = False
            time.sleep(0.05)
    except BaseException as e:  # surfaced by the test
        peer.error = e


def test_three_peers_exchange_signed_claims_in_every_round_and_garbage_breaks_nothing():
    torch.set_num_threads(1)
    torch.manual_seed(0)
    features = torch.randn(256, 8)
    targets = features @ torch.randn(8, 1)
    keys = {name: Ed25519PrivateKey.generate() for name in "abc"}

    root = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    peers: list[Peer] = []
    try:
        for name in ("a", "b", "c"):
            dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                               initial_peers=root.get_visible_maddrs())
            peers.append(Peer(name, dht, torch.nn.Linear(8, 1)))
        a, b, c = peers
        for peer in peers:
            kind = GarbageAttestor if peer is c else ClaimAttestor
            peer.attestor = kind(*key_signer(keys[peer.name]), JOB, str(peer.dht.peer_id), peer.results.append)
        forged = peer_claim(keys["c"], str(c.dht.peer_id), 0, node_id=a.attestor.node_id)
        tampered = peer_claim(keys["c"], str(c.dht.peer_id), 0)
        tampered["payload"]["samples"] += 1000
        c.attestor.junk = [forged, tampered, "garbage", [1, b"\x00", {"k": None}], {"kind": "claim"}, None]

        for peer in peers:
            peer.optimizer = hivemind.Optimizer(
                dht=peer.dht, run_id="attest_test", target_batch_size=TARGET_BATCH, batch_size_per_step=BATCH,
                params=peer.model.parameters(), optimizer=lambda params: torch.optim.SGD(params, lr=0.05),
                matchmaking_time=1.0, averaging_timeout=8.0, grad_averager_factory=peer.attestor.averager_factory,
                # one process holds three peers: each tracker needs its own key, or they share one DHT subkey
                tracker_opts={"private_key": RSAPrivateKey(), "max_refresh_period": 1.0},
                averager_opts={"request_timeout": 1.0}, verbose=False,
            )
            peer.attestor.attach(lambda optimizer=peer.optimizer: optimizer.local_epoch)

        stop = threading.Event()
        threads = [threading.Thread(target=train, args=(p, stop, features, targets), daemon=True) for p in peers]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not any(p.error for p in peers):
            rounds = [sum(not r.solo and len(r.claims) == 2 for r in p.results) for p in (a, b)]
            garbage_joined = any(r.group_size == 3 for r in a.results) and any(not r.solo for r in c.results)
            if min(rounds) >= ROUNDS_WANTED and garbage_joined:
                break
            time.sleep(0.2)
        stop.set()
        for thread in threads:
            thread.join(30)
        for peer in peers:
            peer.optimizer.shutdown()
        for peer in peers:
            peer.attestor.finish()
    finally:
        for peer in peers:
            if peer.optimizer is not None and peer.optimizer.grad_averager.is_alive():
                peer.optimizer.shutdown()
            peer.dht.shutdown()
        root.shutdown()

    assert not [p.error for p in peers if p.error], [repr(p.error) for p in peers if p.error]
    peer_ids = {a.attestor.node_id: str(a.dht.peer_id), b.attestor.node_id: str(b.dht.peer_id)}
    own_claims = {}
    for me in (a, b):
        shared = [r for r in me.results if not r.solo]
        assert len(shared) >= ROUNDS_WANTED, [(r.epoch, r.solo, len(r.claims), r.group_size) for r in me.results]
        assert any(r.group_size == 3 for r in shared), "the garbage peer never joined a round"
        for r in me.results:
            nodes = [payload(claim).node_id for claim in r.claims]
            assert nodes[0] == me.attestor.node_id and len(set(nodes)) == len(nodes)
            assert set(nodes) <= set(peer_ids)  # nothing of c's got in
            for claim in r.claims:
                signer = signature_holds(claim)
                assert signer == payload(claim).node_id and payload(claim).peer_id == peer_ids[signer]
                assert payload(claim).job_id == JOB
            assert payload(r.claims[0]).epoch == r.epoch
        epochs = [r.epoch for r in me.results]
        assert len(epochs) == len(set(epochs)), "an epoch was reported twice"
        own_claims[me.name] = {r.epoch: r.claims[0] for r in me.results}
        # Every sample trained is claimed exactly once, or still waits on the meter for the next round.
        claimed = sum(payload(r.claims[0]).samples for r in me.results)
        assert claimed == me.attestor.meter.claimed.samples > 0
        assert claimed + me.attestor.meter.unclaimed_samples == me.steps * BATCH

    # Where both honest nodes were in a shared round of the same epoch, each holds one of the other's own signed
    # claims, exactly as the other signed it (under load the other may have been an epoch behind in that round).
    both = {r.epoch for r in a.results if not r.solo} & {r.epoch for r in b.results if not r.solo}
    assert len(both) >= ROUNDS_WANTED - 1, both
    for me, other in ((a, b), (b, a)):
        for r in me.results:
            if r.epoch in both:
                theirs = [claim for claim in r.claims[1:] if payload(claim).node_id == other.attestor.node_id]
                assert theirs and all(claim in own_claims[other.name].values() for claim in theirs), \
                    f"{me.name} lacks {other.name}'s claim"
    # The garbage sender trained on, and its own view of the rounds holds the honest nodes' claims.
    assert c.optimizer.local_epoch >= 1
    seen_by_c = [claim for r in c.results for claim in r.claims[1:]]
    assert any(claim in seen_by_c for claim in own_claims["a"].values())
    assert any(claim in seen_by_c for claim in own_claims["b"].values())
