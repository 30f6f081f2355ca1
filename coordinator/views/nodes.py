"""Handlers of the node routes: registration, heartbeats, the mesh long-poll, assignments, the node list, revoking.

Owns /v1/nodes/register, /v1/nodes/heartbeat, /v1/mesh/peers, /v1/nodes/assignments, GET /v1/nodes and
POST /v1/nodes/{node_id}/revoke. Every node route authenticates through `auth.read_signed` and
`auth.authenticate_node` (heartbeats in `heartbeats.HeartbeatBatcher`, with the same rule); each write is one
`sessions.begin()` transaction, so a refused request changes nothing.
"""

from __future__ import annotations

import logging
import time

from aiohttp import web
from gpuswarm.coordinator import audits, blobs, ledger, reputation
from gpuswarm.coordinator.auth import authenticate_node, node_refusal, read_signed, require_admin
from gpuswarm.coordinator.challenge_schedule import after_registration
from gpuswarm.coordinator.config import ADVERTS, AUTHORITY, CONFIG, HEARTBEATS, MESH_VERSION, SESSIONS
from gpuswarm.coordinator.db import AssignmentRow, Job, Node
from gpuswarm.coordinator.errors import Conflict, NotFound
from gpuswarm.coordinator.heartbeats import lose_assignments
from gpuswarm.coordinator.mesh import assign_address, mesh_config, release_address
from gpuswarm.coordinator.openapi import describe, respond
from gpuswarm.coordinator.requests import observed_endpoint
from gpuswarm.coordinator.views import shapes
from gpuswarm.coordinator.views.general import bootstrap_peers
from gpuswarm.coordinator.views.signals import mesh_changed, wake
from gpuswarm.proto import api
from gpuswarm.proto.models import (
    AssignmentPoll,
    AssignmentState,
    Heartbeat,
    MeshConfig,
    MeshPoll,
    NodeRegistration,
    NodeState,
    RegistrationResponse,
)
from sqlalchemy import select

logger = logging.getLogger(__name__)
routes = web.RouteTableDef()


@routes.post("/v1/nodes/register")
@describe(auth="node", body=NodeRegistration, signed="register", response=RegistrationResponse)
async def register(request: web.Request) -> web.Response:
    """Register (or re-register) a node; with the mesh, returns its mesh address and peers."""
    message = await read_signed(request, "register", NodeRegistration)
    reg = message.payload
    config, now = request.app[CONFIG], time.time()
    async with request.app[SESSIONS].begin() as session:
        node = await authenticate_node(session, message, registering=True)
        if node is None:
            node = Node(id=reg.node_id, public_key=message.envelope.public_key, registered_at=now)
            session.add(node)
        resources = reg.resources.model_dump(mode="json")
        after_registration(node, node.resources != resources, config, now)  # GPU challenge due; new claim: unverified
        node.resources = resources
        node.software_version = reg.software_version
        node.price_per_gpu_hour = reg.price_per_gpu_hour
        # The address the coordinator saw the node from is a candidate endpoint the node itself may not know.
        node.endpoints = list(dict.fromkeys([*reg.endpoints, *([request.remote] if request.remote else [])]))
        node.state, node.online, node.last_seen = NodeState.IDLE.value, True, now
        if reg.mesh is not None:
            if node.wg_public_key and node.wg_public_key != reg.mesh.public_key:
                await release_address(session, config.mesh_cidr, node.wg_public_key, now)
            node.wg_public_key = reg.mesh.public_key
            node.mesh_address = await assign_address(session, config.mesh_cidr, reg.mesh.public_key, now)
            observed = observed_endpoint(request, reg.mesh.listen_port)
            node.mesh_endpoints = list(dict.fromkeys([*reg.mesh.endpoints, *([observed] if observed else [])]))
        else:
            node.mesh_address = None
    logger.info("node %s registered (%d GPU(s), %s, %s)", reg.node_id, reg.resources.gpu_count,
                reg.software_version, f"mesh {node.mesh_address}" if reg.mesh else "no mesh")
    wake(request)
    mesh = None
    if reg.mesh is not None:
        version = await mesh_changed(request)
        async with request.app[SESSIONS]() as session:
            mesh = await mesh_config(session, await session.get(Node, reg.node_id), config.mesh_cidr, version)
    authority = request.app[AUTHORITY]
    response = RegistrationResponse(node_id=reg.node_id, dht_initial_peers=bootstrap_peers(request.app),
                                    heartbeat_interval=config.heartbeat_interval, advert_ttl=config.advert_ttl,
                                    mesh=mesh, authority=authority.public_key,
                                    certificate=authority.node_cert(reg.node_id))
    return respond(response)


@routes.post("/v1/nodes/heartbeat")
@describe(auth="node", body=Heartbeat, signed="heartbeat", response=api.HeartbeatAnswer)
async def heartbeat(request: web.Request) -> web.Response:
    """A node's heartbeat: state, training progress, failures, RTTs to peers."""
    message = await read_signed(request, "heartbeat", Heartbeat)
    outcome = await request.app[HEARTBEATS].submit(message)  # authenticates it, in a batch
    if outcome.wake:
        wake(request)
    if outcome.membership_changed:
        await mesh_changed(request)
    # A heartbeat refused (revoked, unknown) raised above: only a node in good standing gets a cert. The answer is
    # built as a model (the cert as it is), not validated from a dict: 3 times in a row per heartbeat was costly.
    return respond(api.HeartbeatAnswer(server_time=time.time(), challenge=outcome.challenge,
                                       certificate=request.app[AUTHORITY].node_cert(message.payload.node_id)))


@routes.post("/v1/mesh/peers")
@describe(auth="node", body=MeshPoll, signed="mesh_poll", response=MeshConfig)
async def mesh_peers(request: web.Request) -> web.Response:
    """Long-poll: answers as soon as the mesh version passes `since` (at once if it already has), or after
    `mesh_poll_timeout` seconds with the current list. Nodes apply joins, leaves and revocations from here."""
    message = await read_signed(request, "mesh_poll", MeshPoll)
    config = request.app[CONFIG]
    async with request.app[SESSIONS].begin() as session:
        node = await authenticate_node(session, message)
        if node.mesh_address is None:
            raise Conflict(f"node {node.id} registered without the mesh", code="no_mesh")
    version = await request.app[MESH_VERSION].wait_past(message.payload.since, config.mesh_poll_timeout)
    async with request.app[SESSIONS]() as session:
        node = await session.get(Node, message.node_id)
        if (refusal := node_refusal(message, node, nonce_seen=False)) is not None:  # revoked while it waited
            raise refusal
        mesh = await mesh_config(session, node, config.mesh_cidr, version)
    return respond(mesh)


@routes.post("/v1/nodes/{node_id}/revoke")
@describe(auth="admin", response=api.RevokeAnswer)
async def revoke_node(request: web.Request) -> web.Response:
    """Admin: remove a node from every peer's mesh, end its assignments, refuse its later requests."""
    require_admin(request)
    node_id, now = request.match_info["node_id"], time.time()
    async with request.app[SESSIONS].begin() as session:
        node = await session.get(Node, node_id)
        if node is None:
            raise NotFound(f"node {node_id} is not registered", code="unknown_node")
        if node.revoked:
            raise Conflict(f"node {node_id} is already revoked", code="revoked")
        node.revoked, node.online, node.state = True, False, NodeState.OFFLINE.value
        if node.wg_public_key:
            await release_address(session, request.app[CONFIG].mesh_cidr, node.wg_public_key, now)
        await lose_assignments(session, node.id, now, "node revoked")
    logger.warning("node %s revoked", node_id)
    await mesh_changed(request)
    wake(request)
    return respond(api.RevokeAnswer, shapes.revoked_json(node_id))


@routes.post("/v1/nodes/assignments")
@describe(auth="node", body=AssignmentPoll, signed="poll", response=api.AssignmentList)
async def poll_assignments(request: web.Request) -> web.Response:
    """The node's active assignments, each with its job's newest checkpoint (if any); the audits of its rounds
    waiting for its evidence, and the rounds it is to referee."""
    message = await read_signed(request, "poll", AssignmentPoll)
    async with request.app[SESSIONS].begin() as session:
        await authenticate_node(session, message)
        rows = (await session.execute(
            select(AssignmentRow, Job).join(Job, Job.id == AssignmentRow.job_id)
            .where(AssignmentRow.node_id == message.node_id, AssignmentRow.state == AssignmentState.ACTIVE.value)
        )).all()
        job_ids = [j.id for _, j in rows]
        checkpoints = await blobs.latest_checkpoints(session, job_ids, await ledger.banned(session, job_ids))
        body = shapes.assignments_json(rows, bootstrap_peers(request.app), checkpoints, request.app[AUTHORITY])
        body["audits"] = [r.model_dump(mode="json") for r in await audits.requests_for(session, message.node_id)]
        body["referee"] = [t.model_dump(mode="json") for t in await audits.tasks_for(session, message.node_id)]
    return respond(api.AssignmentList, body)


@routes.get("/v1/nodes")
@describe(auth="anyone", response=api.NodeList)
async def list_nodes(request: web.Request) -> web.Response:
    """Every registered node: resources, price, reputation, verification, state, live DHT advert."""
    async with request.app[SESSIONS]() as session:
        nodes = (await session.scalars(select(Node).order_by(Node.registered_at))).all()
        jobs: dict[str, list[str]] = {}
        for node_id, job_id in await session.execute(select(AssignmentRow.node_id, AssignmentRow.job_id).where(
                AssignmentRow.state == AssignmentState.ACTIVE.value)):
            jobs.setdefault(node_id, []).append(job_id)
        scores = await reputation.scores(session, nodes, time.time())
    return respond(api.NodeList, shapes.node_list_json(nodes, request.app.get(ADVERTS, {}), jobs, scores))
