"""The reconciler: from "the peers the mesh should have" to the fewest backend changes, and applying them.

`plan(current, desired)` is pure: one change per peer that differs (add, update of only the fields that differ,
or remove), nothing for peers that already match, so `plan(desired, desired) == []` and applying a plan then
planning again yields nothing. `MeshAgent.reconcile(desired)` reads the device, plans, and applies the plan one
peer at a time through a `MeshBackend`. Owns neither the device (the backend's) nor the choice of peers (the
node daemon's, from what the coordinator says).

An endpoint of None in a desired peer means "no opinion", so the endpoint a peer roamed to is left alone; a set
endpoint that differs from the device's is written back, which re-pins a peer that roamed elsewhere.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from gpuswarm.mesh.backend import MeshBackend, PeerConfig

logger = logging.getLogger(__name__)

Peers = Mapping[str, PeerConfig] | Iterable[PeerConfig]


class ChangeKind(enum.StrEnum):
    ADD = "add"
    UPDATE = "update"
    REMOVE = "remove"


@dataclass(frozen=True)
class PeerChange:
    kind: ChangeKind
    public_key: str
    peer: PeerConfig | None = None  # the desired config, for add and update
    fields: frozenset[str] = field(default_factory=frozenset)  # for update: the fields that differ


class ReconcileError(RuntimeError):
    """Some changes failed; the others were applied. `failed` pairs each failed change with its exception."""

    def __init__(self, applied: list[PeerChange], failed: list[tuple[PeerChange, Exception]]):
        self.applied = applied
        self.failed = failed
        detail = "; ".join(f"{c.kind} {c.public_key[:8]}…: {e}" for c, e in failed)
        super().__init__(f"{len(failed)} of {len(applied) + len(failed)} mesh changes failed: {detail}")


def _by_key(peers: Peers, what: str) -> dict[str, PeerConfig]:
    if isinstance(peers, Mapping):
        items = list(peers.values())
        for key, peer in peers.items():
            if not isinstance(peer, PeerConfig) or key != peer.public_key:
                raise ValueError(f"{what} peers: entry {key!r} is not the PeerConfig of that key")
    else:
        items = list(peers)
    out: dict[str, PeerConfig] = {}
    for peer in items:
        if not isinstance(peer, PeerConfig):
            raise TypeError(f"{what} peers must be PeerConfig, not {type(peer).__name__}")
        if peer.public_key in out and out[peer.public_key] != peer:
            raise ValueError(f"{what} peers name {peer.public_key} twice, differently")
        out[peer.public_key] = peer
    return out


def changed_fields(current: PeerConfig, desired: PeerConfig) -> frozenset[str]:
    fields = set()
    if desired.endpoint is not None and desired.endpoint != current.endpoint:
        fields.add("endpoint")
    if desired.allowed_ips != current.allowed_ips:
        fields.add("allowed_ips")
    if desired.persistent_keepalive != current.persistent_keepalive:
        fields.add("persistent_keepalive")
    return frozenset(fields)


def plan(current_peers: Peers, desired_peers: Peers) -> list[PeerChange]:
    """The fewest changes that turn `current_peers` into `desired_peers`: removals first (freeing their allowed
    IPs), then updates, then additions, each in key order so that a plan is deterministic."""
    current = _by_key(current_peers, "current")
    desired = _by_key(desired_peers, "desired")
    removes = [PeerChange(ChangeKind.REMOVE, key) for key in sorted(current.keys() - desired.keys())]
    updates = []
    for key in sorted(current.keys() & desired.keys()):
        fields = changed_fields(current[key], desired[key])
        if fields:
            updates.append(PeerChange(ChangeKind.UPDATE, key, desired[key], fields))
    adds = [PeerChange(ChangeKind.ADD, key, desired[key]) for key in sorted(desired.keys() - current.keys())]
    return removes + updates + adds


class MeshAgent:
    """Keeps a backend's peers equal to the desired set, changing each peer individually."""

    def __init__(self, backend: MeshBackend):
        self.backend = backend

    def apply(self, change: PeerChange) -> None:
        if change.kind is ChangeKind.REMOVE:
            self.backend.remove_peer(change.public_key)
        elif change.kind is ChangeKind.ADD:
            self.backend.add_or_update_peer(change.peer)
        else:
            self.backend.add_or_update_peer(change.peer, fields=change.fields)

    def reconcile(self, desired_peers: Peers) -> list[PeerChange]:
        """Bring the device to `desired_peers`; return the changes applied. Every change is tried; if any
        failed, ReconcileError says which (the next reconcile plans them again)."""
        status = self.backend.status()
        desired = _by_key(desired_peers, "desired")
        if status.public_key is not None and desired.pop(status.public_key, None) is not None:
            logger.debug("desired peers include this node's own key; ignored")
        current = {p.public_key: PeerConfig.from_status(p) for p in status.peers}
        changes = plan(current, desired)
        applied: list[PeerChange] = []
        failed: list[tuple[PeerChange, Exception]] = []
        for change in changes:
            try:
                self.apply(change)
            except Exception as e:  # one bad peer must not stop the others from being applied
                failed.append((change, e))
            else:
                applied.append(change)
        if changes:
            logger.info("mesh %s: %d peer changes (%s)", self.backend.interface, len(changes),
                        ", ".join(f"{c.kind} {c.public_key[:8]}" for c in changes))
        if failed:
            raise ReconcileError(applied, failed)
        return applied
