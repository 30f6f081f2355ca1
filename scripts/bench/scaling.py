"""Scaling benchmark: does renting more nodes reach the target sooner? Time to tinylm's stop rule with 1, 2 and 4
real nodes against a plain single-process PyTorch loop, every one of them held to the same CPU quota.

Each case is a fresh lab: the coordinator in namespace 0 and N node daemons (`gpuswarm node start`, wireguard-go,
the sandboxed trainer) in namespaces 1..N, every WireGuard packet crossing the WAN relay (scripts/wanrelay.py) with
a rate cap, delay and loss (default 100 Mbit/s, 40 ms RTT, 0.5%). Each node's whole process tree (daemon, worker,
trainer, DHT and p2pd, wireguard-go) runs in its own CPU cgroup with `--cpus` CPUs (cgroup v2 cpu.max where the
controller is available, else cgroup v1 cpu.cfs_quota_us); the plain loop runs in one with the same quota. Seconds
run from the job's submission (the nodes registered and idle) to its completion, and for the plain loop from its
process's start to the target: both include starting Python and torch and reading the data.

The plain loop (scripts/bench/plain_loop.py, a process that imports only what training needs) is the same workload
(examples/tinylm, the same data, model, batch and AdamW) stepping alone and evaluating every `--eval-every` steps,
the way one machine would train it. By default the swarm keeps the plain loop's batch of 32 per inner step and
splits it over its nodes (strong scaling: 16 each on 2 nodes, 8 on 4), so more nodes make each inner step cheaper,
not larger; `--scale weak` gives every node the whole batch instead.
`--workload digits-mlp` runs the digits demo's built-in workload instead (its own defaults; e.g. `--nodes 1,3
--target "accuracy >= 0.95"`).

`--repeat N` runs every case, the plain loop included, N times, one round of all cases after another (so that a
slower hour of the machine weighs on every case alike), and reports each case's median: a run's time to target
moves by a round or two with where the loss plateaus (tinylm stalls just above val_bpb 3.9 for tens of steps), so
one run per case compares cases only roughly.

Run: scripts/bench/run scaling [--quick] [--json] [--nodes 1,2,4] [--cpus 0.4] [--target "val_bpb <= 3.6"]
     [--mode diloco|sync ...] [--compression none|fp16|8bit ...] [--scale strong|weak] [--repeat N] [--no-write].
     Prints the table and appends it (with a PNG) to docs/benchmarks.md.
`--json` prints per case: nodes, mode, compression, batch_per_node, seconds (the median of its runs), runs (every
run's seconds, in order), steps and final_metric (of the median run: the lower middle one for an even count),
speedup (one node's median seconds / this case's, for the same mode; null without a 1-node case). A lone node
averages nothing, so its case runs once per mode, with the first `--compression`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(Path(__file__).resolve().parent), str(ROOT / "scripts")]

import charts  # noqa: E402
import meshswarm  # noqa: E402
import netlab  # noqa: E402
from gpuswarm.proto.models import TrainingOptions  # noqa: E402
from split import corpus  # noqa: E402  (tinylm's text, for nodes and plain loop alike)

TINYLM = {"context": 64, "d_model": 192, "n_layer": 3, "n_head": 6, "batch_size": 32, "learning_rate": 0.005,
          "val_windows": 32}
WG_PORT = 51820
PLAIN_LOOP = Path(__file__).with_name("plain_loop.py")


# ---- CPU quota -------------------------------------------------------------------------------------------------

class CpuQuota:
    """A CPU cgroup holding `cpus` CPUs: cgroup v2's cpu.max where the cpu controller is enabled, else cgroup v1's
    cpu.cfs_quota_us. Processes join it at spawn (`preexec`), so every child they start is held too."""

    PERIOD_US = 100_000

    def __init__(self, name: str, cpus: float):
        self.cpus = cpus
        v2 = Path("/sys/fs/cgroup")
        if "cpu" in (v2 / "cgroup.controllers").read_text().split() if (v2 / "cgroup.controllers").exists() else ():
            self.path = v2 / name
            self.path.mkdir(exist_ok=True)
            (self.path / "cpu.max").write_text(f"{int(cpus * self.PERIOD_US)} {self.PERIOD_US}")
        else:
            self.path = v2 / "cpu" / name
            self.path.mkdir(exist_ok=True)
            (self.path / "cpu.cfs_period_us").write_text(str(self.PERIOD_US))
            (self.path / "cpu.cfs_quota_us").write_text(str(int(cpus * self.PERIOD_US)))

    def preexec(self) -> None:
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def throttled_seconds(self) -> float:
        stat = dict(line.split() for line in (self.path / "cpu.stat").read_text().splitlines())
        return int(stat.get("throttled_time", 0)) / 1e9 or int(stat.get("throttled_usec", 0)) / 1e6

    def remove(self) -> None:
        for pid in (self.path / "cgroup.procs").read_text().split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), 9)
        for _ in range(50):
            with contextlib.suppress(OSError):
                self.path.rmdir()
                return
            time.sleep(0.1)


def quota_unavailable() -> str | None:
    for path in (Path("/sys/fs/cgroup/cgroup.controllers"),):
        if path.exists() and "cpu" in path.read_text().split():
            return None
    if Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").exists():
        return None
    return "no CPU controller: neither cgroup v2 cpu.max nor cgroup v1 cpu.cfs_quota_us is available"


# ---- the data and the plain loop -------------------------------------------------------------------------------

def job_source(workload: str) -> dict:
    """The job spec's fields that name the workload: tinylm's code and params, or a built-in's name."""
    if workload == "tinylm":
        return {"code": {"sha256": "0" * 64, "size": 1, "format": "tar", "entrypoint": "tinylm.workload:TinyLM"},
                "hyperparameters": TINYLM}
    return {"workload": workload}


def run_plain(data: Path, target: str, cpus: float, eval_every: int, max_seconds: float, workload: str) -> dict:
    quota = CpuQuota("gpuswarm-bench-plain", cpus)
    try:
        spec = {**job_source(workload), "stop": {"target": target}}
        code = ["--code", str(ROOT / "examples" / "tinylm")] if workload == "tinylm" else []
        out = subprocess.run([sys.executable, str(PLAIN_LOOP), "--spec", json.dumps(spec), "--data", str(data),
                              *code, "--eval-every", str(eval_every), "--max-seconds", str(max_seconds)],
                             preexec_fn=quota.preexec, capture_output=True, text=True, timeout=max_seconds + 120)
        if out.returncode != 0:
            raise RuntimeError(f"the plain loop failed: {out.stderr[-2000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        quota.remove()


# ---- the swarm -------------------------------------------------------------------------------------------------

def node_batch(nodes: int, scale: str) -> int:
    """tinylm's batch on each node: the plain loop's batch split over the nodes ("strong" scaling: every inner step
    of the swarm takes as many samples as one of the plain loop), or all of it on each ("weak")."""
    return max(1, TINYLM["batch_size"] // nodes) if scale == "strong" else TINYLM["batch_size"]


def job_file(path: Path, data: Path, nodes: int, target: str, mode: str, max_seconds: float, workload: str,
             scale: str = "strong", compression: str | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if workload == "tinylm":
        batch = node_batch(nodes, scale)
        params = "\n".join(f"{k} = {json.dumps(v)}" for k, v in {**TINYLM, "batch_size": batch}.items())
        source = f"""[code]
path = "{ROOT / 'examples' / 'tinylm'}"
entrypoint = "tinylm.workload:TinyLM"

[dataset]
path = "{data}"

[params]
{params}
target_batch_size = {batch * nodes * 8}
"""
    else:
        source = ""
    path.write_text(f"""name = "scaling-{nodes}"
min_nodes = {nodes}
max_nodes = {nodes}
budget = 50.0
{f'workload = "{workload}"' if not source else ""}

{source}
[stop]
target = "{target}"
max_seconds = {max_seconds}
max_epochs = 1000

[training]
mode = "{mode}"
{f'compression = "{compression}"' if compression else ""}
checkpoint_every_minutes = 60
""")
    return path


def run_swarm(nodes: int, data: Path, target: str, mode: str, cpus: float, wan: dict, max_seconds: float,
              root: Path, workload: str, scale: str, compression: str | None = None) -> dict:
    quotas = [CpuQuota(f"gpuswarm-bench-node{i}", cpus) for i in range(1, nodes + 1)]
    with netlab.NetLab(nodes + 1) as lab:
        relay = lab.start_relay(WG_PORT)
        swarm = meshswarm.MeshSwarm(lab, root)
        try:
            swarm.start_coordinator()
            for i in range(1, nodes + 1):
                swarm.start_node(i, 0.0, "--endpoint", relay.endpoint(i), "--allow-custom-code",
                                 preexec_fn=quotas[i - 1].preexec)
            swarm.wait_for_nodes(nodes, timeout=180)
            # Each node proves its compute once it registers (the GPU challenge): done before the clock starts.
            meshswarm.wait_for(lambda: sum(n["verified"] for n in swarm.cli(0, "nodes")) >= nodes, 120,
                               "every node's challenge to pass", interval=1.0)
            # The WAN's delay and loss go on after the mesh's first handshakes (see NetLab.start_relay); each node's
            # path keeper pings its peers as soon as it has them, which makes the handshakes.
            meshswarm.wait_for(lambda: all(len(swarm.peers_of(i)) == nodes - 1 for i in range(1, nodes + 1)), 60,
                               "every node to have its mesh peers")
            time.sleep(5)
            relay.set(**wan)
            spec = job_file(root / "job" / "job.toml", data, nodes, target, mode, max_seconds, workload, scale,
                            compression)
            started = time.monotonic()
            job = swarm.submit_file(spec)
            info = None
            for info in swarm.follow_job(job["id"]):  # one watcher process, not a CLI process per look
                if info["state"] in ("completed", "failed", "cancelled"):
                    break
                if time.monotonic() - started > max_seconds + 300:
                    raise RuntimeError(f"the {nodes}-node job did not end in {max_seconds + 300:g} s")
            seconds = time.monotonic() - started
            if info is None or info["state"] != "completed":
                state, error = (info["state"], info.get("error")) if info else ("unwatched", None)
                raise RuntimeError(f"the {nodes}-node job ended {state}: {error}\n"
                                   + swarm.log_tail("node-1", 40))
            name = re.match(r"\s*(\w+)", target).group(1)
            metrics = info.get("final_metrics") or info["progress"].get("metrics") or {}
            return {"seconds": seconds, "steps": info["progress"].get("global_step"), "metric": metrics.get(name),
                    "throttled_seconds": sum(q.throttled_seconds() for q in quotas) / nodes}
        finally:
            swarm.stop_all()
            relay.stop()
            for quota in quotas:
                quota.remove()


# ---- report ----------------------------------------------------------------------------------------------------


def median_run(runs: list[dict]) -> dict:
    """The median run (the lower of the middle two for an even count) with the median of every run's seconds as
    `seconds`, and every run's seconds as `runs`."""
    seconds = [r["seconds"] for r in runs]
    middle = statistics.median_low(seconds)
    return {**next(r for r in runs if r["seconds"] == middle), "seconds": statistics.median(seconds), "runs": seconds}


def spread(c: dict) -> str:
    """A case's seconds: the median, and the range when it ran more than once."""
    runs = c.get("runs") or [c["seconds"]]
    return f"{c['seconds']:.1f}" + (f" ({min(runs):.1f}-{max(runs):.1f})" if len(runs) > 1 else "")


def table(cases: list[dict], args, plain: dict, draw: bool) -> str:
    wan = f"{args.rate:g} Mbit/s, {args.rtt:g} ms RTT, {args.loss:g}% loss"
    scale = ((f", batch {TINYLM['batch_size']} split over the nodes" if args.scale == "strong" else
              f", batch {TINYLM['batch_size']} on every node") if args.workload == "tinylm" else "")
    lines = [f"## scaling ({time.strftime('%Y-%m-%d')}, {platform.machine()}, 2 cores, {args.cpus:g} CPU per node and "
             f"for the plain loop, WAN {wan}, {args.workload} to {args.target}{', --quick' if args.quick else ''}"
             f"{scale}{f', median of {args.repeat} runs (range)' if args.repeat > 1 else ''})", "",
             "| case | mode | compression | seconds to target | global steps | final metric | speedup vs 1 node "
             "| vs plain loop |",
             "|---|---|---|---|---|---|---|---|",
             f"| plain PyTorch loop | - | - | {spread(plain)} | {plain['steps']} (local) "
             f"| {plain['metric']:.3f} | - | 1.00 |"]
    for c in cases:
        speedup = "-" if c["speedup"] is None else f"{c['speedup']:.2f}"
        lines.append(f"| {c['nodes']} node{'s' if c['nodes'] > 1 else ''} | {c['mode']} | {c['compression']} | "
                     f"{spread(c)} | {c['steps']} | {c['final_metric']:.3f} | {speedup} | "
                     f"{plain['seconds'] / c['seconds']:.2f} |")
    text = "\n".join(lines) + "\n"
    if not draw:
        return text
    variants = sorted({(c["mode"], c["compression"]) for c in cases})
    counts = sorted({c["nodes"] for c in cases})
    # The mode's one node (run once, see main) starts every series of that mode.
    series = {f"{mode}, {compression}": [next((c["speedup"] for c in cases if c["mode"] == mode and c["nodes"] == n
                                                and (n == 1 or c["compression"] == compression) and c["speedup"]),
                                               float("nan")) for n in counts] for mode, compression in variants}
    text += "\n" + charts.lines("scaling" if args.workload == "tinylm" else f"scaling-{args.workload}",
                                f"{args.workload}: speedup against nodes (time to target)", counts, series,
                                "nodes", "speedup vs one node", ideal=counts) + "\n"
    return text


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", default="tinylm", help='tinylm (default) or a built-in, e.g. "digits-mlp"')
    parser.add_argument("--quick", action="store_true", help="1 and 2 nodes to an easier target")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--nodes", default=None, help="comma-separated node counts (default 1,2,4; --quick 1,2)")
    parser.add_argument("--mode", action="append", choices=["diloco", "sync"], help="job modes (default diloco)")
    parser.add_argument("--compression", action="append", choices=["none", "fp16", "8bit"],
                        help="what the averaging rounds send (default: the job's default for its mode); repeat to "
                             "compare")
    parser.add_argument("--scale", choices=["strong", "weak"], default="strong",
                        help="tinylm's batch: the plain loop's split over the nodes (strong, default) or all of it on "
                             "each node (weak)")
    parser.add_argument("--cpus", type=float, default=0.4, help="CPU quota per node and for the plain loop")
    parser.add_argument("--target", default=None, help='stop rule (default "val_bpb <= 3.6"; --quick 4.4)')
    parser.add_argument("--rate", type=float, default=100.0, help="WAN rate cap, Mbit/s")
    parser.add_argument("--rtt", type=float, default=40.0, help="WAN round-trip time, ms")
    parser.add_argument("--loss", type=float, default=0.5, help="WAN packet loss, percent")
    parser.add_argument("--eval-every", type=int, default=20, help="the plain loop's evaluation interval, steps")
    parser.add_argument("--max-seconds", type=float, default=900.0)
    parser.add_argument("--repeat", type=int, default=1, help="runs of every case; the table shows medians")
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--keep", type=Path, help="keep each case's logs and databases under this directory")
    args = parser.parse_args()
    args.target = args.target or ("val_bpb <= 4.4" if args.quick else "val_bpb <= 3.6")
    reason = netlab.unavailable_reason() or quota_unavailable()
    if args.keep is not None and args.keep.exists() and any(args.keep.iterdir()):
        # A case's coordinator would find the last run's database (and its owner) and fail minutes in.
        reason = f"--keep {args.keep} is not empty: name a new directory"
    if args.repeat < 1:
        reason = "--repeat must be at least 1"
    if reason:
        print(f"scaling: {reason}", file=sys.stderr)
        return 1
    counts = [int(n) for n in (args.nodes or ("1,2" if args.quick else "1,2,4")).split(",")]
    modes = args.mode or ["diloco"]
    compressions = args.compression or [None]  # None: the job's default for its mode
    wan = {"delay_ms": args.rtt / 2, "loss_pct": args.loss, "rate_mbit": args.rate}
    with contextlib.ExitStack() as stack:
        tmp = args.keep or stack.enter_context(tempfile.TemporaryDirectory(prefix="gpuswarm-scaling-"))
        data = corpus(Path(tmp) / "stdlib")
        variants = [(mode, compression) for mode in modes for compression in compressions]
        # A lone node averages nothing: its time does not depend on the compression, so it runs once per mode.
        keys = [(mode, compression, n) for mode, compression in variants for n in counts
                if n > 1 or compression == compressions[0]]
        plain_runs: list[dict] = []
        runs: dict[tuple, list[dict]] = {key: [] for key in keys}
        for r in range(1, args.repeat + 1):
            round_of = f" (run {r} of {args.repeat})" if args.repeat > 1 else ""
            print(f"plain loop under {args.cpus:g} CPU{round_of} ...", file=sys.stderr)
            result = run_plain(data, args.target, args.cpus, args.eval_every, args.max_seconds, args.workload)
            if result["seconds"] is None:
                print(f"scaling: the plain loop did not reach {args.target} in {args.max_seconds:g} s", file=sys.stderr)
                return 1
            print(f"  {result['seconds']:.1f} s, {result['steps']} steps", file=sys.stderr)
            plain_runs.append(result)
            for mode, compression, n in keys:
                print(f"{n} node(s), {mode}, {compression or 'default'} compression{round_of} ...", file=sys.stderr)
                name = f"{mode}-{compression or 'default'}-{n}" + (f"-run{r}" if args.repeat > 1 else "")
                result = run_swarm(n, data, args.target, mode, args.cpus, wan, args.max_seconds, Path(tmp) / name,
                                   args.workload, args.scale, compression)
                print(f"  {result['seconds']:.1f} s, {result['steps']} global steps, metric {result['metric']}",
                      file=sys.stderr)
                runs[mode, compression, n].append(result)
        plain = median_run(plain_runs)
        cases = []
        for (mode, compression, n), results in runs.items():
            r = median_run(results)
            cases.append({"nodes": n, "mode": mode, "compression": compression
                          or TrainingOptions.model_validate({"mode": mode}).compression,
                          "batch_per_node": node_batch(n, args.scale) if args.workload == "tinylm" else None,
                          "seconds": r["seconds"], "runs": r["runs"], "steps": r["steps"], "final_metric": r["metric"],
                          "throttled_seconds": r["throttled_seconds"]})
        for mode in modes:  # speedup against the mode's one node
            one = next((c["seconds"] for c in cases if c["mode"] == mode and c["nodes"] == 1), None)
            for c in cases:
                if c["mode"] == mode:
                    c["speedup"] = one / c["seconds"] if one else None
    if args.json:
        print(json.dumps({"nodes": 0, "mode": "plain", "seconds": plain["seconds"], "runs": plain["runs"],
                          "steps": plain["steps"], "final_metric": plain["metric"], "speedup": None}))
        for c in cases:
            print(json.dumps(c))
    text = table(cases, args, plain, draw=not args.no_write)
    if not args.json:
        print(text)
    if not args.no_write:
        with open(ROOT / "docs" / "benchmarks.md", "a") as f:
            f.write("\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
