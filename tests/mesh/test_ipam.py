from __future__ import annotations

import base64
import copy
import ipaddress
import json
import random

import pytest
from gpuswarm.mesh import ipam
from gpuswarm.mesh.keys import KeyPair


def keys(n: int) -> list[str]:
    return [KeyPair.generate().public_key for _ in range(n)]


def test_default_network_is_private():
    net = ipaddress.ip_network(ipam.DEFAULT_CIDR)
    assert net.is_private and net.prefixlen == 16
    assert ipam.prefix_length(ipam.new_state()) == 16


def test_address_is_the_keys_preferred_slot_and_stable():
    key = keys(1)[0]
    _, first = ipam.allocate(ipam.new_state(), key, now=0)
    # Any coordinator with the same CIDR derives the same slot from the key alone.
    assert first == str(ipaddress.ip_network(ipam.DEFAULT_CIDR).network_address + ipam.preferred_offset(key))
    state, _ = ipam.allocate(ipam.new_state(), key, now=0)
    for other in keys(20):
        state, _ = ipam.allocate(state, other, now=1)
    state2, again = ipam.allocate(state, key, now=10)
    assert again == first and state2 == state


def test_allocation_does_not_mutate_its_input_and_round_trips_json():
    state = ipam.new_state()
    snapshot = copy.deepcopy(state)
    new, address = ipam.allocate(state, keys(1)[0], now=1.0)
    assert state == snapshot
    assert json.loads(json.dumps(new)) == new
    assert address in new["allocated"].values()


def test_collisions_probe_to_distinct_addresses_and_skip_network_and_broadcast():
    state = ipam.new_state("10.9.0.0/29", release_grace_s=60)  # 6 usable addresses
    addresses = []
    for key in keys(6):
        state, address = ipam.allocate(state, key, now=0)
        addresses.append(address)
    assert sorted(addresses, key=ipaddress.ip_address) == [f"10.9.0.{i}" for i in range(1, 7)]
    with pytest.raises(ipam.PoolExhausted):
        ipam.allocate(state, keys(1)[0], now=0)


def test_every_slot_reachable_and_never_network_or_broadcast():
    rng = random.Random(7)
    state = ipam.new_state("192.168.50.0/28")
    for _ in range(14):
        key = KeyPair.from_private_key(base64.b64encode(rng.randbytes(32)).decode()).public_key
        state, address = ipam.allocate(state, key, now=0)
        assert address not in ("192.168.50.0", "192.168.50.15")


def test_released_address_is_held_for_the_grace_period():
    state = ipam.new_state("10.9.0.0/30", release_grace_s=3600)  # 2 usable addresses
    a, b, c = keys(3)
    state, addr_a = ipam.allocate(state, a, now=0)
    state, _ = ipam.allocate(state, b, now=0)
    state = ipam.release(state, a, now=100)
    assert ipam.address_of(state, a) is None
    with pytest.raises(ipam.PoolExhausted):
        ipam.allocate(state, c, now=100 + 3599)
    state, addr_c = ipam.allocate(state, c, now=100 + 3600)
    assert addr_c == addr_a


def test_key_back_within_grace_gets_its_address_back():
    state = ipam.new_state(release_grace_s=60)
    a, b = keys(2)
    state, addr_a = ipam.allocate(state, a, now=0)
    state = ipam.release(state, a, now=10)
    state, addr_b = ipam.allocate(state, b, now=20)
    assert addr_b != addr_a
    state, again = ipam.allocate(state, a, now=30)
    assert again == addr_a and state["held"] == {}


def test_expire_drops_old_holds_and_release_of_unknown_is_noop():
    state = ipam.new_state(release_grace_s=10)
    (a,) = keys(1)
    state, _ = ipam.allocate(state, a, now=0)
    state = ipam.release(state, a, now=0)
    assert ipam.expire(state, now=5)["held"] != {}
    assert ipam.expire(state, now=10)["held"] == {}
    assert ipam.release(state, keys(1)[0], now=1) == state


def test_other_allocations_never_move_an_address():
    rng = random.Random(3)
    state = ipam.new_state("10.20.0.0/26", release_grace_s=50)
    pool = keys(40)
    held: dict[str, str] = {}
    for step in range(300):
        key = rng.choice(pool)
        now = float(step)
        if key in held and rng.random() < 0.4:
            state = ipam.release(state, key, now=now)
            del held[key]
            continue
        try:
            state, address = ipam.allocate(state, key, now=now)
        except ipam.PoolExhausted:
            continue
        if key in held:
            assert held[key] == address
        held[key] = address
        assert len(set(held.values())) == len(held)
        for k, addr in held.items():
            assert ipam.address_of(state, k) == addr


@pytest.mark.parametrize("cidr", ["10.0.0.1/16", "not-a-cidr", "10.0.0.0/31", "10.0.0.0/32"])
def test_bad_cidr_is_refused(cidr):
    with pytest.raises(ipam.IPAMError):
        ipam.new_state(cidr)


def test_bad_inputs_are_refused():
    state = ipam.new_state()
    with pytest.raises(ValueError):
        ipam.allocate(state, "not-a-key", now=0)
    with pytest.raises(ipam.IPAMError):
        ipam.allocate(state, keys(1)[0], now=float("nan"))
    with pytest.raises(ipam.IPAMError):
        ipam.new_state(release_grace_s=-1)
    broken = ipam.new_state()
    broken["allocated"]["x"] = "192.168.1.1"  # outside the network
    with pytest.raises(ipam.IPAMError, match="bad allocation"):
        ipam.allocate(broken, keys(1)[0], now=0)
    with pytest.raises(ipam.IPAMError):
        ipam.allocate({"version": 99}, keys(1)[0], now=0)
