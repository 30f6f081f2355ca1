"""A run's membership records over a real hivemind DHT (gpuswarm.node.membership): the inner steps a member
publishes for a round reach a member that was not in the group's round, the most common count wins, and a record
of the wrong shape (written by anyone) is read as no share and no pace, never as an error; a member whose round
failed learns whether another has reached its epoch, and the swarm's samples the others counted on reaching it."""

from __future__ import annotations

import time

import hivemind
import pytest
from gpuswarm.node.membership import MEMBER_TTL, Membership
from hivemind.utils import get_dht_time


@pytest.fixture
def dht():
    node = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    yield node
    node.shutdown()


def members(dht, *names: str, share: int | None = None) -> list[Membership]:
    found = [Membership(dht, "run-m", name, share=share) for name in names]
    for m in found:
        m.refresh()
    return found


def test_a_member_without_the_groups_pace_takes_the_count_the_others_published(dht):
    a, b, c, late = members(dht, "node-a", "node-b", "node-c", "node-late")
    for member, steps in ((a, 120), (b, 120), (c, 80)):
        member.publish_pace(7, steps)
        member.refresh()  # what the helper thread does when woken
    assert late.agreed_steps(7) == 120  # the most common count
    assert late.agreed_steps(8) is None  # nobody published this round yet
    assert late.place() == (3, 4)  # the look also placed it among the four


def test_a_tie_takes_the_larger_count_and_a_member_ignores_its_own_record(dht):
    a, b, me = members(dht, "node-a", "node-b", "node-me")
    for member, steps in ((a, 40), (b, 60), (me, 500)):
        member.publish_pace(2, steps)
        member.refresh()
    assert me.agreed_steps(2) == 60


def test_records_of_the_wrong_shape_are_neither_shares_nor_paces(dht):
    me, fed = members(dht, "node-me", "node-fed", share=640)
    fed.publish_pace(0, 25)  # epoch 0 is a round like any other
    fed.refresh()
    for name, value in (("node-x", ["x", None, "3", True]), ("node-y", [1.0, -5, -1, 10**9]),
                        ("node-z", {"steps": 4}), ("node-w", [1.0, 2**41, 3, 0, 5]),
                        ("node-v", [1.0, None, 3, 10, 7, 8])):
        dht.store("run-m.members", subkey=name, value=value, expiration_time=get_dht_time() + MEMBER_TTL)
    time.sleep(0.1)
    assert me.agreed_steps(0) == 25
    found = me.members()
    assert found["node-fed"] == (640, (0, 25, None))
    dht.store("run-m.members", subkey="node-old", value=[1.0, 320, 4, 30],  # an earlier version's record
              expiration_time=get_dht_time() + MEMBER_TTL)
    time.sleep(0.1)
    assert me.members()["node-old"] == (320, (4, 30, None))
    assert all(found[name] == (None, None) for name in ("node-x", "node-y", "node-z", "node-w", "node-v"))


def test_a_member_whose_round_failed_sees_whether_another_reached_its_epoch(dht):
    ahead, behind, me = members(dht, "node-ahead", "node-behind", "node-me")
    behind.publish_pace(10, 30)
    behind.refresh()
    me.publish_pace(11, 30)  # its own record never counts
    me.refresh()
    assert not me.level_with(11)  # only a member still in the round of epoch 10
    ahead.publish_pace(11, 45)
    ahead.refresh()
    assert me.level_with(11) and me.level_with(10) and not me.level_with(12)


def test_a_member_that_loads_a_peers_state_reads_the_swarms_samples_the_others_counted(dht):
    a, b, c, me = members(dht, "node-a", "node-b", "node-c", "node-me")
    for member, samples in ((a, 17_856), (b, 17_856), (c, 10**12)):  # c lies
        member.publish_pace(3, 62, samples)
        member.refresh()
    me.publish_pace(3, 1000, 107_904)  # its own record never counts
    me.refresh()
    assert me.published_samples(3) == 17_856  # the median: one liar does not move it
    assert me.published_samples(4) is None
    dht.store("run-m.members", subkey="node-c", value=[1.0, None, 3, 62, "lots"],
              expiration_time=get_dht_time() + MEMBER_TTL)
    time.sleep(0.1)
    assert me.members()["node-c"] == (None, (3, 62, None))  # a count of the wrong type is none, its pace stays
    assert me.published_samples(3) == 17_856
