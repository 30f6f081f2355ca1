"""Handlers of the routes about the coordinator itself: health, the OpenAPI document, the DHT bootstrap peers.

Owns GET /v1/health, /v1/openapi.json and /v1/dht. Reads no database.
"""

from __future__ import annotations

from aiohttp import web
from gpuswarm.coordinator import openapi
from gpuswarm.coordinator.config import AUTHORITY, DHT_PEERS, LEADERSHIP
from gpuswarm.coordinator.openapi import describe, respond
from gpuswarm.coordinator.views import shapes
from gpuswarm.proto import api

routes = web.RouteTableDef()


@routes.get("/v1/health")
@describe(auth="anyone", response=api.Health)
async def health(request: web.Request) -> web.Response:
    """Liveness, version, the coordinator's clock, and whether it leads (runs matching and settlement)."""
    return respond(api.Health, shapes.health_json(request.app[LEADERSHIP].leader))


@routes.get("/v1/openapi.json")
async def openapi_document(request: web.Request) -> web.Response:
    """This API's OpenAPI 3.1 document."""
    return web.json_response(openapi.build(request.app))


@routes.get("/v1/dht")
@describe(auth="anyone", response=api.DhtPeers)
async def dht_peers(request: web.Request) -> web.Response:
    """The DHT bootstrap peer's multiaddrs."""
    return respond(api.DhtPeers, shapes.dht_json(bootstrap_peers(request.app), request.app[AUTHORITY].public_key))


def bootstrap_peers(app: web.Application) -> list[str]:
    """DHT multiaddrs a node or a worker should start from: this coordinator's own. Not the nodes' too: p2pd
    waits out the dial timeout (about 15 s) of any bootstrap peer that has gone, and a node's daemon does not
    heartbeat while its DHT starts, so a stale node address got nodes declared lost (CI, tests/netns). The nodes
    find each other through the DHT itself; the coordinator remembers them for its own restart (app.node_peers)."""
    return list(app[DHT_PEERS])
