"""What a handler tells the rest of the coordinator after its transaction: wake the supervisor, bump the mesh.

Owns nothing but these two nudges; the supervisor loop (`app.supervise`) and the mesh long-poll
(`mesh.MeshVersion`) own what they do with them.
"""

from __future__ import annotations

from aiohttp import web
from gpuswarm.coordinator.config import MESH_VERSION, WAKE


def wake(request: web.Request) -> None:
    """Run the supervisor's tick now (matching, settling) rather than at its next interval."""
    if WAKE in request.app:
        request.app[WAKE].set()


async def mesh_changed(request: web.Request) -> int:
    """Tell long-polling nodes that peer lists changed; returns the new mesh version."""
    return await request.app[MESH_VERSION].bump()
