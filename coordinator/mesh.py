"""The coordinator's side of the WireGuard mesh: addresses, peer lists, and pushing changes to nodes.

Owns the persisted IPAM state (`gpuswarm.mesh.ipam` does the arithmetic), each node's peer list (every other
online, unrevoked node of the mesh, with the relay to route through where the two have no direct path), the relay
plan (`update_relays`, run by the leader's supervisor: `gpuswarm.mesh.relays` decides), and `MeshVersion`, the
change counter that long-polling nodes wait on. The version starts from the clock in milliseconds, so it never
goes backwards across a coordinator restart and a node's `since` from before the restart is simply answered at
once. A stopping coordinator answers every long-poll at once (`release`), so a stop does not wait out the polls.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from gpuswarm.coordinator.db import MeshIPAM, MeshRelay, Node
from gpuswarm.mesh import ipam
from gpuswarm.mesh.relays import plan_relays
from gpuswarm.proto.models import MeshConfig, MeshPeer
from sqlalchemy import or_, select
from sqlalchemy.ext.asyncio import AsyncSession


class MeshVersion:
    def __init__(self) -> None:
        self.value = int(time.time() * 1000)
        self._changed = asyncio.Condition()
        self._released = False

    async def bump(self) -> int:
        async with self._changed:
            self.value = max(self.value + 1, int(time.time() * 1000))
            self._changed.notify_all()
        return self.value

    async def wait_past(self, since: int, timeout: float) -> int:
        """Return as soon as the version is past `since`, or after `timeout` seconds with the current version."""
        async with self._changed:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._changed.wait_for(lambda: self.value > since or self._released)
        return self.value

    async def release(self) -> None:
        """The coordinator is stopping: answer the long-polls waiting now, and later ones at once, with the current
        version. Each node polls again, finds this coordinator gone and turns to the next one (or retries)."""
        async with self._changed:
            self._released = True
            self._changed.notify_all()


async def _load_ipam(session: AsyncSession, cidr: str) -> MeshIPAM:
    row = await session.get(MeshIPAM, 1)
    if row is None:
        row = MeshIPAM(id=1, state=ipam.new_state(cidr))
        session.add(row)
    return row


async def assign_address(session: AsyncSession, cidr: str, public_key: str, now: float) -> str:
    """The mesh address of `public_key`: the same one as before if it had one (stable per key)."""
    row = await _load_ipam(session, cidr)
    state, address = ipam.allocate(row.state, public_key, now)
    row.state = state
    return address


async def release_address(session: AsyncSession, cidr: str, public_key: str, now: float) -> None:
    """Give an address back; IPAM holds it for its grace period before anyone else may have it."""
    row = await _load_ipam(session, cidr)
    row.state = ipam.release(row.state, public_key, now)


def as_peer(node: Node, via: str | None = None) -> MeshPeer:
    return MeshPeer(node_id=node.id, public_key=node.wg_public_key, address=node.mesh_address,
                    endpoints=node.mesh_endpoints or [], via=via)


def _in_mesh():
    return Node.online.is_(True), Node.revoked.is_(False), Node.mesh_address.is_not(None)


async def mesh_config(session: AsyncSession, node: Node, cidr: str, version: int) -> MeshConfig:
    others = (await session.scalars(select(Node).where(Node.id != node.id, *_in_mesh()).order_by(Node.id))).all()
    relays = (await session.scalars(select(MeshRelay).where(
        or_(MeshRelay.node_a == node.id, MeshRelay.node_b == node.id, MeshRelay.relay == node.id)))).all()
    via = {(r.node_b if r.node_a == node.id else r.node_a): r.relay for r in relays if r.relay != node.id}
    return MeshConfig(address=node.mesh_address, cidr=cidr, version=version,
                      peers=[as_peer(n, via.get(n.id)) for n in others],
                      forward=any(r.relay == node.id for r in relays))


async def update_relays(session: AsyncSession, now: float) -> bool:
    """Plan relays again from the online nodes' latest reports; True when the plan changed (bump the mesh)."""
    unreachable = dict((await session.execute(select(Node.id, Node.mesh_unreachable).where(*_in_mesh()))).all())
    current = {(r.node_a, r.node_b): r for r in (await session.scalars(select(MeshRelay))).all()}
    if not current and not any(unreachable.values()):
        return False  # the usual case: every pair has its path (and the RTTs need not be read)
    rtts = dict((await session.execute(select(Node.id, Node.peer_rtt_ms).where(*_in_mesh()))).all())
    plan = plan_relays(unreachable, {n: r or {} for n, r in rtts.items()},
                       {n: u or () for n, u in unreachable.items()}, {p: r.relay for p, r in current.items()})
    if plan == {p: r.relay for p, r in current.items()}:
        return False
    for p, row in current.items():
        if p not in plan:
            await session.delete(row)
        elif plan[p] != row.relay:
            row.relay, row.since = plan[p], now
    session.add_all(MeshRelay(node_a=a, node_b=b, relay=relay, since=now)
                    for (a, b), relay in plan.items() if (a, b) not in current)
    return True
