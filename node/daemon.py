"""The node daemon: a supervisor loop over registration, heartbeats, assignments, training and reports.

Shaped like petals' server loop: `run()` waits on a stop event with a timeout, checks what it supervises, starts
what is missing, and cleans up in `finally`. Side effects of a state change live in `enter_state`; the rules are
`states.next_state`. The daemon talks to the coordinator through `gpuswarm.client.api.CoordinatorClient` only, and the
coordinator being down never stops training: claims wait in the outbox, the final model waits for upload. With
`metrics_port` set it serves Prometheus metrics (`gpuswarm.node.metrics`) from a snapshot of its own state.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from gpuswarm.client.api import ApiError, CoordinatorUnavailable, Rejected
from gpuswarm.node import sandbox
from gpuswarm.node.advertiser import Advertiser
from gpuswarm.node.attest import key_signer
from gpuswarm.node.audits import AuditDesk
from gpuswarm.node.cache import ArtifactCache, CacheError
from gpuswarm.node.challenge import Challenger
from gpuswarm.node.identity import Identity
from gpuswarm.node.meshlink import MeshLink, MeshUnavailable
from gpuswarm.node.metrics import GpuReader, MeshPeerStats, MetricsServer, NodeMetrics, NodeSnapshot
from gpuswarm.node.outbox import Outbox
from gpuswarm.node.runner import JobInputs, JobRunner, RunningJob, reportable
from gpuswarm.node.states import Facts, next_state
from gpuswarm.node.trainer_link import Settings
from gpuswarm.proto.dht import KEY_KIND
from gpuswarm.proto.models import (
    MAX_HEARTBEAT_PROGRESS,
    Assignment,
    AssignmentFailure,
    CheckpointRef,
    Heartbeat,
    JobSpec,
    NodeRegistration,
    NodeState,
    Progress,
    Resources,
    RoundReport,
)

from gpuswarm import __version__

logger = logging.getLogger(__name__)
ENDPOINT_RECHECK = 3.0  # seconds between looks at this host's addresses (mesh endpoint changes)
STOP_TIMEOUT = 20.0  # seconds a training process gets to leave its averaging round after SIGTERM
WORKER_STOP_GRACE = 1.5  # ... when the node itself stops (it must be gone within 3 s, systemd's or an operator's)


class NodeRevoked(RuntimeError):
    """The coordinator revoked this node: it refuses everything we send, so the daemon stops."""


@dataclass
class NodeConfig:
    coordinator_url: str
    state_dir: Path
    host: str = "127.0.0.1"  # where hivemind binds and what it announces; the mesh address once the mesh exists
    price_per_gpu_hour: float = 0.0
    shutdown_timeout: float = 30.0
    endpoints: list[str] = field(default_factory=list)
    mesh: bool = False  # join the WireGuard mesh; hivemind then binds to the mesh address instead of `host`
    mesh_listen_port: int = 51820
    mesh_endpoints: list[str] = field(default_factory=list)  # candidates for peers; empty = this host's addresses
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 0  # 0: no metrics endpoint
    allow_custom_code: bool = False  # the operator opted in to running job owners' own code
    cache_max_bytes: int = 20 * 1024**3  # bound of the artifact cache (job code, datasets, checkpoints)
    sandbox: Settings = field(default_factory=Settings)  # how jobs' code runs: limits, the time for one step
    max_job_hours: float | None = None  # wall-time limit of one job on this node
    datasets: dict[str, Path] = field(default_factory=dict)  # node-local datasets for federated jobs, by name
    warm_worker: bool = False  # keep a warm training process while idle (JobRunner.keep_spare)


@dataclass
class PendingUpload:
    """A final model or a checkpoint the training process saved, waiting for the coordinator to take it."""

    job_id: str
    path: Path
    accuracy: float | None = None
    epoch: float | None = None
    metrics: dict | None = None
    checkpoint_step: int | None = None  # set: a checkpoint (only the newest pending one of a job is kept)


class NodeDaemon:
    def __init__(self, config: NodeConfig, identity: Identity, resources: Resources, client):
        self.config, self.identity, self.resources, self.client = config, identity, resources, client
        self.state = NodeState.STARTING
        self.registered = False
        self.reachable = True
        self.interval = 2.0
        self.outbox = Outbox(config.state_dir / "outbox")
        self.runner = JobRunner(config.state_dir / "jobs", config.host, self._on_event,
                                signer=key_signer(identity.private_key)[0], gpu_count=resources.gpu_count,
                                settings=config.sandbox, max_hours=config.max_job_hours,
                                binder=lambda payload: identity.sign(KEY_KIND, payload), spare=config.warm_worker)
        self.cache = ArtifactCache(config.state_dir / "cache", config.cache_max_bytes)
        self._preparing: dict[str, asyncio.Task] = {}  # job id -> fetching its inputs, then starting it
        self._preparing_for: dict[str, Assignment] = {}
        self.advertiser = Advertiser(identity, resources, __version__, config.price_per_gpu_hour, config.host,
                                     ttl=30.0)
        self._dht_peers: list[str] = []
        self.mesh = MeshLink(config.state_dir, config.mesh_listen_port, config.mesh_endpoints or None) \
            if config.mesh else None
        self._mesh_task: asyncio.Task | None = None
        self._registered_endpoints: list[str] = []
        self._endpoints_checked = time.monotonic()
        self._stop_mesh = asyncio.Event()
        self._failures: list[AssignmentFailure] = []
        # The last progress of jobs whose training process ended well, for the next heartbeat: it goes out before
        # the final model, which ends the job (a job that ends in its first round has no other progress, and its
        # training process may be gone before the heartbeat that would have carried it from `runner.running`).
        self._ended: list[Progress] = []
        self._claimed: dict[str, int] = {}  # job -> the highest epoch of its round reports the coordinator took
        self._uploads: list[PendingUpload] = []
        self._seen_assignments: set[int] = set()  # never restart an assignment that already ran here
        self._stopping: set[str] = set()  # jobs we stopped on purpose: their exit is not a failure
        self._stop_tasks: set[asyncio.Task] = set()
        self.challenger = Challenger(client, resources, identity.node_id)  # GPU challenge, when the coordinator asks
        self.audits = AuditDesk(client, identity.node_id, config.state_dir / "jobs", self.runner,
                                lambda job_id, spec: self._fetch_inputs(job_id, spec))
        self.metrics = NodeMetrics(self.metrics_snapshot, GpuReader(enabled=bool(resources.gpus)), __version__)
        self.metrics_server = MetricsServer(self.metrics, config.metrics_host, config.metrics_port) \
            if config.metrics_port else None

    # ------------------------------------------------------------------------------------------------ loop

    async def run(self, stop: asyncio.Event) -> None:
        logger.info("node %s starting (coordinator %s, hivemind on %s)", self.identity.node_id,
                    self.config.coordinator_url, "the mesh address" if self.mesh else self.config.host)
        if self.metrics_server is not None:
            await self.metrics_server.start()  # MetricsUnavailable: stop before registering, and say why
        try:
            while not stop.is_set():
                try:
                    await self._step_unless_stopped(stop)
                except (MeshUnavailable, NodeRevoked):
                    raise  # nothing to retry: stop and say why
                except Exception:  # one bad round never ends the daemon
                    logger.exception("supervisor step failed; continuing")
                with contextlib.suppress(TimeoutError):  # asyncio.timeout: see coordinator.app.supervise
                    async with asyncio.timeout(self.interval):
                        await stop.wait()
        finally:
            try:
                await asyncio.wait_for(self.shutdown(), timeout=self.config.shutdown_timeout)
            finally:
                # Last, so that a scrape during the drain still sees the node stopping.
                if self.metrics_server is not None:
                    await self.metrics_server.stop()
                self.metrics.close()

    async def _step_unless_stopped(self, stop: asyncio.Event) -> None:
        """One `step`, cut short when a stop is asked for: a heartbeat or upload that waits on a slow coordinator (up
        to the client's 10 s) must not hold up the bounded shutdown, which sends what matters again anyway. What a
        cancelled step started cannot outlive the daemon: workers and DHT processes die with it, and the shutdown
        takes down a mesh interface still coming up (MeshLink.close)."""
        step = asyncio.create_task(self.step(), name="supervisor-step")
        stopped = asyncio.create_task(stop.wait())
        try:
            await asyncio.wait((step, stopped), return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
            if not step.done():
                logger.info("stopping: the supervisor step in progress is cut short")
                step.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await step
        if not step.cancelled():
            step.result()

    async def step(self) -> None:
        if self.mesh is not None and self.registered:
            await self._check_endpoints()
        if not self.registered:
            await self._register()
        if self.registered and self.advertiser.dht is None:
            await self._start_advertiser()
        self._collect_exits()
        if self.registered:
            await self._heartbeat()
        if self.registered and self.reachable:
            await self._sync_assignments()
        if self.advertiser.dht is not None and not self._preparing:  # started, and idle unless a job runs
            await self.runner.keep_spare()
        await self._flush_uploads()
        await self._flush_outbox()
        self.transition(stop_requested=False)

    def transition(self, *, stop_requested: bool) -> None:
        new = next_state(self.state, Facts(stop_requested=stop_requested, registered=self.registered,
                                           coordinator_reachable=self.reachable, training=bool(self.runner.running)))
        if new is not self.state:
            self.enter_state(new)

    def enter_state(self, new: NodeState) -> None:
        logger.info("state %s -> %s", self.state.value, new.value)
        self.state = new
        self.advertiser.state = new

    # ------------------------------------------------------------------------------------------------ steps

    async def _register(self) -> None:
        registration = NodeRegistration(node_id=self.identity.node_id, resources=self.resources,
                                        software_version=__version__,
                                        price_per_gpu_hour=self.config.price_per_gpu_hour,
                                        endpoints=self.config.endpoints,
                                        mesh=await self.mesh.registration() if self.mesh else None)
        self._registered_endpoints = registration.mesh.endpoints if registration.mesh else []
        try:
            response = await self.client.register(registration)
        except CoordinatorUnavailable as e:
            self.reachable = False
            logger.warning("%s; retrying in %.0fs", e, self.interval)
            return
        except Rejected as e:
            self._raise_if_revoked(e)
            logger.error("the coordinator refused our registration: %s", e)
            return
        if self.mesh is not None:
            if response.mesh is None:
                raise MeshUnavailable("the coordinator registered us without a mesh address")
            await self.mesh.apply(response.mesh)  # raises MeshUnavailable: the daemon cannot run as asked
            # hivemind binds to and announces only the mesh address from here on.
            self.advertiser.host = self.runner.host = self.mesh.address
            # A fresh long-poll after every registration: after an address change the old one may hang on a
            # connection from an address this host no longer has.
            if self._mesh_task is not None:
                self._mesh_task.cancel()
            self._mesh_task = asyncio.create_task(self.mesh.follow(self.client, self._stop_mesh),
                                                  name="mesh-follow")
        else:
            logger.warning("no WireGuard mesh (--no-mesh): hivemind traffic on %s is NOT encrypted",
                           self.config.host)
        self.registered, self.reachable = True, True
        self.interval = response.heartbeat_interval
        self.advertiser.ttl = response.advert_ttl
        self.advertiser.authority = self.runner.authority = response.authority
        await self.advertiser.renew(response.certificate)
        self._dht_peers = response.dht_initial_peers
        logger.info("registered as %s", self.identity.node_id)

    @staticmethod
    def _raise_if_revoked(error: Rejected) -> None:
        if error.code == "revoked":
            raise NodeRevoked(f"the coordinator revoked this node: {error.message}")

    async def _check_endpoints(self) -> None:
        """Re-register when this host's addresses change, so that peers learn the new endpoint within seconds."""
        if time.monotonic() - self._endpoints_checked < ENDPOINT_RECHECK:
            return
        self._endpoints_checked = time.monotonic()
        endpoints = (await self.mesh.registration()).endpoints
        if endpoints != self._registered_endpoints:
            logger.info("local endpoints changed %s -> %s; registering again", self._registered_endpoints, endpoints)
            self.registered = False

    async def _start_advertiser(self) -> None:
        try:
            await self.advertiser.start(self._dht_peers)
            logger.info("DHT peer up at %s; advert declared", ", ".join(self.advertiser.maddrs))
        except Exception as e:
            logger.error("could not start the DHT peer for the advert (%r); retrying", e)
            self.advertiser.dht = None

    def _collect_exits(self) -> None:
        for job, code in self.runner.exited():
            job_id = job.assignment.job_id
            if code == 0 and (last := reportable(job.history, self._claimed.get(job_id))) is not None:
                self._ended.append(last)
            self._claimed.pop(job_id, None)
            if job_id in self._stopping:
                self._stopping.discard(job_id)
            elif code != 0:
                reason = self.runner.failure_reason(job, code)
                logger.error("job %s failed: %s", job_id, reason.splitlines()[-1] if reason else code)
                self._failures.append(AssignmentFailure(job_id=job_id, reason=reason))

    async def _heartbeat(self) -> None:
        progress = [p for j in self.runner.running.values()
                    if (p := reportable(j.history, self._claimed.get(j.assignment.job_id))) is not None]
        # Jobs that ended before it went out too, as many as the heartbeat has room for.
        ended, failures = self._ended[:max(0, MAX_HEARTBEAT_PROGRESS - len(progress))], list(self._failures)
        progress += ended
        try:
            rtts = self.mesh.peer_rtts() if self.mesh is not None else {}
            unreachable = self.mesh.unreachable_peers() if self.mesh is not None else []
            answer = await self.client.heartbeat(Heartbeat(node_id=self.identity.node_id, state=self.state,
                                                           progress=progress, failures=failures, peer_rtt_ms=rtts,
                                                           unreachable_peers=unreachable))
        except CoordinatorUnavailable as e:
            self.metrics.heartbeat(ok=False)
            if self.reachable:
                logger.warning("%s; training continues and reports are kept", e)
            self.reachable = False
            return
        except Rejected as e:
            self.metrics.heartbeat(ok=False)
            self._raise_if_revoked(e)
            if e.code == "unknown_node":
                logger.warning("the coordinator no longer knows this node; registering again")
                self.registered = False
            else:
                logger.error("heartbeat refused: %s", e)
            return
        self.metrics.heartbeat(ok=True)
        if not self.reachable:
            logger.info("coordinator reachable again")
        self.reachable = True
        self._failures = self._failures[len(failures):]
        self._ended = self._ended[len(ended):]
        await self.advertiser.renew(answer.certificate)
        self.challenger.on_heartbeat(answer)  # runs in the background; a failure there is only logged

    async def _sync_assignments(self) -> None:
        try:
            poll = await self.client.poll()
        except CoordinatorUnavailable:
            self.reachable = False
            return
        except Rejected as e:
            logger.error("assignment poll refused: %s", e)
            return
        assignments = poll.assignments
        self.audits.on_poll(poll.audits, poll.referee)
        active = {a.job_id: a for a in assignments}
        for job_id, job in self.runner.running.items():
            if job_id in active and active[job_id].assignment_id == job.assignment.assignment_id:
                job.ticket = active[job_id].ticket or job.ticket  # the worker picks it up at its next "bind"
        for job_id, task in list(self._preparing.items()):
            if job_id not in active:
                logger.info("job %s is no longer ours; dropping the fetch of its inputs", job_id)
                task.cancel()
        for job_id in list(self.runner.running):
            if job_id not in active and job_id not in self._stopping:
                logger.info("job %s is no longer ours (ended, cancelled or reassigned); stopping", job_id)
                self._stopping.add(job_id)
                # In the background: a worker blocked in an averaging round may take a while, and heartbeats
                # must go on meanwhile. `_collect_exits` sees it leave.
                task = asyncio.create_task(self.runner.stop(job_id, timeout=STOP_TIMEOUT))
                self._stop_tasks.add(task)
                task.add_done_callback(self._stop_tasks.discard)
        for a in assignments:
            if a.job_id in self.runner.running or a.job_id in self._preparing \
                    or a.assignment_id in self._seen_assignments:
                continue
            self._seen_assignments.add(a.assignment_id)
            # In the background: downloading a dataset may take minutes, and heartbeats must go on meanwhile.
            task = asyncio.create_task(self._prepare_and_start(a), name=f"prepare-{a.job_id}")
            self._preparing[a.job_id], self._preparing_for[a.job_id] = task, a
            task.add_done_callback(lambda _, job_id=a.job_id: (self._preparing.pop(job_id, None),
                                                               self._preparing_for.pop(job_id, None)))

    def _fail(self, job_id: str, reason: str) -> None:
        logger.error("job %s failed: %s", job_id, reason)
        self._failures.append(AssignmentFailure(job_id=job_id, reason=reason[:2000]))

    async def _prepare_and_start(self, a: Assignment) -> None:
        """Fetch the job's code, dataset and newest checkpoint into the cache (verified), then start training."""
        if a.spec.custom_code and not self.config.allow_custom_code:
            return self._fail(a.job_id, "this node does not run job owners' code (its operator has not opted in)")
        if a.spec.custom_code and (why := sandbox.unavailable_reason()) is not None:
            return self._fail(a.job_id, f"this node does not run job owners' code without a sandbox: {why}")
        try:
            inputs = await self._fetch_inputs(a.job_id, a.spec, a.checkpoint)
        except asyncio.CancelledError:
            raise
        except (CacheError, ApiError, OSError) as e:
            return self._fail(a.job_id, f"could not fetch the job's inputs: {e}")
        except Exception as e:  # a bug must not leave the assignment active with nothing running
            logger.exception("fetching the inputs of %s failed", a.job_id)
            return self._fail(a.job_id, f"could not fetch the job's inputs: {e!r}")
        if len(self.runner.free_gpus()) < (a.spec.gpus_per_node if self.runner.gpu_count else 0) and self._stop_tasks:
            # A job being stopped still holds its GPUs: give it its time to leave first.
            await asyncio.wait(set(self._stop_tasks), timeout=STOP_TIMEOUT + 5)
        try:
            await self.runner.start(a, inputs)
        except OSError as e:
            self._fail(a.job_id, f"could not start training: {e}")

    def _cache_keep(self) -> set[str]:
        """Blobs that running and starting jobs use: never evicted to make room for another."""
        assignments = [job.assignment for job in self.runner.running.values()] + list(self._preparing_for.values())
        return {ref.sha256 for a in assignments for ref in a.spec.blob_refs()} | {
            a.checkpoint.sha256 for a in assignments if a.checkpoint is not None}

    async def _fetch_inputs(self, job_id: str, spec: JobSpec, checkpoint_ref: CheckpointRef | None = None
                            ) -> JobInputs:
        """The job's code, dataset and checkpoint (`checkpoint_ref`), fetched into the cache and verified."""
        async def fetch(sha256: str, size: int, what: str) -> Path:
            return await self.cache.get(sha256, size, lambda dest: self.client.fetch_blob(job_id, sha256, dest),
                                        keep=self._cache_keep(), what=what)

        code = dataset = checkpoint = None
        if spec.local_dataset is not None:  # federated: this node's own data, never fetched nor sent anywhere
            dataset = self.config.datasets.get(spec.local_dataset)
            if dataset is None or not dataset.exists():
                raise FileNotFoundError(f"this node holds no dataset named {spec.local_dataset!r}")
        if checkpoint_ref is not None:  # first: the coordinator prunes old checkpoints while datasets download
            try:
                checkpoint = await fetch(checkpoint_ref.sha256, checkpoint_ref.size,
                                         f"checkpoint {checkpoint_ref.name}")
            except Rejected as e:  # pruned meanwhile: a newer one exists, so live peers hold the state
                logger.warning("checkpoint %s of %s is gone (%s); starting without it", checkpoint_ref.name,
                               job_id, e)
        if spec.code is not None:
            code = await fetch(spec.code.sha256, spec.code.size, "code")
            if spec.code.format == "tar":
                code = await self.cache.unpacked(spec.code.sha256, code, keep=self._cache_keep())
        if spec.dataset is not None:
            dataset = await fetch(spec.dataset.sha256, spec.dataset.size, "dataset")
            dataset = await self.cache.unpacked(spec.dataset.sha256, dataset, keep=self._cache_keep()) \
                if spec.dataset.format == "tar" else self.cache.named(spec.dataset.sha256, spec.dataset.name)
        return JobInputs(code=code, dataset=dataset, checkpoint=checkpoint)

    def _on_event(self, job: RunningJob, event: dict) -> None:
        self.metrics.observe(event)
        kind = event.get("event")
        if kind == "round":
            self.outbox.add(RoundReport(job_id=job.assignment.job_id, node_id=self.identity.node_id,
                                        epoch=event["epoch"], solo=event.get("solo", False), claims=event["claims"],
                                        suspects=event.get("suspects", [])))
        elif kind == "finished":
            logger.info("job %s reached its stop rule (%s); uploading the model", job.assignment.job_id,
                        event.get("reason", "done"))
            self._uploads.append(PendingUpload(job.assignment.job_id, Path(event["path"]), event.get("accuracy"),
                                               event.get("epoch"), event.get("metrics")))
        elif kind == "resumed":
            logger.info("job %s resumed from %s at step %s", job.assignment.job_id, event.get("checkpoint"),
                        event.get("step"))
        elif kind == "checkpoint":
            # Only the newest checkpoint of a job is worth uploading; an older one still waiting is dropped.
            job_id = job.assignment.job_id
            for old in [u for u in self._uploads if u.job_id == job_id and u.checkpoint_step is not None]:
                self._uploads.remove(old)
                old.path.unlink(missing_ok=True)
            self._uploads.append(PendingUpload(job.assignment.job_id, Path(event["path"]),
                                               checkpoint_step=int(event["step"])))
        elif kind == "progress" and job.progress is not None:
            p = job.progress
            logger.info("job %s epoch %.2f step %d accuracy %s peers %d", p.job_id, p.epoch, p.global_step,
                        "-" if p.accuracy is None else f"{p.accuracy:.4f}", p.peers)

    # ------------------------------------------------------------------------------------------------ metrics

    def metrics_snapshot(self) -> NodeSnapshot:
        """What a scrape shows, read from the daemon's state as it is now (on the event loop: no races)."""
        return NodeSnapshot(
            node_id=self.identity.node_id, state=self.state, coordinator_reachable=self.reachable,
            outbox_reports=self.outbox.depth(),
            pending_uploads=len(self._uploads), training_jobs=len(self.runner.running),
            progress=tuple(j.progress for j in self.runner.running.values() if j.progress is not None),
            mesh_peers=self._mesh_peer_stats(),
        )

    def _mesh_peer_stats(self) -> tuple[MeshPeerStats, ...] | None:
        if self.mesh is None:
            return None
        rtts = self.mesh.peer_rtts()
        return tuple(MeshPeerStats(peer=node_id, received_bytes=status.rx_bytes, sent_bytes=status.tx_bytes,
                                   latest_handshake=status.latest_handshake, rtt_ms=rtts.get(node_id))
                     for node_id, status in sorted(self.mesh.device_peers().items()))

    async def _flush_uploads(self) -> None:
        for upload in list(self._uploads):
            what = "the final model" if upload.checkpoint_step is None else f"checkpoint {upload.path.name}"
            try:
                if upload.checkpoint_step is None:
                    await self.client.upload(upload.job_id, upload.path, final=True, accuracy=upload.accuracy,
                                             epoch=upload.epoch, metrics=upload.metrics)
                else:
                    await self.client.upload(upload.job_id, upload.path, final=False, name=upload.path.name,
                                             checkpoint_step=upload.checkpoint_step)
                    upload.path.unlink(missing_ok=True)
                logger.info("uploaded %s of %s", what, upload.job_id)
            except CoordinatorUnavailable:
                return  # keep it for the next round
            except Rejected as e:
                level = logging.INFO if e.code == "job_final" else logging.ERROR
                logger.log(level, "%s of %s not taken: %s", what, upload.job_id, e.message)
            except OSError as e:
                logger.error("%s of %s cannot be read: %s", what, upload.job_id, e)
            if upload in self._uploads:  # a newer checkpoint may have replaced it during the upload
                self._uploads.remove(upload)

    async def _flush_outbox(self) -> None:
        for report in self.outbox.pending():
            try:
                result = await self.client.report_round(report)
            except CoordinatorUnavailable:
                return
            except Rejected as e:
                if e.status in (401, 429):
                    return  # transient from our side (clock skew, rate limit): keep it
                logger.error("round report %s epoch %d refused, dropping it: %s", report.job_id, report.epoch, e)
                self.outbox.ack(report, delivered=False)
                continue
            for item in result.ignored:
                logger.warning("the coordinator ignored a claim of node %s in %s epoch %d: %s",
                               item.node_id, report.job_id, report.epoch, item.reason)
            self.outbox.ack(report)
            self._claimed[report.job_id] = max(self._claimed.get(report.job_id, 0), report.epoch)

    # ------------------------------------------------------------------------------------------------ shutdown

    async def shutdown(self) -> None:
        """Bounded, within about 3 s: the training process leaves (killed with everything it started after
        WORKER_STOP_GRACE) while the coordinator hears that we are stopping, the DHT gets the OFFLINE advert and
        stops, and the challenge solver and audits stop; then the outbox is flushed, the coordinator told we are
        offline, and the mesh taken down."""
        self.transition(stop_requested=True)
        if self.mesh is not None:
            await self.mesh.stop_keeping()
        for task in self._preparing.values():
            task.cancel()
        self._stopping.update(self.runner.running)
        meanwhile = asyncio.gather(self._tell_coordinator(NodeState.STOPPING), self._leave_dht(),
                                   self.challenger.stop(), self.audits.stop())
        await self.runner.stop_all(timeout=min(WORKER_STOP_GRACE, self.config.shutdown_timeout / 2))
        self._collect_exits()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._flush_outbox(), timeout=0.5)
        self.transition(stop_requested=True)
        await self._tell_coordinator(NodeState.OFFLINE)
        await meanwhile
        if self.mesh is not None:
            self._stop_mesh.set()
            if self._mesh_task is not None:
                self._mesh_task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await self._mesh_task
            with contextlib.suppress(Exception):
                await self.mesh.close()
        logger.info("node %s stopped", self.identity.node_id)

    async def _leave_dht(self) -> None:
        await self.advertiser.goodbye(timeout=1.0)
        await self.advertiser.shutdown()

    async def _tell_coordinator(self, state: NodeState, timeout: float = 0.5) -> None:
        """A last heartbeat, best effort. OFFLINE hands this node's assignments back at once."""
        if self.registered:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.client.heartbeat(Heartbeat(node_id=self.identity.node_id, state=state)),
                                       timeout=timeout)
