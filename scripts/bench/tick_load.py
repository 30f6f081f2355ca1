"""The coordinator's tick on a large market, for scripts/bench/market.py: the matcher with everything around it.

`market.py matcher` times the pure `match` call. A coordinator's tick also loads every online node and open job
from the database, builds their views (each node's resources validated, its reputation record counted), reserves
each started job's budget and writes the assignments, all in one transaction. This fills a fresh database (SQLite
in a temporary dir, or the PostgreSQL URL given) with `market.synthetic_market(nodes, jobs)`, every node online and
the owner funded, and runs `app.tick` twice: the first tick starts every job it can (a cold start), the second sees
the same market a tick later (the steady state: few matches). It reports each tick's wall and CPU time, the matches,
and the longest the event loop went without running anything else (a probe task that sleeps 10 ms at a time): on
SQLite the tick also holds the coordinator's one database connection, so heartbeats wait for all of it.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path

from gpuswarm.coordinator import app
from gpuswarm.coordinator.auth import create_owner
from gpuswarm.coordinator.config import CoordinatorConfig
from gpuswarm.coordinator.db import AssignmentRow, Job, Node, make_engine, sessionmaker
from gpuswarm.coordinator.migrate import upgrade
from sqlalchemy import func, insert, select

ROWS_PER_INSERT = 5_000


async def _fill(url: str, n_nodes: int, n_jobs: int, now: float) -> None:
    from market import synthetic_market  # scripts/bench, on the path when market.py runs this

    jobs, nodes = synthetic_market(n_nodes, n_jobs)
    engine = make_engine(url)
    await upgrade(engine)
    async with sessionmaker(engine).begin() as session:
        owner, _ = await create_owner(session, "bench", 1e9, now)
    node_rows = [{"id": n.id, "public_key": f"{k:044d}", "resources": n.resources.model_dump(mode="json"),
                  "software_version": "bench", "price_per_gpu_hour": n.price_per_gpu_hour, "endpoints": [],
                  "state": "idle", "registered_at": now - 3600, "last_seen": now, "online_seconds": 3000.0,
                  "peer_rtt_ms": dict(n.rtt_ms), "verified": n.verified, "challenges_passed": int(n.verified),
                  "measured_gflops": n.throughput} for k, n in enumerate(nodes)]
    job_rows, assignment_rows = [], []
    for j in jobs:
        job_rows.append({"id": j.id[-16:], "spec": j.spec.model_dump(mode="json"), "state": j.state.value,
                         "created_at": j.created_at, "owner_id": owner.id})
        # A job that lost a member (one shard fewer than members) keeps the others: the rest is left out.
        members = zip(sorted(j.active_shards), sorted(j.members), strict=False)
        assignment_rows += [{"job_id": j.id[-16:], "node_id": m, "state": "active", "shard_index": s,
                             "num_shards": j.spec.max_nodes, "created_at": now, "gpus": j.spec.gpus_per_node,
                             "price_per_gpu_hour": 1.0} for s, m in members]
    async with engine.begin() as connection:
        for table, rows in ((Node, node_rows), (Job, job_rows), (AssignmentRow, assignment_rows)):
            for start in range(0, len(rows), ROWS_PER_INSERT):
                await connection.execute(insert(table.__table__), rows[start:start + ROWS_PER_INSERT])
    await engine.dispose()


async def _ticks(url: str, data_dir: Path, now: float, count: int) -> list[dict]:
    engine = make_engine(url)
    sessions = sessionmaker(engine)
    config = CoordinatorConfig(data_dir=data_dir, database_url=url, node_timeout=3600.0)
    stalls: list[float] = []

    async def probe() -> None:
        while True:
            started = time.perf_counter()
            await asyncio.sleep(0.01)
            stalls.append(time.perf_counter() - started - 0.01)

    results = []
    prober = asyncio.create_task(probe())
    try:
        for _ in range(count):
            await asyncio.sleep(0.05)
            stalls.clear()
            before = await _assignments(sessions)
            wall, cpu = time.perf_counter(), time.process_time()
            await app.tick(sessions, config, now)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            results.append({"seconds": wall, "cpu_seconds": cpu, "matches": await _assignments(sessions) - before,
                            "longest_stall": max(stalls, default=0.0)})
    finally:
        prober.cancel()
        await engine.dispose()
    return results


async def _assignments(sessions) -> int:
    async with sessions() as session:
        return await session.scalar(select(func.count()).select_from(AssignmentRow))


def run(database_url: str | None, nodes: int, jobs: int, ticks: int = 2) -> list[dict]:
    """Fill a database with the synthetic market and run `ticks` ticks on it; one result per tick."""
    now = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        url = database_url or f"sqlite+aiosqlite:///{Path(tmp) / 'coordinator.db'}"
        asyncio.run(_fill(url, nodes, jobs, now))
        return asyncio.run(_ticks(url, Path(tmp), now, ticks))

