"""Assembly of the coordinator's aiohttp application and its background work.

Owns the configuration, the `cleanup_ctx` steps (database and blob store, the signature checker's process, heartbeat
batcher, DHT bootstrap peer, the supervisor loop) and the loop itself, which does its work only while this process leads
(`coordinator.leader`; a new leader, like a restarted coordinator, gives nodes a node timeout before it loses any):
advancing the sweeps (`coordinator.sweeps`), marking silent nodes offline, losing their assignments, the matching step
(`coordinator.matching`), settling ended jobs, reading progress from the DHT, forgetting expired nonces, and every
`blob_sweep_interval` the blob store's retention pass (`blobs.sweep`). Every coordinator reads the live adverts from the
DHT and remembers the nodes' DHT addresses for its next start. Request handling lives in the `views` package; a job the
matching step starts moves through `jobs.apply`. This module only wires things together.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import time
from collections.abc import AsyncIterator
from pathlib import Path

from aiohttp import web
from gpuswarm.coordinator import (
    audits,
    authority,
    blobs,
    challenge,
    dashboard,
    ledger,
    matching,
    migrate,
    sweeps,
    tasks,
    tensorboard,
    views,
)
from gpuswarm.coordinator.config import (
    ADMIN_TOKEN,
    ADVERTS,
    AUTHORITY,
    BLOB_LOCK,
    BLOBS,
    CONFIG,
    DHT,
    DHT_PEERS,
    HEARTBEATS,
    LEADERSHIP,
    MESH_VERSION,
    METRICS,
    NODE_PEERS,
    SESSIONS,
    SIGNATURES,
    WAKE,
    CoordinatorConfig,
)
from gpuswarm.coordinator.db import (
    AssignmentRow,
    Job,
    JobEvent,
    Node,
    forget_expired_nonces,
    in_chunks,
    make_engine,
    sessionmaker,
)
from gpuswarm.coordinator.errors import error_middleware
from gpuswarm.coordinator.heartbeats import HeartbeatBatcher
from gpuswarm.coordinator.leader import Leadership
from gpuswarm.coordinator.mesh import MeshVersion, update_relays
from gpuswarm.coordinator.metrics import CoordinatorMetrics, metrics_middleware, setup_metrics
from gpuswarm.coordinator.sigcheck import SignatureChecker
from gpuswarm.coordinator.store import BlobStore, LocalBlobStore
from gpuswarm.mesh import ipam
from gpuswarm.proto.models import AssignmentState, JobState
from sqlalchemy import or_, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

logger = logging.getLogger(__name__)
DHT_TIMEOUT = 5.0
# Seconds the DHT process gets to stop before it is killed. Its graceful stop was seen to take longer than hivemind's
# default of 3 s, every time. The bootstrap peer has nothing to hand over, and it keeps its peers in dht-peers.json.
DHT_STOP_TIMEOUT = 1.0
PEER_PROBE_TIMEOUT = 1.0  # seconds a remembered DHT peer gets to take a TCP connection before start-up goes on


def load_or_create_admin_token(path: Path) -> str:
    """The admin token (revocations): created once at mode 0600 beside the database, like a node's key."""
    if path.exists():
        return path.read_text().strip()
    token = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    logger.info("created the admin token in %s", path)
    return token


async def _database(app: web.Application) -> AsyncIterator[None]:
    config = app[CONFIG]
    config.data_dir.mkdir(parents=True, exist_ok=True)
    config.artifact_dir.mkdir(parents=True, exist_ok=True)
    app[ADMIN_TOKEN] = load_or_create_admin_token(config.admin_token_file)
    engine = make_engine(config.db_url)
    try:
        # A fresh database and one from an older version both end at the current schema (usually a no-op check).
        await migrate.upgrade(engine)
        app[SESSIONS] = sessionmaker(engine)
        app[LEADERSHIP] = Leadership(engine)
        app[AUTHORITY] = await authority.load(app[SESSIONS], config.dht_cert_ttl)
        if BLOBS not in app:  # a test or an operator may have given an object store
            store = LocalBlobStore(config.blob_dir)
            store.setup()
            app[BLOBS] = store
        app[BLOB_LOCK] = asyncio.Lock()
        # Artifact files of an older data directory (artifact_dir/JOB/NAME) move into the store, once.
        await blobs.adopt_legacy_artifacts(app[SESSIONS], app[BLOBS], config.artifact_dir, time.time())
        yield
    finally:
        if LEADERSHIP in app:
            await app[LEADERSHIP].close()
        await engine.dispose()


async def _dht(app: web.Application) -> AsyncIterator[None]:
    """The swarm's bootstrap peer. Nodes learn its multiaddrs at registration; it also validates node adverts.

    It keeps its identity (`dht.key`) and port (`dht.port`) in the data directory, and the multiaddrs of the
    nodes it last saw (`dht-peers.json`, from `node_peers`): after a restart it is the same peer at the same
    address, and it rejoins the nodes' DHT through them instead of starting an empty one of its own."""
    config = app[CONFIG]
    app[ADVERTS], app[NODE_PEERS] = {}, []
    if not config.start_dht:
        app[DHT_PEERS] = []
        yield
        return
    loop = asyncio.get_running_loop()
    dht = await loop.run_in_executor(None, _start_dht, config, app[AUTHORITY].public_key)
    app[DHT_PEERS] = [str(m) for m in dht.get_visible_maddrs()]
    app[DHT] = dht
    logger.info("DHT bootstrap peer at %s", ", ".join(app[DHT_PEERS]))
    try:
        yield
    finally:
        await loop.run_in_executor(None, dht.shutdown)


def _start_dht(config: CoordinatorConfig, authority: str):
    from gpuswarm.dht.swarm import SwarmDHT
    from gpuswarm.dht.validators import validators
    from hivemind.p2p import P2PDaemonError

    port_file, peers_file = config.data_dir / "dht.port", config.data_dir / "dht-peers.json"
    port = config.dht_port or _saved_port(port_file, config.dht_host)
    remembered = list(dict.fromkeys([*config.dht_initial_peers, *_read_json_list(peers_file)]))
    known = answering(remembered)
    if len(known) < len(remembered):
        logger.info("%d of the %d DHT peers given or seen before the restart did not answer within %.0f s; "
                    "starting without them", len(remembered) - len(known), len(remembered), PEER_PROBE_TIMEOUT)

    def start(initial_peers: list[str]):
        return SwarmDHT(
            host_maddrs=[f"/ip4/{config.dht_host}/tcp/{port}"], start=True, initial_peers=initial_peers,
            identity_path=str(config.data_dir / "dht.key"), check_if_identity_free=False,
            ensure_bootstrap_success=False, shutdown_timeout=DHT_STOP_TIMEOUT,
            # It stores and reads only records chained to this swarm's authority (gpuswarm.dht.validators).
            record_validators=validators(authority))

    try:
        dht = start(known)
    except P2PDaemonError as e:  # p2pd refuses to start when no bootstrap peer answers: start alone
        if not known:
            raise
        logger.info("p2pd could not bootstrap from the %d peers that answered (%s); starting alone", len(known), e)
        dht = start([])
    ports = {int(m.value_for_protocol("tcp")) for m in dht.get_visible_maddrs() if "/tcp/" in str(m)}
    if len(ports) == 1:
        port_file.write_text(f"{ports.pop()}\n")
    return dht


def answering(maddrs: list[str], timeout: float = PEER_PROBE_TIMEOUT) -> list[str]:
    """The multiaddrs among `maddrs` whose TCP port takes a connection within `timeout` (all probed at once), in
    their order; one that names no IP address and TCP port is kept untried. p2pd waits out its dial timeout (about
    15 s) on a bootstrap peer that stays silent, a node whose host has gone, while the coordinator cannot serve."""
    import socket
    from concurrent.futures import ThreadPoolExecutor

    def answers(maddr: str) -> bool:
        parts = maddr.split("/")  # /ip4/HOST/tcp/PORT/p2p/ID
        if len(parts) < 5 or parts[1] not in ("ip4", "ip6") or parts[3] != "tcp":
            return True
        try:
            with socket.create_connection((parts[2], int(parts[4])), timeout=timeout):
                return True
        except (OSError, ValueError):
            return False

    if not maddrs:
        return []
    with ThreadPoolExecutor(max_workers=min(len(maddrs), 32)) as pool:
        return [m for m, ok in zip(maddrs, pool.map(answers, maddrs), strict=True) if ok]


def _saved_port(path: Path, host: str) -> int:
    """The port the DHT used last time if it is still free, else 0 (any)."""
    import socket

    try:
        port = int(path.read_text())
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
        return port
    except (OSError, ValueError):
        return 0


def _read_json_list(path: Path) -> list[str]:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    return [str(v) for v in value if isinstance(v, str)] if isinstance(value, list) else []


MAX_BOOTSTRAP_NODES = 8  # node peers handed out beside the coordinator's own, and remembered for a restart


async def node_peers(sessions: async_sessionmaker[AsyncSession], adverts: dict) -> list[str]:
    """DHT multiaddrs of a few live nodes, from their signed adverts: only nodes registered here and online."""
    online: set[str] = set()
    async with sessions() as session:
        for ids in in_chunks(adverts):
            online.update((await session.scalars(select(Node.id).where(
                Node.id.in_(ids), Node.online.is_(True), Node.revoked.is_(False)))).all())
    maddrs = [m for node_id, advert in adverts.items() if node_id in online and advert.get("state") != "offline"
              for m in advert.get("maddrs", [])[:2]]
    return maddrs[:2 * MAX_BOOTSTRAP_NODES]


def remember_peers(config: CoordinatorConfig, maddrs: list[str]) -> None:
    """Keep the live nodes' DHT multiaddrs for the next start (atomically: a crash leaves the old list)."""
    path = config.data_dir / "dht-peers.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(maddrs))
    os.replace(tmp, path)


async def _heartbeats(app: web.Application) -> AsyncIterator[None]:
    batcher = HeartbeatBatcher(app[SESSIONS], app[CONFIG], app[METRICS])
    batcher.start()
    app[HEARTBEATS] = batcher
    yield
    await batcher.stop()


async def _signatures(app: web.Application) -> AsyncIterator[None]:
    if not app[CONFIG].signature_process:
        yield
        return
    checker = SignatureChecker()
    await checker.start()
    app[SIGNATURES] = checker
    yield
    await checker.stop()


async def _supervisor(app: web.Application) -> AsyncIterator[None]:
    app[WAKE] = asyncio.Event()
    app[MESH_VERSION] = MeshVersion()
    task = asyncio.create_task(supervise(app), name="coordinator-supervisor")
    yield
    await tasks.stop(task)


async def _release_long_polls(app: web.Application) -> None:
    """on_shutdown: runs once the server stopped accepting and before it waits for the requests in flight, which
    would otherwise wait out every node's mesh long-poll (the whole shutdown timeout; decision 0021)."""
    if MESH_VERSION in app:
        await app[MESH_VERSION].release()


async def supervise(app: web.Application) -> None:
    """Run `tick` every loop_interval, or sooner when a request wakes it. One failed tick never ends the loop."""
    config, leadership = app[CONFIG], app[LEADERSHIP]
    last_observe = last_sweep = 0.0
    while True:
        try:
            leading = await leadership.check()
            # Nodes get a full node_timeout from when this process began to lead to reach it (see `tick`).
            if leading:
                # Sweeps first: the trial jobs they start are matched by this very tick.
                await sweeps.advance_all(app[SESSIONS], app[BLOB_LOCK], time.time())
                await audits.advance_all(app[SESSIONS], app[AUTHORITY].secret("audit"), config.audit_rate,
                                         time.time())
                silent = await tick(app[SESSIONS], config, time.time(), app[METRICS], app[BLOBS],
                                    since=leadership.since)
                async with app[SESSIONS].begin() as session:
                    relays_changed = await update_relays(session, time.time())
                if silent or relays_changed:
                    await app[MESH_VERSION].bump()  # peers went offline, or pairs got or lost a relay
            if DHT in app and time.monotonic() - last_observe > 5.0:
                last_observe = time.monotonic()
                app[ADVERTS] = await observe_adverts(app[DHT])
                peers = await node_peers(app[SESSIONS], app[ADVERTS])
                if peers and peers != app[NODE_PEERS]:
                    remember_peers(config, peers)
                app[NODE_PEERS] = peers
                if leading:
                    await observe_progress(app[SESSIONS], app[DHT])
            if leading and time.monotonic() - last_sweep >= config.blob_sweep_interval:
                last_sweep = time.monotonic()
                await blobs.sweep(app[SESSIONS], app[BLOBS], app[BLOB_LOCK], time.time(), config.blob_retention)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("supervisor tick failed; retrying")
            app[METRICS].supervisor_failures.inc()
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a cancellation that lands as its
        # timeout fires (CPython gh-86296), and this loop would outlive its shutdown.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(config.loop_interval):
                await app[WAKE].wait()
        app[WAKE].clear()


async def dht_get(dht, key: str):
    """`dht.get(key, latest=True)`, awaited without blocking the loop and given up after DHT_TIMEOUT seconds: a
    lookup that never answers must not stall the supervisor (matching, settlement) behind it."""
    try:
        return await asyncio.wait_for(dht.get(key, latest=True, return_future=True), DHT_TIMEOUT)
    except TimeoutError:
        logger.warning("DHT lookup of %s timed out after %.0fs", key, DHT_TIMEOUT)
        return None


async def observe_adverts(dht) -> dict:
    """The node adverts currently live in the DHT, by node id (validated by the DHT's record validator)."""
    from gpuswarm.proto.dht import NODES_KEY, decode_advert

    found = await dht_get(dht, NODES_KEY)
    adverts = {}
    if found is not None and isinstance(found.value, dict):
        for node_id, item in found.value.items():
            with contextlib.suppress(Exception):
                advert = decode_advert(item.value).model_dump(mode="json")
                adverts[node_id] = advert | {"dht_expiry": item.expiration_time}
    return adverts


def swarm_epoch(epochs: list[int]) -> int:
    """The epoch a run has reached by its members' progress records: the second highest, so that one member (whose
    record is its own to write, decision 0025) cannot lift it alone."""
    ranked = sorted(epochs, reverse=True)
    return ranked[1] if len(ranked) >= 2 else ranked[0]


async def observe_progress(sessions: async_sessionmaker[AsyncSession], dht) -> None:
    """Record the epoch of each job whose books are open (running, or ended and not yet settled) as hivemind's own
    progress records in the DHT show it (`swarm_epoch`): the ledger does not credit claims for epochs the swarm
    never reached. Read every 5 s, so a job's last rounds are seen in its settlement grace: a job whose rounds end
    within seconds of one another could otherwise end with epochs the coordinator never saw. Only members' records
    get this far: the DHT's validators refuse the rest."""
    from gpuswarm.proto.dht import job_run_id

    async with sessions() as session:
        open_books = (await session.scalars(select(Job.id).where(or_(
            Job.state == JobState.RUNNING.value,
            Job.state.in_([s.value for s in JobState if s.is_final]) & Job.settled_at.is_(None))))).all()
    epochs = {}
    for job_id in open_books:
        found = await dht_get(dht, f"{job_run_id(job_id)}_progress")  # hivemind's ProgressTracker key for a run
        if found is not None and isinstance(found.value, dict):
            seen = [item.value.get("epoch") for item in found.value.values() if isinstance(item.value, dict)]
            seen = [e for e in seen if isinstance(e, int) and e >= 0]
            if seen:
                epochs[job_id] = swarm_epoch(seen)
    if epochs:
        async with sessions.begin() as session:
            for ids in in_chunks(epochs):
                for job in (await session.scalars(select(Job).where(Job.id.in_(ids)))).all():
                    job.dht_epoch = max(job.dht_epoch or 0, epochs[job.id])


async def tick(sessions: async_sessionmaker[AsyncSession], config: CoordinatorConfig, now: float,
               metrics: CoordinatorMetrics | None = None, store: BlobStore | None = None,
               since: float = 0.0) -> list[str]:
    """One pass of the coordinator's bookkeeping. Returns the ids of nodes it found silent and took offline.
    `store`: where settlement writes a job's TensorBoard file (None: the local store under the data dir).
    `since`: when this process began running ticks. A node is silent only when it has not been heard from for
    node_timeout seconds *and* this process has been up that long: after a restart (or a failover) the nodes
    that kept training through the outage get a full timeout to find the coordinator again, and keep their
    assignments."""
    store = store or LocalBlobStore(config.blob_dir)
    async with sessions.begin() as session:
        silent = await _lose_silent_nodes(session, config, now) if now - since > config.node_timeout else []
        started = time.perf_counter()
        matched = await matching.assign(session, config, now)
        matching_seconds = time.perf_counter() - started
        await _settle_ended_jobs(session, config, now, store)
        await forget_expired_nonces(session, now)
    if metrics is not None:  # after the commit: assignments that were rolled back are not counted
        metrics.matched(matching_seconds, len(matched))
    return silent


async def _lose_silent_nodes(session: AsyncSession, config: CoordinatorConfig, now: float) -> list[str]:
    silent = (await session.scalars(
        select(Node).where(Node.online.is_(True), Node.last_seen < now - config.node_timeout)
    )).all()
    for node in silent:
        node.online = False
        node.state = "offline"
        lost = (await session.scalars(select(AssignmentRow).where(
            AssignmentRow.node_id == node.id, AssignmentRow.state == AssignmentState.ACTIVE.value))).all()
        for a in lost:
            a.state, a.ended_at, a.reason = AssignmentState.LOST.value, now, "node stopped heart-beating"
            session.add(JobEvent(job_id=a.job_id, at=now, message=f"node {node.id} lost (no heartbeat for "
                                 f"{now - node.last_seen:.0f}s); looking for a replacement"))
        logger.warning("node %s is offline; %d assignment(s) lost", node.id, len(lost))
    return [node.id for node in silent]


async def _settle_ended_jobs(session: AsyncSession, config: CoordinatorConfig, now: float,
                             store: BlobStore) -> None:
    """Close the books of jobs that ended at least `settle_grace` seconds ago."""
    ended = (await session.scalars(select(Job).where(
        Job.state.in_([s.value for s in JobState if s.is_final]), Job.settled_at.is_(None),
        Job.finished_at < now - config.settle_grace)
        # Locked, and re-checked under the lock: a leader that lost its lock mid-tick and the new one never both
        # settle a job (PostgreSQL; SQLite has one coordinator).
        .with_for_update(skip_locked=True))).all()
    for job in ended:
        await ledger.settle(session, job, now)
        session.add(JobEvent(job_id=job.id, at=now, message="settled: unspent budget refunded"))
        try:
            # A savepoint: a failed write takes back only its own rows, never the settlement. The points stay in
            # the database, and GET .../artifacts/tensorboard.tfevents renders them on demand without the file.
            async with session.begin_nested():
                await tensorboard.store(session, job.id, store, now)
        except Exception:
            logger.exception("job %s: writing its TensorBoard event file failed; settling it without", job.id)


def create_app(config: CoordinatorConfig) -> web.Application:
    ipam.new_state(config.mesh_cidr)  # a bad --mesh-cidr fails here, not at the first registration
    # The app-wide cap fits the largest artifact; JSON routes enforce their own, much smaller, cap while reading.
    # metrics_middleware is outermost: it records the status error_middleware settled on.
    app = web.Application(middlewares=[metrics_middleware, error_middleware],
                          client_max_size=config.max_artifact_bytes)
    app[CONFIG] = config
    app.cleanup_ctx.extend([_database, _signatures, _heartbeats, _dht, _supervisor])
    app.on_shutdown.append(_release_long_polls)
    setup_metrics(app)  # GET /metrics and the per-app registry
    views.setup_routes(app)
    challenge.setup_routes(app)  # GPU challenge routes and sweep (its cleanup_ctx step follows the database)
    dashboard.setup_routes(app)  # the web page at /dashboard (static files; reads the /v1 API)
    return app
