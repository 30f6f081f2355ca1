"""The HTTP handlers of the /v1 API, one module per resource, and `setup_routes`, which adds them to an app.

Owns the routes only: `general` (health, OpenAPI, DHT peers), `nodes` (registration, heartbeats, mesh, assignments,
revocation), `jobs`, `sweeps`, `artifacts`, `blobs` (the content-addressed store), `ledger` (round reports,
statements), `audits` (refereed re-execution) and `owners`; every response's JSON shape is built in `shapes`.
Reading requests is `coordinator.requests`'s, authenticating callers `coordinator.auth`'s, job state changes
`coordinator.jobs`'s, the round ingest `coordinator.ledger`'s, audits `coordinator.audits`'. Every write happens
in one `sessions.begin()` block, so a request refused half-way leaves the database as it was. Errors are raised
as `ApiError`s and rendered by `errors.error_middleware`. The GPU challenge routes are `coordinator.challenge`'s.
"""

from __future__ import annotations

from aiohttp import web
from gpuswarm.coordinator.views import artifacts, audits, blobs, general, jobs, ledger, nodes, owners, sweeps


def setup_routes(app: web.Application) -> None:
    for module in (general, nodes, ledger, audits, jobs, sweeps, artifacts, blobs, owners):
        app.add_routes(module.routes)
