from __future__ import annotations

import random
from collections.abc import Collection

import pytest
from gpuswarm.mesh.backend import MeshBackend, PeerConfig
from gpuswarm.mesh.keys import KeyPair
from gpuswarm.mesh.reconciler import ChangeKind, MeshAgent, PeerChange, ReconcileError, plan
from gpuswarm.mesh.uapi import DeviceStatus, PeerStatus

KEYS = sorted(KeyPair.generate().public_key for _ in range(8))


def peer(i: int, *, endpoint: str | None = "auto", ips: tuple[str, ...] | None = None, keepalive: int = 0):
    if endpoint == "auto":
        endpoint = f"10.250.0.{i + 1}:51820"
    return PeerConfig(KEYS[i], frozenset(ips or (f"10.77.0.{i + 1}/32",)), endpoint, keepalive)


def apply(current: dict[str, PeerConfig], changes: list[PeerChange]) -> dict[str, PeerConfig]:
    """What a device ends up with after the changes (an endpoint of None keeps the device's)."""
    out = dict(current)
    for c in changes:
        if c.kind is ChangeKind.REMOVE:
            del out[c.public_key]
        elif c.kind is ChangeKind.ADD:
            out[c.public_key] = c.peer
        else:
            old = out[c.public_key]
            out[c.public_key] = PeerConfig(
                old.public_key,
                c.peer.allowed_ips if "allowed_ips" in c.fields else old.allowed_ips,
                c.peer.endpoint if "endpoint" in c.fields else old.endpoint,
                c.peer.persistent_keepalive if "persistent_keepalive" in c.fields else old.persistent_keepalive,
            )
    return out


def test_plan_of_equal_sets_is_empty():
    desired = [peer(i) for i in range(5)]
    assert plan(desired, desired) == []
    assert plan([], []) == []
    assert plan({p.public_key: p for p in desired}, list(reversed(desired))) == []


def test_plan_adds_updates_and_removes_with_only_changed_fields():
    current = [peer(0), peer(1), peer(2), peer(3)]
    desired = [
        peer(1, endpoint="10.250.0.99:51820"),
        peer(2, ips=("10.77.0.3/32", "10.88.0.0/24")),
        peer(3, endpoint=None),  # no opinion on the endpoint: nothing to do
        peer(4),
    ]
    assert plan(current, desired) == [
        PeerChange(ChangeKind.REMOVE, KEYS[0]),
        PeerChange(ChangeKind.UPDATE, KEYS[1], desired[0], frozenset({"endpoint"})),
        PeerChange(ChangeKind.UPDATE, KEYS[2], desired[1], frozenset({"allowed_ips"})),
        PeerChange(ChangeKind.ADD, KEYS[4], desired[3]),
    ]


def test_plan_compares_normalised_configs():
    a = PeerConfig(KEYS[0], ["10.77.0.1"], "10.250.0.1:51820")
    b = PeerConfig(KEYS[0], {"10.77.0.1/32"}, "10.250.0.1:51820")
    assert a == b and plan([a], [b]) == []


def test_plan_refuses_conflicting_duplicates():
    with pytest.raises(ValueError, match="twice"):
        plan([], [peer(0), peer(0, keepalive=25)])
    assert plan([], [peer(0), peer(0)]) == [PeerChange(ChangeKind.ADD, KEYS[0], peer(0))]
    with pytest.raises(ValueError):
        plan({KEYS[1]: peer(0)}, [])


def random_peers(rng: random.Random) -> list[PeerConfig]:
    out = []
    for i in rng.sample(range(len(KEYS)), rng.randint(0, len(KEYS))):
        endpoint = rng.choice([None, f"10.250.0.{i + 1}:51820", f"10.250.1.{i + 1}:51821"])
        ips = tuple(rng.sample([f"10.77.0.{i + 1}/32", "10.99.0.0/24", f"fd00::{i + 1}/128"], rng.randint(0, 2)))
        out.append(PeerConfig(KEYS[i], frozenset(ips), endpoint, rng.choice([0, 25])))
    return out


@pytest.mark.parametrize("seed", range(200))
def test_plan_properties(seed):
    rng = random.Random(seed)
    current = {p.public_key: p for p in random_peers(rng)}
    desired = {p.public_key: p for p in random_peers(rng)}
    changes = plan(current, desired)
    result = apply(current, changes)
    # Reaches the desired set (endpoints the desired set leaves open stay as they were) ...
    assert result.keys() == desired.keys()
    for key, want in desired.items():
        got = result[key]
        assert got.allowed_ips == want.allowed_ips and got.persistent_keepalive == want.persistent_keepalive
        assert want.endpoint is None or got.endpoint == want.endpoint
    # ... is then a fixed point ...
    assert plan(result, desired) == []
    # ... and is minimal: exactly one change per peer that differs, none for the others.
    differing = (current.keys() ^ desired.keys()) | {
        k for k in current.keys() & desired.keys()
        if current[k].allowed_ips != desired[k].allowed_ips
        or current[k].persistent_keepalive != desired[k].persistent_keepalive
        or (desired[k].endpoint is not None and desired[k].endpoint != current[k].endpoint)
    }
    assert sorted(c.public_key for c in changes) == sorted(differing)


class MemoryBackend(MeshBackend):
    """An in-memory device for unit-testing the agent (the real ones are tested in tests/netns)."""

    kind = "memory"
    interface = "gs000000"

    def __init__(self, own_key: str, fail_for: set[str] = frozenset()):
        self.own_key = own_key
        self.peers: dict[str, PeerConfig] = {}
        self.calls: list[tuple] = []
        self.fail_for = fail_for

    def up(self, address, cidr, listen_port, private_key):  # pragma: no cover - not used
        raise NotImplementedError

    def add_or_update_peer(self, peer: PeerConfig, fields: Collection[str] | None = None) -> None:
        self.calls.append(("set", peer.public_key, None if fields is None else frozenset(fields)))
        if peer.public_key in self.fail_for:
            raise RuntimeError("device said no")
        self.peers = apply(self.peers, [PeerChange(ChangeKind.UPDATE if peer.public_key in self.peers
                                                   else ChangeKind.ADD, peer.public_key, peer,
                                                   frozenset(fields or ()))])

    def remove_peer(self, public_key: str) -> None:
        self.calls.append(("remove", public_key))
        self.peers.pop(public_key, None)

    def status(self) -> DeviceStatus:
        return DeviceStatus(self.own_key, 51820, tuple(
            PeerStatus(p.public_key, p.endpoint, tuple(sorted(p.allowed_ips)), None, 0, 0, p.persistent_keepalive)
            for p in self.peers.values()
        ))

    def down(self, timeout: float = 5.0) -> None:
        pass

    def is_running(self) -> bool:
        return True


def test_agent_reconciles_through_the_backend_and_is_idempotent():
    backend = MemoryBackend(own_key=KEYS[7])
    agent = MeshAgent(backend)
    desired = [peer(0), peer(1), peer(7)]  # includes this node's own key, which is skipped
    applied = agent.reconcile(desired)
    assert [c.kind for c in applied] == [ChangeKind.ADD, ChangeKind.ADD]
    assert set(backend.peers) == {KEYS[0], KEYS[1]}
    backend.calls.clear()
    assert agent.reconcile(desired) == []
    assert backend.calls == []

    agent.reconcile([peer(1, endpoint="10.250.0.50:1"), peer(2)])
    assert backend.calls == [
        ("remove", KEYS[0]),
        ("set", KEYS[1], frozenset({"endpoint"})),
        ("set", KEYS[2], None),
    ]


def test_agent_applies_what_it_can_and_reports_failures():
    backend = MemoryBackend(own_key=KEYS[7], fail_for={KEYS[1]})
    with pytest.raises(ReconcileError) as info:
        MeshAgent(backend).reconcile([peer(0), peer(1), peer(2)])
    assert [c.public_key for c in info.value.applied] == [KEYS[0], KEYS[2]]
    assert [c.public_key for c, _ in info.value.failed] == [KEYS[1]]
    assert set(backend.peers) == {KEYS[0], KEYS[2]}
