"""The coordinator's Prometheus metrics: `GET /metrics` and the middleware that times every API request.

Owns `CoordinatorMetrics`, one per application with its own `CollectorRegistry` (never the process-wide default
registry: tests and tools run several apps in one process). Counters and histograms are updated where things
happen (requests here; matching and supervisor failures in `app`; heartbeat batches in `heartbeats`); the gauges of
jobs, nodes and assignments are counted from the database at scrape time, so they are never stale.
Labels are bounded: route is the route template (never the raw path), method one of a fixed set, status an HTTP
status code, states the proto enums. This module only reads the database.
"""

from __future__ import annotations

import asyncio
import time

from aiohttp import web
from gpuswarm.coordinator.config import METRICS, SESSIONS
from gpuswarm.coordinator.db import AssignmentRow, Job, Node
from gpuswarm.proto.models import AssignmentState, JobState
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from sqlalchemy import func, select

from gpuswarm import __version__

METRICS_PATH = "/metrics"
disable_created_metrics()  # no `_created` series beside every counter and histogram: scrapers do not need them
UNMATCHED = "unmatched"  # the route label of requests no route matched (404, 405): raw paths would be unbounded
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})  # anything else is "other"
# Up to 30 s: the mesh peer-list long-poll holds requests open for up to 20 s.
REQUEST_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
MATCHING_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 512)  # heartbeats.MAX_BATCH is the largest batch


class CoordinatorMetrics:
    """Every metric of one coordinator application, registered in its own registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        Gauge("gpuswarm_coordinator_info", "The coordinator's version (always 1).", ["version"],
              registry=r).labels(__version__).set(1)
        self.requests = Histogram(
            "gpuswarm_coordinator_http_request_duration_seconds",
            "API request latency until the handler's response, by route template, method and final status.",
            ["method", "route", "status"], buckets=REQUEST_BUCKETS, registry=r)
        self.matching = Histogram(
            "gpuswarm_coordinator_matching_duration_seconds", "Duration of one matching pass of the supervisor.",
            buckets=MATCHING_BUCKETS, registry=r)
        self.assignments_made = Counter(
            "gpuswarm_coordinator_assignments_made", "Assignments the matcher handed out (committed).", registry=r)
        self.supervisor_failures = Counter(
            "gpuswarm_coordinator_supervisor_tick_failures", "Supervisor passes that raised (and were retried).",
            registry=r)
        self.heartbeats = Counter(
            "gpuswarm_coordinator_heartbeats",
            "Heartbeats through the batcher: applied, rejected (unknown node, wrong key, revoked, replay) or "
            "failed (the batch's transaction failed).", ["result"], registry=r)
        self.heartbeat_batch_size = Histogram(
            "gpuswarm_coordinator_heartbeat_batch_size", "Heartbeats applied in one transaction (group commit).",
            buckets=BATCH_BUCKETS, registry=r)
        self.jobs = Gauge("gpuswarm_coordinator_jobs", "Jobs by state.", ["state"], registry=r)
        self.nodes = Gauge("gpuswarm_coordinator_nodes", "Registered nodes.", registry=r)
        self.nodes_online = Gauge("gpuswarm_coordinator_nodes_online", "Nodes currently online.", registry=r)
        self.nodes_revoked = Gauge("gpuswarm_coordinator_nodes_revoked", "Revoked nodes.", registry=r)
        self.nodes_verified = Gauge("gpuswarm_coordinator_nodes_verified",
                                    "Nodes that passed their latest GPU challenge.", registry=r)
        self.assignments_active = Gauge("gpuswarm_coordinator_assignments_active", "Active assignments.",
                                        registry=r)
        for result in ("applied", "rejected", "failed"):
            self.heartbeats.labels(result)  # present at 0 from the start, so rate() sees the first one
        for state in JobState:
            self.jobs.labels(state.value)

    def matched(self, seconds: float, assignments: int) -> None:
        self.matching.observe(seconds)
        self.assignments_made.inc(assignments)

    def heartbeat_batch(self, size: int, rejected: int, failed: bool = False) -> None:
        """One batch of `size` heartbeats: `rejected` of them refused alone, or all failed with the transaction."""
        self.heartbeat_batch_size.observe(size)
        if failed:
            self.heartbeats.labels("failed").inc(size)
            return
        self.heartbeats.labels("applied").inc(size - rejected)
        self.heartbeats.labels("rejected").inc(rejected)

    async def refresh(self, request: web.Request) -> None:
        """Set the gauges from the database: three small aggregate queries."""
        async with request.app[SESSIONS]() as session:
            by_state = dict((await session.execute(select(Job.state, func.count()).group_by(Job.state))).all())
            nodes = (await session.execute(select(
                func.count(), func.count().filter(Node.online.is_(True)), func.count().filter(Node.revoked.is_(True)),
                func.count().filter(Node.verified.is_(True))))).one()
            active = await session.scalar(select(func.count()).select_from(AssignmentRow).where(
                AssignmentRow.state == AssignmentState.ACTIVE.value))
        for state in JobState:
            self.jobs.labels(state.value).set(by_state.get(state.value, 0))
        for gauge, value in zip((self.nodes, self.nodes_online, self.nodes_revoked, self.nodes_verified), nodes,
                                strict=True):
            gauge.set(value)
        self.assignments_active.set(active or 0)


def route_label(request: web.Request) -> str:
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else UNMATCHED


@web.middleware
async def metrics_middleware(request: web.Request, handler):
    """Time every request but /metrics itself. It sits outside `error_middleware`, so the status it records is
    the one the client gets, errors included. A request whose client went away (cancelled) is not counted."""
    started = time.perf_counter()
    status = 500  # an exception error_middleware did not turn into a response
    try:
        response = await handler(request)
        status = response.status
        return response
    except web.HTTPException as e:  # redirects, which error_middleware lets through
        status = e.status
        raise
    except asyncio.CancelledError:
        status = 0
        raise
    finally:
        route = route_label(request)
        if status and route != METRICS_PATH:
            method = request.method if request.method in METHODS else "other"
            request.app[METRICS].requests.labels(method, route, str(status)).observe(time.perf_counter() - started)


async def serve_metrics(request: web.Request) -> web.Response:
    """Prometheus text exposition of this coordinator's metrics (no authentication; counts only)."""
    metrics = request.app[METRICS]
    await metrics.refresh(request)
    # CONTENT_TYPE_LATEST carries the charset, which web.Response refuses inside content_type.
    return web.Response(body=generate_latest(metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


def setup_metrics(app: web.Application) -> None:
    """Give the app its metrics and the /metrics route (add `metrics_middleware` first in its middlewares)."""
    app[METRICS] = CoordinatorMetrics()
    app.router.add_get(METRICS_PATH, serve_metrics)
