"""The relay plan and the routes that follow from it: examples, then properties over random reachability."""

from __future__ import annotations

from gpuswarm.mesh.keys import KeyPair
from gpuswarm.mesh.relays import allowed_ips, pair, plan_relays
from gpuswarm.proto.models import MeshConfig, MeshPeer
from hypothesis import given, settings
from hypothesis import strategies as st

NODES = ["n0", "n1", "n2", "n3", "n4"]


def test_a_pair_without_a_direct_path_goes_through_the_peer_that_reaches_both_at_the_lowest_rtt():
    rtts = {"n0": {"n2": 5.0, "n3": 1.0}, "n1": {"n2": 5.0, "n3": 9.0}, "n2": {}, "n3": {}}
    plan = plan_relays(["n0", "n1", "n2", "n3"], rtts, {"n0": ["n1"]}, {})
    assert plan == {("n0", "n1"): "n2"}  # 5 + 5 < 1 + 9


def test_no_relay_when_nobody_reaches_both_ends():
    rtts = {"n0": {"n2": 5.0}, "n1": {}, "n2": {}}
    assert plan_relays(["n0", "n1", "n2"], rtts, {"n1": ["n0", "n2"]}, {}) == {}


def test_a_link_either_end_reports_unreachable_is_no_path_for_a_relay():
    rtts = {"n0": {"n2": 5.0}, "n1": {"n2": 5.0}}  # n2 -> n1 works for n1, yet n2 says it has no path to n1
    assert plan_relays(["n0", "n1", "n2"], rtts, {"n0": ["n1"], "n2": ["n1"]}, {}) == {}


def test_a_relay_keeps_its_pair_while_it_qualifies_even_when_another_is_now_closer():
    rtts = {"n0": {"n2": 50.0, "n3": 1.0}, "n1": {"n2": 50.0, "n3": 1.0}}
    assert plan_relays(NODES[:4], rtts, {"n1": ["n0"]}, {("n0", "n1"): "n2"}) == {("n0", "n1"): "n2"}
    # ... and loses it when it goes offline
    assert plan_relays(["n0", "n1", "n3"], rtts, {"n1": ["n0"]}, {("n0", "n1"): "n2"}) == {("n0", "n1"): "n3"}


def test_a_pair_that_reaches_itself_again_loses_its_relay():
    rtts = {"n0": {"n1": 3.0, "n2": 5.0}, "n1": {"n2": 5.0}}
    assert plan_relays(["n0", "n1", "n2"], rtts, {}, {("n0", "n1"): "n2"}) == {}


def test_equal_relays_share_the_load():
    rtts = {a: {"r1": 1.0, "r2": 1.0} for a in ("a", "b", "c", "d")}
    plan = plan_relays(["a", "b", "c", "d", "r1", "r2"], rtts, {"a": ["b"], "c": ["d"]}, {})
    assert sorted(plan.values()) == ["r1", "r2"]


reach = st.dictionaries(st.sampled_from(NODES), st.dictionaries(st.sampled_from(NODES), st.floats(0, 500)))
blocked = st.dictionaries(st.sampled_from(NODES), st.lists(st.sampled_from(NODES), max_size=5))
relays = st.dictionaries(st.tuples(st.sampled_from(NODES), st.sampled_from(NODES)).filter(lambda p: p[0] < p[1])
                         .map(lambda p: pair(*p)), st.sampled_from(NODES))


def _direct(a, b, rtts, unreachable) -> bool:
    return (b not in unreachable.get(a, ()) and a not in unreachable.get(b, ())
            and (b in rtts.get(a, {}) or a in rtts.get(b, {})))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(NODES), unique=True), reach, blocked, relays)
def test_every_relay_reaches_both_ends_directly_and_only_reported_pairs_are_relayed(nodes, rtts, unreachable,
                                                                                   previous):
    plan = plan_relays(nodes, rtts, unreachable, previous)
    for (a, b), relay in plan.items():
        assert a < b and {a, b, relay} <= set(nodes) and relay not in (a, b)
        assert b in unreachable.get(a, ()) or a in unreachable.get(b, ())
        assert _direct(a, relay, rtts, unreachable) and _direct(relay, b, rtts, unreachable)
    # A pair is left out only when no node qualifies.
    for a in nodes:
        for b in unreachable.get(a, ()):
            if b in nodes and b != a and pair(a, b) not in plan:
                assert not any(_direct(a, r, rtts, unreachable) and _direct(r, b, rtts, unreachable)
                               for r in nodes if r not in (a, b))
    # A still qualifying relay is kept, and planning is a fixed point.
    for p, relay in previous.items():
        if p in plan and relay in nodes and relay not in p and _direct(p[0], relay, rtts, unreachable) \
                and _direct(relay, p[1], rtts, unreachable):
            assert plan[p] == relay
    assert plan_relays(nodes, rtts, unreachable, plan) == plan
    assert plan_relays(list(reversed(nodes)), rtts, unreachable, plan) == plan


def _config(via: dict[int, int], n: int = 4) -> tuple[MeshConfig, list[str]]:
    keys = [KeyPair.generate().public_key for _ in range(n)]
    peers = [MeshPeer(node_id=f"{i:016x}", public_key=keys[i], address=f"10.77.0.{i + 1}",
                      via=f"{via[i]:016x}" if i in via else None) for i in range(n)]
    return MeshConfig(address="10.77.0.100", cidr="10.77.0.0/16", version=1, peers=peers), keys


def test_a_relayed_peer_has_no_allowed_ips_and_its_address_goes_to_the_relay():
    config, keys = _config({0: 2})
    routes = allowed_ips(config)
    assert routes[keys[0]] == frozenset()
    assert routes[keys[2]] == {"10.77.0.3/32", "10.77.0.1/32"}
    assert routes[keys[1]] == {"10.77.0.2/32"} and routes[keys[3]] == {"10.77.0.4/32"}


def test_relays_through_a_relayed_peer_or_an_unknown_one_are_ignored():
    config, keys = _config({0: 1, 1: 2})  # n1 is itself relayed: n0 keeps its own route
    routes = allowed_ips(config)
    assert routes[keys[0]] == {"10.77.0.1/32"} and routes[keys[1]] == frozenset()
    config, keys = _config({0: 9})
    assert allowed_ips(config)[keys[0]] == {"10.77.0.1/32"}


@given(st.dictionaries(st.integers(0, 5), st.integers(0, 5)))
def test_every_address_is_routed_to_exactly_one_peer(via):
    config, keys = _config({k: v for k, v in via.items() if k != v}, n=6)
    routes = allowed_ips(config)
    owners = [ip for ips in routes.values() for ip in ips]
    assert sorted(owners) == sorted(f"10.77.0.{i + 1}/32" for i in range(6))
