"""Marketplace benchmark: the matcher's time on a synthetic market, measured alone (it is a pure function).

Sections (run the ones named on the command line; by default all):
- matcher: one matching pass over 100,000 nodes x 10,000 jobs (goal: under 1 s), 10,000 x 1,000 and 1,000 x 100;
  the median of several runs each. The first matcher (commit PREVIOUS) runs on the two smaller markets in the same
  run and is reported as a ratio (on the largest it would take minutes).
- tick: the coordinator's whole tick (scripts/bench/tick_load.py) on the largest market in a database, SQLite and
  PostgreSQL: loading the nodes and jobs, their views, the matcher, the reservations and the writes; a cold start
  (every job starts) and the next tick (the steady state), with the longest the event loop was held.
- heartbeats: signed heartbeats against a real coordinator process on SQLite (signatures checked in the event loop and
  in a child process, side by side), and on PostgreSQL with one and with two coordinators on the database (goal:
  >= 2,000/s, p99 under 50 ms).

Each section draws its table as a PNG (docs/img/market-matcher.png, market-heartbeats.png) beside it.

The market is random but seeded: GPU models with typical asks, 1-8 GPUs a node, partly used nodes, a few stale
ones, sparse RTT maps; pending and running jobs with mixed requirements, bids, node counts and GPUs per node.

Run: scripts/bench/run market [SECTION ...] [--runs 5] [--no-write]. Prints each table and appends it to
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import random
import statistics
import subprocess
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path

from gpuswarm.coordinator.matcher import JobView, NodeView, match
from gpuswarm.proto.models import GPUInfo, JobSpec, JobState, Resources

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]  # bench/, scripts/
import charts  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
NOW = 1_000_000.0
LIVENESS = 30.0

# (model, memory GB, typical ask per GPU-hour, typical GFLOP/s, share of GPU nodes)
GPU_KINDS = [
    ("T4", 16.0, 0.35, 8_000.0, 0.20),
    ("RTX3090", 24.0, 0.45, 35_000.0, 0.20),
    ("RTX4090", 24.0, 0.70, 80_000.0, 0.25),
    ("A100", 40.0, 1.30, 150_000.0, 0.15),
    ("A100", 80.0, 1.90, 150_000.0, 0.10),
    ("H100", 80.0, 2.90, 400_000.0, 0.10),
]
REQUIREMENTS = [  # (weight, requirements)
    (40, {}),
    (20, {"min_gpu_memory_gb": 24.0}),
    (15, {"min_gpu_memory_gb": 40.0}),
    (10, {"gpu_models": ["A100"]}),
    (10, {"gpu_models": ["H100", "A100"], "min_gpu_memory_gb": 80.0}),
    (5, {"allow_cpu": True}),
]


def synthetic_market(n_nodes: int, n_jobs: int, seed: int = 1) -> tuple[list[JobView], list[NodeView]]:
    rng = random.Random(seed)
    ids = [f"{rng.getrandbits(64):016x}" for _ in range(n_nodes)]
    nodes = []
    for nid in ids:
        if rng.random() < 0.15:
            resources, ask, throughput = Resources(cpu_cores=16, ram_gb=64), rng.uniform(0.01, 0.1), 500.0
        else:
            model, memory, typical, flops, _ = rng.choices(GPU_KINDS, weights=[k[4] for k in GPU_KINDS])[0]
            count = rng.choices([1, 2, 4, 8], weights=[50, 20, 20, 10])[0]
            resources = Resources(cpu_cores=32, ram_gb=128, gpus=[GPUInfo(model=model, memory_gb=memory, count=count)])
            ask, throughput = typical * rng.lognormvariate(0, 0.25), flops * rng.uniform(0.7, 1.1)
        verified = rng.random() < 0.75
        cap = resources.gpu_count or 1
        nodes.append(NodeView(
            id=nid, resources=resources, price_per_gpu_hour=round(ask, 2),
            last_seen=NOW - (rng.uniform(0, 10) if rng.random() < 0.97 else 120.0),
            gpus_in_use=rng.randint(0, cap) if rng.random() < 0.4 else 0, verified=verified,
            reputation=rng.betavariate(5, 2), throughput=throughput if verified else None,
            rtt_ms={rng.choice(ids): rng.uniform(1.0, 250.0) for _ in range(16)}))
    jobs = []
    for k in range(n_jobs):
        max_nodes = rng.choices([1, 2, 4, 8, 16, 32], weights=[20, 20, 25, 20, 10, 5])[0]
        running = rng.random() < 0.5
        members = frozenset(rng.sample(ids, rng.randint(1, max_nodes))) if running else frozenset()
        lost = 1 if members and rng.random() < 0.3 else 0  # a running job that lost a member has a free shard
        requirements = dict(rng.choices([r for _, r in REQUIREMENTS], weights=[w for w, _ in REQUIREMENTS])[0])
        requirements.setdefault("allow_cpu", rng.random() < 0.3)
        requirements["verified_only"] = rng.random() < 0.3
        typical = rng.choice(GPU_KINDS)[2]
        spec = JobSpec.model_validate({
            "workload": "digits-mlp", "max_nodes": max_nodes, "min_nodes": rng.randint(1, max_nodes),
            "gpus_per_node": rng.choices([1, 2, 4], weights=[70, 20, 10])[0],
            "max_price_per_gpu_hour": None if rng.random() < 0.15 else round(typical * rng.uniform(0.8, 1.6), 2),
            "requirements": requirements})
        jobs.append(JobView(
            id=f"j-{k:012x}", spec=spec, state=JobState.RUNNING if running else JobState.PENDING,
            created_at=NOW - rng.uniform(0, 3600), members=members,
            active_shards=frozenset(range(lost, len(members))), funded=rng.random() < 0.95))
    return jobs, nodes


PREVIOUS = "841853a"  # the last commit with the first matcher (FIFO, one job per node, cheapest first)


def old_matcher() -> types.ModuleType | None:
    """The first matcher, from commit PREVIOUS (None when git or the commit is not there)."""
    try:
        source = subprocess.run(["git", "show", f"{PREVIOUS}:coordinator/matcher.py"], cwd=ROOT, check=True,
                                capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    module = types.ModuleType("gpuswarm_head_matcher")
    sys.modules[module.__name__] = module  # dataclasses look their module up while building the classes
    exec(compile(source, f"{PREVIOUS}:coordinator/matcher.py", "exec"), module.__dict__)
    fields = getattr(module.NodeView, "__dataclass_fields__", {})
    return module if "busy" in fields and "gpus_in_use" not in fields else None


def as_old(module: types.ModuleType, jobs: list[JobView], nodes: list[NodeView]) -> tuple[list, list]:
    """The same market in the old views: a node with anything in use is busy (the old one-job-per-node rule)."""
    return ([module.JobView(j.id, j.spec, j.state, j.created_at, j.active_shards) for j in jobs],
            [module.NodeView(n.id, n.resources, n.price_per_gpu_hour, n.last_seen, n.gpus_in_use > 0) for n in nodes])


def timed(fn: Callable[[], list], runs: int) -> tuple[list[float], list[float], list]:
    """Wall-clock and CPU seconds of each run, and the last result. CPU time shows the cost on a shared machine."""
    walls, cpus, result = [], [], []
    for _ in range(runs):
        wall, cpu = time.perf_counter(), time.process_time()
        result = fn()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return walls, cpus, result


def ms(seconds: float) -> str:
    return f"{seconds * 1000:,.0f} ms"


def section_matcher(args: argparse.Namespace) -> tuple[str, str]:
    old = old_matcher()
    rows, labels, walls_ms, old_ms = [], [], [], []
    for n_nodes, n_jobs in [(100_000, 10_000), (10_000, 1_000), (1_000, 100)]:
        jobs, nodes = synthetic_market(n_nodes, n_jobs)
        walls, cpus, matches = timed(lambda j=jobs, n=nodes: match(j, n, NOW, liveness=LIVENESS), args.runs)
        new = statistics.median(walls)
        served = len({m.job_id for m in matches})
        row = [f"{n_nodes:,} x {n_jobs:,}", str(args.runs), ms(new), f"{ms(min(walls))} - {ms(max(walls))}",
               ms(statistics.median(cpus)), f"{len(matches):,}", f"{served:,}"]
        labels.append(row[0])
        walls_ms.append(new * 1000)
        if old is not None and n_nodes <= 10_000:
            old_jobs, old_nodes = as_old(old, jobs, nodes)
            old_runs = max(1, args.runs // 2)
            old_walls, old_cpus, _ = timed(lambda j=old_jobs, n=old_nodes: old.match(j, n, NOW, liveness=LIVENESS),
                                           old_runs)
            old_wall, old_cpu = statistics.median(old_walls), statistics.median(old_cpus)
            row += [f"{ms(old_wall)} ({old_runs} runs)", ms(old_cpu),
                    f"{old_wall / new:.1f} (CPU {old_cpu / statistics.median(cpus):.1f})"]
            old_ms.append(old_wall * 1000)
        else:
            row += ["not run" if old is not None else "n/a (no git history)", "n/a", "n/a"]
            old_ms.append(float("nan"))
        rows.append(row)
        print(f"  {row[0]}: {row[2]} wall, {row[4]} CPU", file=sys.stderr)
    header = ["nodes x jobs", "runs", "wall (median)", "wall (range)", "CPU (median)", "matches", "jobs served",
              "first matcher wall", "first matcher CPU", "first / new"]
    table = "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
                       *("| " + " | ".join(r) + " |" for r in rows)])
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    note = ("One pass of `coordinator.matcher.match` on a seeded synthetic market (scripts/bench/market.py), pure "
            "Python; goal: under 1 s for 100,000 x 10,000. CPU is the process's CPU time, which other load on the "
            f"machine disturbs less than wall time (load average at the end: {load}). The first matcher "
            f"(commit {PREVIOUS}) ran on the same markets in the same run through its old views (a node with any "
            "GPU in use counts as busy; no ranking, RTT or multi-job nodes); the ratio compares the cost of one "
            "pass, not equal outputs; it is not run on the largest market.")
    chart = charts.bars("market-matcher", "matcher: one pass (ms, log scale)", labels,
                        {"matcher": walls_ms, "first matcher": old_ms}, "ms", reference=(1000.0, "goal: 1 s"),
                        log=True) if args.write else ""
    return "matcher", f"{note}\n\n{table}\n\n{chart}"


def section_heartbeats(args: argparse.Namespace) -> tuple[str, str]:
    """Signed heartbeats against a real coordinator process, on SQLite and on a throwaway PostgreSQL cluster."""
    import heartbeat_load
    import pglab

    rows, rates = [], []
    # (database, URL, coordinators, node signatures checked in a child process)
    cases: list[tuple[str, str | None, int, bool]] = [("SQLite (WAL, one connection)", None, 1, False),
                                                      ("SQLite (WAL, one connection)", None, 1, True)]
    with contextlib.ExitStack() as stack:
        try:
            server = stack.enter_context(pglab.server())
            url = asyncio.run(server.create_database("bench_heartbeats"))
            url = url.render_as_string(hide_password=False) if hasattr(url, "render_as_string") else str(url)
            cases += [("PostgreSQL 15 (asyncpg)", url, 1, True), ("PostgreSQL 15 (asyncpg)", url, 2, True)]
        except pglab.PostgresUnavailable as e:
            print(f"  PostgreSQL skipped: {e}", file=sys.stderr)
        for name, url, coordinators, apart in cases:
            result = heartbeat_load.run(url, seconds=args.seconds, concurrency=args.concurrency,
                                        coordinators=coordinators, signature_process=apart)
            rows.append([name, str(coordinators), "child process" if apart else "event loop",
                         f"{result['requests']:,}", str(result["errors"]), f"{result['per_second']:,.0f}",
                         f"{result['p50_ms']:.1f} ms", f"{result['p99_ms']:.1f} ms",
                         f"{result['server_cpu_us']:,.0f}", f"{result['server_cores']:.2f}",
                         f"{result['db_cpu_us']:,.0f}" if url else "-"])
            rates.append(result["per_second"])
            print(f"  {name} x{coordinators} ({rows[-1][2]}): {rows[-1][5]}/s, p99 {rows[-1][7]}", file=sys.stderr)
    header = ["database", "coordinators", "signatures checked in", "heartbeats", "errors", "per second", "p50", "p99",
              "coordinator CPU µs / heartbeat", "coordinator cores", "database server CPU µs / heartbeat"]
    table = "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
                       *("| " + " | ".join(r) + " |" for r in rows)])
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    note = (f"`gpuswarm coordinator serve` in its own process, 200 registered nodes, {args.concurrency} heartbeats "
            f"in flight for {args.seconds:.0f} s from one client process on the same machine (pre-signed, each with "
            "its own nonce): every heartbeat is checked (envelope, Ed25519, freshness) and answered on its own; "
            "the writes of the heartbeats that queued up meanwhile share one transaction (group commit, "
            "coordinator/heartbeats.py). On SQLite side by side: the Ed25519 check in the event loop, and in a "
            "child process (coordinator/sigcheck.py), as `coordinator serve` does by default; the coordinator's "
            "CPU and cores count its child processes. On PostgreSQL also two coordinators on the one database, the "
            "load spread over both (the scale-out docs/operations.md describes; SQLite takes one coordinator), all "
            "on the same two cores as the database server and the client. Goal: >= 2,000/s and p99 < 50 ms on "
            "SQLite, more on "
            f"PostgreSQL. Load average at the end: {load}.")
    chart = "" if not args.write else charts.bars(
        "market-heartbeats", "heartbeats per second",
        [f"{r[0].split(' (')[0]}, {r[1]} coordinator{'s' if r[1] != '1' else ''}, {r[2]}" for r in rows],
        {"heartbeats/s": rates}, "per second",
        reference=(2000.0, "goal: 2,000/s"))
    return "heartbeats", f"{note}\n\n{table}\n\n{chart}"


def section_tick(args: argparse.Namespace) -> tuple[str, str]:
    """`app.tick` on the largest market, in a database, twice: cold (every job starts) and steady (a tick later)."""
    import pglab
    import tick_load

    n_nodes, n_jobs = 100_000, 10_000
    cases: list[tuple[str, str | None]] = [("SQLite", None)]
    rows = []
    with contextlib.ExitStack() as stack:
        try:
            server = stack.enter_context(pglab.server())
            url = asyncio.run(server.create_database("bench_tick"))
            cases.append(("PostgreSQL 15", url.render_as_string(hide_password=False)
                          if hasattr(url, "render_as_string") else str(url)))
        except pglab.PostgresUnavailable as e:
            print(f"  PostgreSQL skipped: {e}", file=sys.stderr)
        for name, url in cases:
            print(f"  {name}: filling {n_nodes:,} nodes x {n_jobs:,} jobs, then two ticks", file=sys.stderr)
            for label, r in zip(("cold start", "next tick"), tick_load.run(url, n_nodes, n_jobs), strict=True):
                rows.append([name, label, f"{r['seconds']:.1f} s", f"{r['cpu_seconds']:.1f} s", f"{r['matches']:,}",
                             f"{r['longest_stall']:.2f} s"])
                print(f"    {label}: {rows[-1][2]} wall, {rows[-1][5]} longest loop stall", file=sys.stderr)
    header = ["database", "tick", "wall", "CPU", "matches", "longest event-loop stall"]
    table = "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
                       *("| " + " | ".join(r) + " |" for r in rows)])
    note = (f"`app.tick` in one process on a database filled with the matcher's synthetic market ({n_nodes:,} nodes "
            f"x {n_jobs:,} jobs, every node online, the owner funded; scripts/bench/tick_load.py): the first tick "
            "starts every job it can, the next finds the same market a tick later. CPU is the process's (on "
            "SQLite the database runs inside it). The stall is the longest a probe task that sleeps 10 ms at a "
            "time waited beyond that: how long the coordinator answered nothing. On SQLite the tick also holds "
            "the coordinator's one database connection throughout, so heartbeats wait for the whole tick.")
    return "tick", f"{note}\n\n{table}"


SECTIONS: dict[str, Callable[[argparse.Namespace], tuple[str, str]]] = {
    "matcher": section_matcher, "tick": section_tick, "heartbeats": section_heartbeats}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sections", nargs="*", metavar="SECTION", help=f"any of {', '.join(SECTIONS)}; default: all")
    parser.add_argument("--runs", type=int, default=5, help="timed runs per case (the median is reported)")
    parser.add_argument("--seconds", type=float, default=10.0, help="heartbeat load duration per database")
    parser.add_argument("--concurrency", type=int, default=32, help="heartbeats in flight")
    parser.add_argument("--no-write", dest="write", action="store_false",
                        help="print only; do not append to docs/benchmarks.md or draw")
    args = parser.parse_args()
    if unknown := [s for s in args.sections if s not in SECTIONS]:
        parser.error(f"unknown section(s) {', '.join(unknown)}; known: {', '.join(SECTIONS)}")
    machine = f"{os.cpu_count()}-core {platform.machine()}, Python {platform.python_version()}"
    for name in args.sections or list(SECTIONS):
        title, body = SECTIONS[name](args)
        print(body)
        if not args.write:
            continue
        with open(ROOT / "docs" / "benchmarks.md", "a") as f:
            f.write(f"\n## market: {title} ({time.strftime('%Y-%m-%d')}, {machine})\n\n{body}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
