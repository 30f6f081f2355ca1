"""Every DHT record chains to the coordinator (gpuswarm.proto.dht, gpuswarm.dht.validators): the validator on its
own, then real DHT peers against a plain hivemind client forging each kind of record the swarm acts on."""

from __future__ import annotations

import time
from functools import partial

import hivemind
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from gpuswarm.dht import hivemind_adapter
from gpuswarm.dht import validators as validators_module
from gpuswarm.dht.validators import (
    SwarmRecordValidator,
    WriterProof,
    check_record,
    new_session_key,
    renewal_due,
    validators,
)
from gpuswarm.node.identity import Identity
from gpuswarm.proto.dht import (
    ADVERT_KIND,
    CERT_KIND,
    KEY_KIND,
    MAX_CERT_TTL,
    NODE_SCOPE,
    NODES_KEY,
    binding_for,
    issue_cert,
    job_run_id,
)
from gpuswarm.proto.models import NodeAdvert, NodeState, Resources
from gpuswarm.proto.signing import public_key_b64, sign
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.validation import DHTRecord
from hivemind.utils import get_dht_time

AUTHORITY = Ed25519PrivateKey.generate()
AUTHORITY_KEY = public_key_b64(AUTHORITY.public_key())
RUN = job_run_id("j-0123456789ab")
OTHER_RUN = job_run_id("j-ba9876543210")
pack = hivemind_adapter.pack


def identity() -> Identity:
    return Identity(Ed25519PrivateKey.generate())


def writer(node: Identity, scope: str, subkeys: list, *, authority=AUTHORITY, ttl: float = 600.0,
           now: float | None = None, binder: Identity | None = None) -> WriterProof:
    """A peer's proof as the coordinator and the node make it: the cert, the node's binding of a session key."""
    cert = issue_cert(authority, node.node_id, scope, ttl, time.time() if now is None else now)
    private, public = new_session_key()
    binding = (binder or node).sign(KEY_KIND, binding_for(cert, public, [pack(s) for s in subkeys]))
    return WriterProof(cert, binding, private)


def signed_record(proof: WriterProof, key: str, subkey, value, expiration: float) -> DHTRecord:
    raw = DHTRecord(hivemind_adapter.key_id(key), pack(subkey), pack(value), expiration)
    return DHTRecord(raw.key, raw.subkey, SwarmRecordValidator(AUTHORITY_KEY, proof).sign_value(raw), expiration)


def accepted(record: DHTRecord) -> bool:
    return SwarmRecordValidator(AUTHORITY_KEY).validate(record)


def advert(node: Identity, expires_at: float) -> dict:
    payload = NodeAdvert(node_id=node.node_id, state=NodeState.IDLE, software_version="0.1.0",
                         resources=Resources(cpu_cores=4, ram_gb=8), expires_at=expires_at)
    return node.sign(ADVERT_KIND, payload.model_dump(mode="json")).model_dump(mode="json")


# ------------------------------------------------------------------------------------------------ the validator


def test_a_record_with_its_writers_proof_is_accepted_and_strips_back_to_its_value():
    node = identity()
    proof = writer(node, RUN, [node.node_id])
    exp = time.time() + 20
    record = signed_record(proof, RUN + ".members", node.node_id, 1.5, exp)
    assert accepted(record)
    chain, value = check_record(record, AUTHORITY_KEY)
    assert chain.cert.node_id == node.node_id and hivemind_adapter.unpack(value) == 1.5
    assert SwarmRecordValidator(AUTHORITY_KEY).strip_value(record) == pack(1.5)


def test_records_without_a_proof_or_chained_elsewhere_are_rejected():
    node, other = identity(), identity()
    exp = time.time() + 20
    assert not accepted(DHTRecord(hivemind_adapter.key_id(RUN + ".members"), pack(node.node_id), pack(1.0), exp))
    # A cert from another "coordinator", a binding signed by a node the cert does not name.
    assert not accepted(signed_record(writer(node, RUN, [node.node_id], authority=Ed25519PrivateKey.generate()),
                                      RUN + ".members", node.node_id, 1.0, exp))
    assert not accepted(signed_record(writer(node, RUN, [node.node_id], binder=other),
                                      RUN + ".members", node.node_id, 1.0, exp))
    # A cert longer than any coordinator issues (made by hand: issue_cert caps it).
    long_cert = sign(AUTHORITY, CERT_KIND, {"node_id": node.node_id, "scope": RUN,
                                            "expires_at": time.time() + MAX_CERT_TTL * 2})
    private, public = new_session_key()
    long = WriterProof(long_cert, node.sign(KEY_KIND, binding_for(long_cert, public, [pack(node.node_id)])), private)
    assert not accepted(signed_record(long, RUN + ".members", node.node_id, 1.0, exp))


def test_a_proof_opens_only_its_own_scope_subkeys_and_lifetime():
    node, other = identity(), identity()
    proof = writer(node, RUN, [node.node_id], ttl=60)
    exp = time.time() + 20
    assert not accepted(signed_record(proof, OTHER_RUN + ".members", node.node_id, 1.0, exp))  # another run
    assert not accepted(signed_record(proof, NODES_KEY, node.node_id, advert(node, exp), exp))  # not its advert
    assert not accepted(signed_record(proof, RUN + ".members", other.node_id, 1.0, exp))  # another's subkey
    assert not accepted(signed_record(proof, RUN + ".members", node.node_id, 1.0, time.time() + 3600))  # too long
    expired = writer(node, RUN, [node.node_id], ttl=60, now=time.time() - 120)  # the assignment ended
    assert not accepted(signed_record(expired, RUN + ".members", node.node_id, 1.0, exp))
    # The node scope: its own advert only.
    own = writer(node, NODE_SCOPE, [node.node_id])
    assert accepted(signed_record(own, NODES_KEY, node.node_id, advert(node, exp), exp))
    assert not accepted(signed_record(own, RUN + ".members", node.node_id, 1.0, exp))


def test_a_copied_proof_does_not_carry_another_value_or_expiry():
    node = identity()
    proof = writer(node, RUN, [node.node_id])
    exp = time.time() + 20
    record = signed_record(proof, RUN + ".members", node.node_id, 1.0, exp)
    trailer = record.value[len(pack(1.0)):]
    assert accepted(record)  # and remembered: what follows must not pass on its strength
    assert not accepted(DHTRecord(record.key, record.subkey, pack(2.0) + trailer, exp))
    assert not accepted(DHTRecord(record.key, record.subkey, record.value, exp + 10))
    assert not SwarmRecordValidator(public_key_b64(Ed25519PrivateKey.generate().public_key())).validate(record)


def test_a_record_that_passed_is_not_checked_again_and_a_failing_one_always_is(monkeypatch):
    node = identity()
    record = signed_record(writer(node, RUN, [node.node_id]), RUN + ".members", node.node_id, 3.0, time.time() + 20)
    checks = []
    real = validators_module._check
    monkeypatch.setattr(validators_module, "_check", lambda *a: checks.append(a) or real(*a))
    assert accepted(record) and accepted(DHTRecord(record.key, record.subkey, record.value, record.expiration_time))
    assert len(checks) == 1
    forged = DHTRecord(record.key, record.subkey, record.value[:-1] + bytes([record.value[-1] ^ 1]),
                       record.expiration_time)
    assert not accepted(forged) and not accepted(forged)
    assert len(checks) == 3
    # A record too large to keep is checked every time.
    big = signed_record(writer(node, RUN, [node.node_id]), RUN + ".members", node.node_id, "x" * 5000,
                        time.time() + 20)
    assert accepted(big) and accepted(big) and len(checks) == 5


@pytest.mark.parametrize("raw", [b"", b"\x00gpswrm1", b"x" * 10 + b"\x00\x00\x00\x05\x00gpswrm1",
                                 b"{}" + b"\x00\x00\x00\x02\x00gpswrm1", b"\xff" * 9000 + b"\x00gpswrm1"])
def test_garbage_trailers_are_rejected_without_raising(raw):
    record = DHTRecord(hivemind_adapter.key_id(RUN + ".members"), pack("x"), raw, time.time() + 10)
    assert not accepted(record)
    SwarmRecordValidator(AUTHORITY_KEY).strip_value(record)  # never raises either


def test_a_renewed_cert_is_taken_at_half_its_life_or_for_another_scope_or_authority():
    node = identity()
    now = time.time()
    current = writer(node, RUN, [node.node_id], ttl=600, now=now)
    assert renewal_due(None, current.cert)
    assert not renewal_due(current, issue_cert(AUTHORITY, node.node_id, RUN, 600, now + 10))
    assert renewal_due(current, issue_cert(AUTHORITY, node.node_id, RUN, 600, now + 300))
    assert renewal_due(current, issue_cert(AUTHORITY, node.node_id, OTHER_RUN, 600, now))
    assert renewal_due(current, issue_cert(Ed25519PrivateKey.generate(), node.node_id, RUN, 600, now + 10))


# ------------------------------------------------------------------------------------------ real DHT peers


class Swarm:
    """Two honest peers (a registered node's, a run member's) and an attacker: a plain hivemind client."""

    def __init__(self):
        self.node, self.member = identity(), identity()
        self.peers = []
        self.honest = self.start(validators(AUTHORITY_KEY, writer(self.node, NODE_SCOPE, [self.node.node_id])))
        rsa = RSASignatureValidator()  # the member's process-wide RSA key: its progress records' owner
        self.member_dht = self.start(validators(AUTHORITY_KEY), self.honest)
        self.member_subkeys = [self.member.node_id, self.member_dht.peer_id.to_bytes(), rsa.local_public_key]
        self.member_dht.add_validators([SwarmRecordValidator(AUTHORITY_KEY,
                                                             writer(self.member, RUN, self.member_subkeys))])
        self.attacker = self.start([RSASignatureValidator()], self.honest)

    def start(self, record_validators, bootstrap=None) -> hivemind.DHT:
        peers = [str(m) for m in bootstrap.get_visible_maddrs()] if bootstrap is not None else []
        dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=peers,
                           record_validators=record_validators)
        self.peers.append(dht)
        return dht

    def seen(self, dht: hivemind.DHT, key: str) -> dict:
        found = dht.get(key, latest=True)
        return dict(found.value) if found is not None and isinstance(found.value, dict) else {}

    def held(self, dht: hivemind.DHT, key: str) -> set:
        """The subkeys a peer holds under `key` itself, raw (the attacker's peer cannot decode honest records)."""
        return dht.run_coroutine(partial(_held, key))

    def close(self):
        for dht in reversed(self.peers):
            dht.shutdown()


async def _held(key: str, _dht, node) -> set:
    record = hivemind_adapter.cached_record(node, key)
    return set(record.subkeys) if record is not None and record.subkeys else set()


@pytest.fixture(scope="module")
def swarm():
    s = Swarm()
    yield s
    s.close()


@pytest.mark.timeout(120)
def test_an_unregistered_nodes_advert_and_a_year_long_one_never_spread(swarm):
    exp = get_dht_time() + 30
    swarm.honest.store(NODES_KEY, subkey=swarm.node.node_id, value=advert(swarm.node, exp), expiration_time=exp)
    stranger = identity()
    far = get_dht_time() + 365 * 86400
    swarm.attacker.store(NODES_KEY, subkey=stranger.node_id, value=advert(stranger, far), expiration_time=far)
    # The registered node itself, an advert a year ahead: its cert ends long before. (The attacker's peer, one of
    # the replicas, keeps anything; what counts is that no honest peer takes or returns it.)
    swarm.honest.store(NODES_KEY, subkey=swarm.node.node_id, value=advert(swarm.node, far), expiration_time=far)
    assert stranger.node_id in swarm.held(swarm.attacker, NODES_KEY)  # it is in the DHT (the attacker's peer)
    for dht in (swarm.honest, swarm.member_dht):
        adverts = swarm.seen(dht, NODES_KEY)
        assert set(adverts) == {swarm.node.node_id}
        assert adverts[swarm.node.node_id].expiration_time == pytest.approx(exp)


@pytest.mark.timeout(120)
def test_a_non_member_cannot_write_a_runs_progress_members_or_averager_records(swarm):
    now = get_dht_time()
    member_progress = {"peer_id": swarm.member_dht.peer_id.to_bytes(), "epoch": 3, "samples_accumulated": 10,
                       "samples_per_second": 1.0, "time": now, "client_mode": False}
    rsa = RSASignatureValidator().local_public_key
    # (What `store` returns is the last replica's answer, here perhaps the attacker's: the lookups below judge.)
    swarm.member_dht.store(RUN + "_progress", subkey=rsa, value=member_progress, expiration_time=now + 30)
    swarm.member_dht.store(RUN + ".members", subkey=swarm.member.node_id, value=now, expiration_time=now + 20)
    swarm.member_dht.store(RUN + "_grad_averager.0b", subkey=swarm.member_dht.peer_id.to_bytes(), value=True,
                           expiration_time=now + 20)

    # The attacker: hivemind's own RSA-signed progress record with a huge epoch (the one that once halted
    # training), a fake member, and averager declarations; each under its own identity.
    junk = dict(member_progress, peer_id=swarm.attacker.peer_id.to_bytes(), epoch=10**6)
    swarm.attacker.store(RUN + "_progress", subkey=RSASignatureValidator().local_public_key, value=junk,
                         expiration_time=now + 30)
    swarm.attacker.store(RUN + ".members", subkey="f" * 16, value=now, expiration_time=now + 20)
    for suffix in ("_grad_averager.0b", "_state_averager.all_averagers"):
        swarm.attacker.store(RUN + suffix, subkey=swarm.attacker.peer_id.to_bytes(), value=True,
                             expiration_time=now + 20)
    # The forgeries are in the DHT (the attacker's own peer keeps them)...
    assert "f" * 16 in swarm.held(swarm.attacker, RUN + ".members")
    # ...and no honest peer stores or returns them.
    for dht in (swarm.honest, swarm.member_dht):
        progress = swarm.seen(dht, RUN + "_progress")
        assert [v.value["epoch"] for v in progress.values()] == [3]
        assert list(swarm.seen(dht, RUN + ".members")) == [swarm.member.node_id]
        assert list(swarm.seen(dht, RUN + "_grad_averager.0b")) == [swarm.member_dht.peer_id.to_bytes()]
        assert swarm.seen(dht, RUN + "_state_averager.all_averagers") == {}


@pytest.mark.timeout(120)
def test_a_member_cannot_write_for_another_run_or_another_members_subkey(swarm):
    now = get_dht_time()
    swarm.member_dht.store(OTHER_RUN + ".members", subkey=swarm.member.node_id, value=now, expiration_time=now + 20)
    swarm.member_dht.store(RUN + ".members", subkey=swarm.node.node_id, value=now, expiration_time=now + 20)
    assert swarm.seen(swarm.honest, OTHER_RUN + ".members") == {}
    assert swarm.node.node_id not in swarm.seen(swarm.honest, RUN + ".members")


def test_the_run_keys_a_proof_opens_are_the_ones_hivemind_and_the_worker_write():
    from gpuswarm.proto.dht import MEMBERS_SUFFIX, RUN_SUFFIXES

    assert set(RUN_SUFFIXES) == {*hivemind_adapter.HIVEMIND_RUN_KEY_SUFFIXES, MEMBERS_SUFFIX}
