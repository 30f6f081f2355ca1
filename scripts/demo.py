"""The main job: a coordinator and three node daemons on this machine train digits-mlp with hivemind all-reduce.

`--job PATH` runs the same local swarm on any job file instead (examples/tinylm/job.toml, examples/byo/job.toml):
it is submitted with `gpuswarm job submit`, which packs and uploads its code and data, and the nodes opt in to
running owners' code. Prints the swarm coming up, live training progress, the final metric (for digits-mlp the
accuracy, re-measured on the downloaded model), where the model was saved, and the contribution ledger.
Everything it started is stopped on exit, Ctrl-C or SIGTERM included. Run it through scripts/demo, which sets up
the virtual environment first.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

from gpuswarm.proto.api import JobDetail, JobInfo, JobStatement, NodeInfo
from pydantic import BaseModel
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
import netlab  # noqa: E402
from localswarm import LocalSwarm  # noqa: E402
from meshswarm import MeshSwarm  # noqa: E402

console = Console(highlight=False, width=None if sys.stdout.isatty() else 140)
PRICES = [0.5, 0.6, 0.7]  # the nodes' asks, credits per GPU-hour (a CPU node counts as one GPU)
BUDGET = 5.0


def typed(model: type[BaseModel], value):
    """The API's answer as its model (proto.api), whether the swarm's client returned the model (LocalSwarm, the
    Python client) or its JSON (MeshSwarm, the CLI inside the lab's namespace)."""
    return value if isinstance(value, model) else model.model_validate(value)


def make_example_data(job: Path) -> None:
    """An example that generates its data set (examples/byo/make_data.py) gets it made first, once."""
    dataset = tomllib.loads(job.read_text()).get("dataset", {}).get("path")
    script = job.parent / "make_data.py"
    if isinstance(dataset, str) and script.is_file() and not (job.parent / dataset).exists():
        console.print(f"$ python {script}   # the example's data set ({job.parent / dataset} is missing)")
        subprocess.run([sys.executable, str(script)], check=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--target-accuracy", type=float, default=0.95)
    parser.add_argument("--timeout", type=float, default=600.0, help="give up after this many seconds of training")
    parser.add_argument("--dir", type=Path, default=Path("var/demo"), help="where state, logs and the model go")
    parser.add_argument("--no-mesh", action="store_true", help="run on loopback even where the mesh could run")
    parser.add_argument("--job", type=Path, help="a job file to run instead of the digits-mlp demo job")
    args = parser.parse_args()
    if args.job is not None and not args.job.is_file():
        parser.error(f"--job {args.job}: no such file")
    if args.job is not None:
        make_example_data(args.job)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM cleans up like Ctrl-C

    started = time.monotonic()
    shutil.rmtree(args.dir, ignore_errors=True)
    args.dir.mkdir(parents=True)
    mesh_missing = "--no-mesh was given" if args.no_mesh else mesh_unavailable()
    with contextlib.ExitStack() as stack:
        if mesh_missing is None:
            lab = stack.enter_context(netlab.NetLab(args.nodes + 1))
            swarm, indices = MeshSwarm(lab, args.dir.resolve()), list(range(1, args.nodes + 1))
            where = f"in {args.nodes + 1} network namespaces, over a WireGuard mesh (wireguard-go)"
        else:
            swarm, indices = LocalSwarm(args.dir.resolve()), list(range(args.nodes))
            where = "on loopback"
        try:
            console.print(f"[bold]gpuswarm demo[/bold]: 1 coordinator + {args.nodes} nodes {where} "
                          f"(state and logs in {args.dir}/)")
            if mesh_missing:
                console.print(f"[yellow]no WireGuard mesh ({mesh_missing}): hivemind runs over loopback, "
                              "UNENCRYPTED[/yellow]")
            swarm.start_coordinator()
            console.print(f"coordinator up at {swarm.url}")
            # A job file may bring its owner's code: the demo's nodes opt in to running it.
            node_flags = ("--allow-custom-code",) if args.job is not None else ()
            for k, i in enumerate(indices):
                swarm.start_node(i, PRICES[k % len(PRICES)], *node_flags)
            nodes = [typed(NodeInfo, n) for n in swarm.wait_for_nodes(args.nodes)]
            console.print(f"{len(nodes)} nodes registered: " + ", ".join(
                n.id + (f" (mesh {n.mesh_address})" if n.mesh_address else "") for n in nodes))

            if args.job is not None:
                console.print(f"$ gpuswarm job submit {args.job}")
                job = typed(JobInfo, swarm.submit_file(args.job.resolve()))
                console.print(f"submitted job [bold]{job.id}[/bold]: {job.spec.label}, stop rule "
                              f"{job.spec.stop.model_dump(exclude_none=True)}, {job.spec.min_nodes}-"
                              f"{job.spec.max_nodes} nodes")
            else:
                spec = {"name": "demo-digits", "workload": "digits-mlp", "min_nodes": 2, "max_nodes": args.nodes,
                        "max_price_per_gpu_hour": 1.0, "budget": BUDGET,
                        "stop": {"target_accuracy": args.target_accuracy, "max_epochs": 60}}
                job = typed(JobInfo, swarm.client.submit_job(spec))
                console.print(f"submitted job [bold]{job.id}[/bold]: digits-mlp, target test accuracy "
                              f"{args.target_accuracy}, 2-{args.nodes} nodes, bid 1.0/GPU-hour, budget {BUDGET}")
            job = follow(swarm, job.id, args.timeout)
            if job.state != "completed":
                console.print(f"[red]job ended {job.state}[/red]: {job.error or ''}")
                return 1
            if mesh_missing is None:
                status = lab.exec(indices[0], [sys.executable, "-m", "gpuswarm.cli", "mesh", "status", "--state-dir",
                                               str(swarm.state_dir(indices[0]))], check=False)
                console.print(f"\n$ gpuswarm mesh status   (on node {indices[0]})\n{status.stdout}{status.stderr}")
            return report(swarm, job, args.dir, started)
        except KeyboardInterrupt:
            console.print("\n[yellow]interrupted; stopping the swarm[/yellow]")
            return 130
        except (TimeoutError, RuntimeError, AssertionError) as e:
            console.print(f"[red]demo failed:[/red] {e}")
            for name in ["coordinator", *(f"node-{i}" for i in indices)]:
                console.print(f"[dim]--- {name}.log (tail) ---[/dim]\n{swarm.log_tail(name, 10)}")
            return 1
        finally:
            console.print("stopping coordinator and nodes ...")
            swarm.stop_all()
            console.print("all stopped")


def mesh_unavailable() -> str | None:
    """Why the demo cannot run its nodes in namespaces over the mesh here, or None if it can."""
    return netlab.unavailable_reason(wireguard=True)


def looks(swarm, job_id: str):
    """The job at every look, a second apart: MeshSwarm's one watcher process in the lab (a CLI process per look
    would take CPU from the nodes being timed), or LocalSwarm's Python client."""
    if isinstance(swarm, MeshSwarm):
        yield from swarm.follow_job(job_id, interval=1.0)
        return
    while True:
        yield swarm.client.job(job_id)
        time.sleep(1.0)


def follow(swarm, job_id: str, timeout: float) -> JobDetail:
    deadline = time.monotonic() + timeout
    seen_events, last_step = 0, -1
    for look in looks(swarm, job_id):
        job = typed(JobDetail, look)
        for event in job.events[seen_events:]:
            console.print(f"  [dim]{time.strftime('%H:%M:%S', time.localtime(event.at))}[/dim] {event.message}")
        seen_events = len(job.events)
        p = job.progress
        metrics = getattr(p, "metrics", None) or {}
        if p.global_step != last_step and job.state == "running" and (metrics or p.accuracy is not None):
            last_step = p.global_step
            shown = "  ".join(f"{k} {v:.4f}" for k, v in sorted(metrics.items())) or \
                f"test accuracy {p.accuracy:.4f}  loss {p.loss:.4f}"
            console.print(f"  training: epoch {p.epoch:5.2f}  step {p.global_step:3d}  {shown}  peers in run "
                          f"{p.peers}  {p.samples_per_second:.0f} samples/s per node")
        if job.state.is_final:
            return job
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {job_id} did not finish within {timeout:.0f}s")
    raise RuntimeError(f"stopped watching job {job_id} before it ended (see follow.log and coordinator.log)")


def report(swarm, job: JobDetail, directory: Path, started: float) -> int:
    model = (directory / "model.pt").resolve()
    swarm.client.download_artifact(job.id, "model.pt", model)
    statement = settled_statement(swarm, job.id)

    console.print()
    console.print(f"[bold green]job {job.id} completed[/bold green] after "
                  f"{job.finished_at - job.started_at:.0f}s of training")
    ok = True
    if job.spec.workload == "digits-mlp":
        evaluated = json.loads(subprocess.run(
            [sys.executable, "-m", "gpuswarm.cli", "node", "evaluate", str(model), "--json"],
            check=True, capture_output=True, text=True).stdout)
        console.print(f"final test accuracy (reported by the swarm): {job.final_accuracy:.4f}")
        console.print(f"final test accuracy (re-measured on the downloaded model): {evaluated['accuracy']:.4f}")
        ok = evaluated["accuracy"] >= 0.95
    final = getattr(job, "final_metrics", None) or getattr(job.progress, "metrics", None) or {}
    if final:
        console.print("final metrics (reported by the swarm): " + ", ".join(
            f"{k} {v:.4f}" for k, v in sorted(final.items())))
    console.print(f"model saved to {model}")
    ledger = statement.nodes
    table = Table("node", "claims", "samples claimed", "samples credited", "compute s", "paid", "flagged",
                  title="Contributions (peer-attested ledger)")
    for row in ledger:
        table.add_row(row.node_id, str(row.claims), str(row.claimed_samples), str(row.samples),
                      f"{row.compute_seconds:.2f}", f"{row.paid:.6f}", str(row.flagged))
    console.print(table)
    console.print(f"budget {statement.budget}: reserved {statement.reserved:.6f}, paid to nodes "
                  f"{statement.paid:.6f}, refunded {statement.refunded:.6f}"
                  + ("" if statement.settled else " (not settled yet)"))
    console.print(f"wall time: {time.monotonic() - started:.0f}s")
    ok = ok and len(ledger) >= min(3, job.spec.min_nodes) and all(r.samples > 0 for r in ledger)
    return 0 if ok else 1


def settled_statement(swarm, job_id: str, timeout: float = 60.0) -> JobStatement:
    """The job's statement once its books are closed (the nodes' last round reports arrive a heartbeat or two
    after the end; the coordinator settles after its grace period)."""
    deadline = time.monotonic() + timeout
    while True:
        statement = typed(JobStatement, swarm.client.job_statement(job_id))
        if statement.settled or time.monotonic() > deadline:
            return statement
        time.sleep(1.0)


if __name__ == "__main__":
    sys.exit(main())
