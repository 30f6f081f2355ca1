"""The node daemon's Prometheus metrics: `GET /metrics` on `--metrics-host`:`--metrics-port`.

Owns `NodeMetrics`: one private `CollectorRegistry` per daemon (never the process-wide default: tests and tools run
several daemons' metrics in one process), the counters the daemon bumps as things happen (heartbeats, averaging
rounds from the training process's events), and a collector that reads everything else at scrape time: the
daemon's `NodeSnapshot` (state, training progress, outbox, mesh peers) and NVML (GPU utilisation and memory).
Read at scrape time, gauges are never stale and a job's series leave with the job, so labels stay bounded: job
ids of running jobs, the mesh's peers, GPU indexes. Also owns `MetricsServer`, the small aiohttp server.

This module only reads: it never changes the daemon's state, and a failing GPU read never fails a scrape.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from gpuswarm.proto.models import NodeState, Progress
from prometheus_client import CollectorRegistry, Counter, ProcessCollector, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from gpuswarm import __version__

logger = logging.getLogger(__name__)
PREFIX = "gpuswarm_node_"
disable_created_metrics()  # no `_created` series beside every counter: scrapers do not need them
METRICS_PATH = "/metrics"
ROUND_RESULTS = ("ok", "failed", "solo")


class MetricsUnavailable(RuntimeError):
    """The metrics endpoint cannot be served as asked (the port is taken, the address is not this host's)."""


@dataclass(frozen=True)
class MeshPeerStats:
    peer: str  # the peer's node id
    received_bytes: int  # WireGuard's counters for this peer: every byte through the tunnel, overhead included
    sent_bytes: int
    latest_handshake: float | None  # unix time; None before the first handshake
    rtt_ms: float | None  # over its settled path; None until measured


@dataclass(frozen=True)
class NodeSnapshot:
    """What the daemon shows at one scrape."""

    node_id: str
    state: NodeState
    coordinator_reachable: bool
    outbox_reports: int  # round reports not yet acknowledged by the coordinator
    pending_uploads: int  # final models and checkpoints waiting for the coordinator
    training_jobs: int  # training processes running
    progress: tuple[Progress, ...] = ()  # the latest progress of each running job that reported one
    mesh_peers: tuple[MeshPeerStats, ...] | None = None  # None: the mesh is off


@dataclass(frozen=True)
class GpuSample:
    index: int
    utilization_ratio: float  # 0..1 over NVML's last sample period
    memory_used_bytes: int
    memory_total_bytes: int


class GpuReader:
    """Each GPU's utilisation and memory through NVML (nvidia-ml-py, the `gpu` extra), read at scrape time.

    Reads nothing, without failing, on a node that offers no GPU, without nvidia-ml-py, or without a working NVML
    (no driver); the reason is logged once. A GPU whose read fails is left out of that scrape. `nvml` replaces the
    `pynvml` module (tests)."""

    def __init__(self, enabled: bool = True, nvml: Any = None):
        self.enabled = enabled
        self._nvml = nvml
        self._open: bool | None = None  # None: not tried yet

    def _ready(self) -> bool:
        if self._open is None:
            self._open = self.enabled and self._init()
        return self._open

    def _init(self) -> bool:
        if self._nvml is None:
            try:
                import pynvml
            except ImportError:
                logger.info("nvidia-ml-py is not installed: no GPU metrics (pip install 'gpuswarm[gpu]')")
                return False
            self._nvml = pynvml
        try:
            self._nvml.nvmlInit()
        except Exception as e:  # NVMLError (no driver, no library) or anything else: metrics go on without GPUs
            logger.warning("NVML failed to start (%s): no GPU metrics", e)
            return False
        return True

    def read(self) -> list[GpuSample]:
        if not self._ready():
            return []
        nvml = self._nvml
        try:
            count = nvml.nvmlDeviceGetCount()
        except Exception as e:
            logger.debug("NVML device count failed: %s", e)
            return []
        samples = []
        for index in range(count):
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                memory = nvml.nvmlDeviceGetMemoryInfo(handle)
                utilization = nvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0
                samples.append(GpuSample(index, utilization, int(memory.used), int(memory.total)))
            except Exception as e:  # one GPU fallen off the bus must not hide the others
                logger.debug("NVML read of GPU %d failed: %s", index, e)
        return samples

    def close(self) -> None:
        if self._open:
            try:
                self._nvml.nvmlShutdown()
            except Exception as e:
                logger.debug("NVML shutdown failed: %s", e)
        self._open = False


def _gauge(name: str, doc: str, labels: list[str] | None = None) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, doc, labels=labels)


class ScrapeCollector(Collector):
    """Everything read at scrape time: the daemon's snapshot and the GPUs (`gpu_samples`, when the scrape has read
    them already, off the event loop)."""

    def __init__(self, snapshot: Callable[[], NodeSnapshot], gpus: GpuReader, version: str = __version__):
        self.snapshot, self.gpus, self.version = snapshot, gpus, version
        self.gpu_samples: list[GpuSample] | None = None

    def describe(self) -> list[Metric]:
        return []  # names are not known without reading; the private registry needs no duplicate check

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot()
        yield from self._node(s)
        yield from self._training(s.progress)
        if s.mesh_peers is not None:
            yield from self._mesh(s.mesh_peers, time.time())
        yield from self._gpus(self.gpu_samples if self.gpu_samples is not None else self.gpus.read())

    def _node(self, s: NodeSnapshot) -> Iterator[Metric]:
        info = _gauge("info", "This node's id and software version (always 1).", ["node_id", "version"])
        info.add_metric([s.node_id, self.version], 1)
        state = _gauge("state", "The daemon's state: 1 for the current one, 0 for the others.", ["state"])
        for value in NodeState:
            state.add_metric([value.value], 1 if value is s.state else 0)
        yield info
        yield state
        yield GaugeMetricFamily(PREFIX + "coordinator_reachable",
                                "0 after a heartbeat or poll that could not reach the coordinator, 1 once one does.",
                                value=1 if s.coordinator_reachable else 0)
        yield GaugeMetricFamily(PREFIX + "outbox_reports", "Round reports waiting in the outbox for the coordinator.",
                                value=s.outbox_reports)
        yield GaugeMetricFamily(PREFIX + "pending_uploads",
                                "Final models and checkpoints waiting to be uploaded to the coordinator.",
                                value=s.pending_uploads)
        yield GaugeMetricFamily(PREFIX + "training_jobs", "Training processes running on this node.",
                                value=s.training_jobs)

    @staticmethod
    def _training(progress: tuple[Progress, ...]) -> Iterator[Metric]:
        job = ["job_id"]
        families = {
            "samples_per_second": _gauge("samples_per_second", "This node's training throughput in the job "
                                         "(samples since its process started / seconds).", job),
            "epoch": _gauge("epoch", "Epochs over the job's data set so far (hivemind's global progress).", job),
            "global_step": _gauge("global_step", "hivemind optimizer steps (the run's epochs) so far.", job),
            "loss": _gauge("loss", "Test loss at the latest evaluation.", job),
            "accuracy": _gauge("accuracy", "Test accuracy (0..1) at the latest evaluation.", job),
            "peers": _gauge("job_peers", "Peers in the run as hivemind's progress tracker sees them.", job),
        }
        samples = CounterMetricFamily(PREFIX + "training_samples", "Samples this node trained in the job.",
                                      labels=job)
        for p in progress:
            for field, family in families.items():
                value = getattr(p, field)
                if value is not None:
                    family.add_metric([p.job_id], value)
            samples.add_metric([p.job_id], p.samples)
        yield from families.values()
        yield samples

    @staticmethod
    def _mesh(peers: tuple[MeshPeerStats, ...], now: float) -> Iterator[Metric]:
        peer = ["peer"]
        received = CounterMetricFamily(PREFIX + "mesh_peer_received_bytes",
                                       "Bytes received from the peer through the WireGuard tunnel.", labels=peer)
        sent = CounterMetricFamily(PREFIX + "mesh_peer_sent_bytes",
                                   "Bytes sent to the peer through the WireGuard tunnel.", labels=peer)
        handshake = _gauge("mesh_peer_handshake_age_seconds", "Seconds since the latest WireGuard handshake with the "
                           "peer (absent before the first).", peer)
        rtt = _gauge("mesh_peer_rtt_seconds", "Round-trip time to the peer over its chosen path (ICMP through the "
                     "tunnel; absent until measured).", peer)
        for p in peers:
            received.add_metric([p.peer], p.received_bytes)
            sent.add_metric([p.peer], p.sent_bytes)
            if p.latest_handshake is not None:
                handshake.add_metric([p.peer], max(0.0, now - p.latest_handshake))
            if p.rtt_ms is not None:
                rtt.add_metric([p.peer], p.rtt_ms / 1000.0)
        yield GaugeMetricFamily(PREFIX + "mesh_peers", "Peers on this node's WireGuard interface.", value=len(peers))
        yield from (received, sent, handshake, rtt)

    @staticmethod
    def _gpus(samples: list[GpuSample]) -> Iterator[Metric]:
        if not samples:
            return
        gpu = ["gpu"]
        utilization = _gauge("gpu_utilization_ratio", "GPU busy time over NVML's last sample period (0..1).", gpu)
        used = _gauge("gpu_memory_used_bytes", "GPU memory in use.", gpu)
        total = _gauge("gpu_memory_total_bytes", "GPU memory in all.", gpu)
        for g in samples:
            utilization.add_metric([str(g.index)], g.utilization_ratio)
            used.add_metric([str(g.index)], g.memory_used_bytes)
            total.add_metric([str(g.index)], g.memory_total_bytes)
        yield from (utilization, used, total)


class NodeMetrics:
    """Every metric of one node daemon, in its own registry."""

    def __init__(self, snapshot: Callable[[], NodeSnapshot], gpus: GpuReader | None = None,
                 version: str = __version__):
        self.registry = CollectorRegistry()
        r = self.registry
        self.gpus = gpus if gpus is not None else GpuReader(enabled=False)
        self.heartbeats_sent = Counter(PREFIX + "heartbeats_sent", "Heartbeats sent to the coordinator.", registry=r)
        self.heartbeats_failed = Counter(PREFIX + "heartbeats_failed",
                                         "Heartbeats that failed: coordinator unreachable or the heartbeat refused.",
                                         registry=r)
        self.rounds = Counter(
            PREFIX + "averaging_rounds",
            "Gradient averaging rounds of this node's training processes: ok (averaged with peers), failed (a round "
            "that raised; hivemind then steps with local gradients) or solo (an epoch that ended without a "
            "successful round).", ["result"], registry=r)
        for result in ROUND_RESULTS:
            self.rounds.labels(result)  # present at 0 from the start, so rate() sees the first one
        self._scrape = ScrapeCollector(snapshot, self.gpus, version)
        r.register(self._scrape)
        ProcessCollector(registry=r)

    def heartbeat(self, ok: bool) -> None:
        self.heartbeats_sent.inc()
        if not ok:
            self.heartbeats_failed.inc()

    def observe(self, event: dict) -> None:
        """Count what a training process's event says: "round" (ok, or solo) and "round_failed"."""
        kind = event.get("event")
        if kind == "round":
            self.rounds.labels("solo" if event.get("solo") else "ok").inc()
        elif kind == "round_failed":
            self.rounds.labels("failed").inc()

    def render(self, accept: str = "", gpus: list[GpuSample] | None = None) -> tuple[bytes, str]:
        """The exposition (Prometheus text, or OpenMetrics if `accept` asks for it) and its content type. `gpus`:
        readings taken beforehand; otherwise NVML is read now."""
        encoder, content_type = choose_encoder(accept)
        self._scrape.gpu_samples = gpus
        try:
            return encoder(self.registry), content_type
        finally:
            self._scrape.gpu_samples = None

    def close(self) -> None:
        self.gpus.close()


class MetricsServer:
    """`GET /metrics` over HTTP. `start()` raises MetricsUnavailable when it cannot listen as asked."""

    def __init__(self, metrics: NodeMetrics, host: str, port: int):
        self.metrics, self.host, self.port = metrics, host, port
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}{METRICS_PATH}"

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get(METRICS_PATH, self._scrape)
        # A scrape every few seconds is not news; one in flight at stop gets half a second (aiohttp's default: 60 s).
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await runner.setup()
        try:
            await web.TCPSite(runner, self.host, self.port).start()
        except OSError as e:
            await runner.cleanup()
            reason = os.strerror(e.errno) if e.errno else str(e)  # aiohttp's own message repeats the address
            raise MetricsUnavailable(f"cannot serve metrics on {self.host}:{self.port}: {reason}. Choose another "
                                     "--metrics-port or --metrics-host (--metrics-port 0: no metrics endpoint)") from e
        self._runner = runner
        logger.info("metrics at %s", self.url)

    async def _scrape(self, request: web.Request) -> web.Response:
        # NVML can block (a wedged GPU): read it in a thread, then render on the loop, where the daemon's state is.
        gpus = await asyncio.get_running_loop().run_in_executor(None, self.metrics.gpus.read)
        body, content_type = self.metrics.render(request.headers.get("Accept", ""), gpus)
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
