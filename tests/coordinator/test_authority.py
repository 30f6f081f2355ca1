"""The authority's certs: one signature per node and scope per half life, each one valid and chained to the key."""

from __future__ import annotations

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from gpuswarm.coordinator.authority import Authority
from gpuswarm.dht.validators import WriterProof, renewal_due
from gpuswarm.proto.dht import CERT_KIND, NODE_SCOPE
from gpuswarm.proto.signing import verify

TTL = 900.0
N1, N2 = "a" * 16, "b" * 16


def node(i: int) -> str:
    return f"{i:016x}"


def authority() -> Authority:
    return Authority(Ed25519PrivateKey.generate(), TTL)


def test_a_cert_is_reused_until_half_its_life_then_renewed_in_time_for_the_node():
    auth = authority()
    first = auth.node_cert(N1, now=1000.0)
    assert auth.node_cert(N1, now=1000.0 + TTL / 2 - 1) is first
    renewed = auth.node_cert(N1, now=1000.0 + TTL / 2)
    assert renewed is not first
    assert renewed.payload["expires_at"] == 1000.0 + TTL / 2 + TTL
    assert auth.node_cert(N1, now=1000.0 + TTL / 2 + 1) is renewed
    # The node, holding the first, takes the renewed one: the two rules meet at half a life.
    holding = WriterProof(first, first, b"")
    assert not renewal_due(holding, auth.node_cert(N1, now=1000.0 + TTL / 2 - 1))
    assert renewal_due(holding, renewed)
    for cert in (first, renewed):
        assert verify(cert, kind=CERT_KIND, max_skew=float("inf")) and cert.public_key == auth.public_key


def test_certs_are_per_node_and_scope():
    auth = authority()
    own, other = auth.node_cert(N1, now=10.0), auth.node_cert(N2, now=10.0)
    ticket = auth.run_ticket(N1, "gpuswarm_a", now=10.0)
    assert len({own.signature, other.signature, ticket.signature}) == 3
    assert (own.payload["node_id"], own.payload["scope"]) == (N1, NODE_SCOPE)
    assert (ticket.payload["node_id"], ticket.payload["scope"]) == (N1, "gpuswarm_a")
    assert auth.run_ticket(N1, "gpuswarm_a", now=11.0) is ticket
    assert auth.run_ticket(N1, "gpuswarm_b", now=11.0) is not ticket


def test_a_clock_set_back_gets_a_new_cert_not_one_from_the_future():
    auth = authority()
    later = auth.node_cert(N1, now=5000.0)
    earlier = auth.node_cert(N1, now=4000.0)
    assert earlier is not later and earlier.timestamp == 4000.0


def test_the_cache_drops_certs_due_for_renewal_so_departed_nodes_do_not_pile_up():
    auth = authority()
    for i in range(3000):
        auth.node_cert(node(i), now=0.0)
    for i in range(3000):  # all of the first ones are past half their life by now
        auth.node_cert(node(10_000 + i), now=TTL)
    assert len(auth._issued) <= 3000 + 1024
    assert node(2999) not in {key[0] for key in auth._issued}
