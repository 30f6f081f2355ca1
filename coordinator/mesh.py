"""The coordinator's side of the WireGuard mesh: addresses, peer lists, and pushing changes to nodes.

Owns the persisted IPAM state (`gpuswarm.mesh.ipam` does the arithmetic), each node's peer list (every other
online, unrevoked node of the mesh), and `MeshVersion`, the change counter that long-polling nodes wait on.
The version starts from the clock in milliseconds, so it never goes backwards across a coordinator restart and
a node's `since` from before the restart is simply answered at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from gpuswarm.coordinator.db import MeshIPAM, Node
from gpuswarm.mesh import ipam
from gpuswarm.proto.models import MeshConfig, MeshPeer
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession


class MeshVersion:
    def __init__(self) -> None:
        self.value = int(time.time() * 1000)
        self._changed = asyncio.Condition()

    async def bump(self) -> int:
        async with self._changed:
            self.value = max(self.value + 1, int(time.time() * 1000))
            self._changed.notify_all()
        return self.value

    async def wait_past(self, since: int, timeout: float) -> int:
        """Return as soon as the version is past `since`, or after `timeout` seconds with the current version."""
        async with self._changed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait_for(lambda: self.value > since), timeout)
        return self.value


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


def as_peer(node: Node) -> MeshPeer:
    return MeshPeer(node_id=node.id, public_key=node.wg_public_key, address=node.mesh_address,
                    endpoints=node.mesh_endpoints or [])


async def mesh_config(session: AsyncSession, node: Node, cidr: str, version: int) -> MeshConfig:
    others = (await session.scalars(select(Node).where(
        Node.id != node.id, Node.online.is_(True), Node.revoked.is_(False), Node.mesh_address.is_not(None),
    ).order_by(Node.id))).all()
    return MeshConfig(address=node.mesh_address, cidr=cidr, version=version, peers=[as_peer(n) for n in others])
