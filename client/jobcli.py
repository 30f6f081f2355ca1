"""The job owner's command group, `gpuswarm job ...`: validate, submit, list, status (--follow), cancel, download
and statement, each a client of the coordinator's API (client/api.py) except `validate`, which works offline.

Every listing prints a table by default and the API's JSON with --json. The job file format is client/jobfile.py's;
following a job is client/follow.py's.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any

import typer
from gpuswarm.client.api import SyncClient
from gpuswarm.client.common import DEFAULT_URL, CoordinatorURL, JsonFlag, OwnerToken, ago, call, counted, fmt
from gpuswarm.client.follow import follow_job
from gpuswarm.proto.api import ContributionSummary, dump
from gpuswarm.proto.models import JobSpec, JobState
from rich.table import Table

from gpuswarm.console import Col, console, fail, fit_table, print_json, print_listing

job_app = typer.Typer(help="Submit, watch, cancel and download training jobs.", no_args_is_help=True)

JobFile = Annotated[Path | None, typer.Argument(help="Job spec as TOML (flags override its values).")]


def spec_of(file: Path | None, overrides: dict[str, Any], params: list[str]) -> JobSpec:
    """The job file with the flags' overrides, checked (client/jobfile.py); a bad one exits 1 saying why."""
    from gpuswarm.client.jobfile import JobFileError, build_spec

    try:
        return build_spec(file, overrides, params)
    except JobFileError as e:
        raise fail(str(e)) from None


@job_app.command("submit")
def job_submit(
    file: JobFile = None,
    workload: Annotated[str | None, typer.Option(help="Workload name, e.g. digits-mlp.")] = None,
    name: Annotated[str | None, typer.Option(help="A name to recognise the job by.")] = None,
    target_accuracy: Annotated[float | None, typer.Option(help="Stop at this test accuracy.")] = None,
    max_epochs: Annotated[int | None, typer.Option(help="Stop after this many passes over the data.")] = None,
    min_nodes: Annotated[int | None, typer.Option(help="Nodes needed to start.")] = None,
    max_nodes: Annotated[int | None, typer.Option(help="Most nodes the job may use.")] = None,
    max_price: Annotated[float | None, typer.Option(help="Highest price per GPU-hour (your bid).")] = None,
    budget: Annotated[float | None, typer.Option(help="Credits reserved for the job when it starts.")] = None,
    gpus_per_node: Annotated[int | None, typer.Option(help="GPUs the job takes on each node.")] = None,
    verified_only: Annotated[bool | None, typer.Option("--verified-only/--any-node",
                                                       help="Only nodes that passed the GPU challenge.")] = None,
    param: Annotated[list[str] | None, typer.Option("--param", "-p", help="Hyper-parameter NAME=VALUE.")] = None,
    coordinator: CoordinatorURL = DEFAULT_URL,
    token: OwnerToken = None,
    as_json: JsonFlag = False,
) -> None:
    """Submit a training job."""
    spec = spec_of(file, {"workload": workload, "name": name, "stop.target_accuracy": target_accuracy,
                          "stop.max_epochs": max_epochs, "min_nodes": min_nodes, "max_nodes": max_nodes,
                          "max_price_per_gpu_hour": max_price, "budget": budget, "gpus_per_node": gpus_per_node,
                          "requirements.verified_only": verified_only}, param or [])
    job = call(SyncClient(coordinator, token=token).submit_job, spec)
    if as_json:
        print_json(dump(job))
    else:
        console.print(f"submitted [bold]{job.id}[/bold] ({spec.workload}, {spec.min_nodes}-{spec.max_nodes} "
                      f"nodes); follow it with: gpuswarm job status {job.id}")


JOB_COLUMNS = [Col("ID", 14, 14), Col("NAME", 8, 32), Col("WORKLOAD", 8, 20, drop=2), Col("STATE", 9, 9),
               Col("NODES", 5, 5, justify="right"), Col("EPOCH", 5, 9, justify="right"),
               Col("ACCURACY", 8, 8, justify="right"), Col("SUBMITTED", 9, 9, drop=1)]


@job_app.command("list")
def job_list(
    state: Annotated[str | None, typer.Option(help="Only jobs in this state.")] = None,
    limit: Annotated[int | None, typer.Option(min=1, help="Only the newest N jobs.")] = None,
    coordinator: CoordinatorURL = DEFAULT_URL,
    token: OwnerToken = None,
    as_json: JsonFlag = False,
) -> None:
    """List your jobs, newest first: one line each, then a count by state."""
    jobs = call(SyncClient(coordinator, token=token).jobs, state)
    shown = jobs[:limit]
    if as_json:
        return print_json(dump(shown))
    if not jobs:
        return console.print("no jobs")
    rows = [[j.id, j.name or "-", j.spec.workload, j.state.value, str(j.active_nodes), fmt(j.progress.epoch, 2),
             fmt(j.final_accuracy or j.progress.accuracy), ago(j.created_at)] for j in shown]
    counts: dict[str, int] = {}
    for j in jobs:
        counts[j.state.value] = counts.get(j.state.value, 0) + 1
    summary = f"{len(jobs)} job{'s' if len(jobs) != 1 else ''}: {counted(counts, [s.value for s in JobState])}"
    if len(shown) < len(jobs):
        summary += f"; showing the newest {len(shown)}"
    print_listing(*fit_table(JOB_COLUMNS, rows, console.width), summary)


@job_app.command("status")
def job_status(
    job_id: Annotated[str, typer.Argument(help="Job ID.")],
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep watching until the job ends: a live "
                                         "progress bar on a terminal, one line per change when piped.")] = False,
    interval: Annotated[float, typer.Option(min=0.05, help="Seconds between polls with --follow.")] = 2.0,
    timeout: Annotated[float | None, typer.Option(min=0, help="With --follow: give up (exit 3) when the "
                                                  "coordinator stays unreachable this many seconds.")] = None,
    coordinator: CoordinatorURL = DEFAULT_URL,
    token: OwnerToken = None,
    as_json: JsonFlag = False,
) -> None:
    """Show a job's state, progress, members, contributions, artifacts and recent events.

    --follow exits 0 when the job completes, 1 if it fails or is cancelled, 130 on Ctrl-C, 3 after --timeout."""
    # A coordinator that hangs instead of refusing must not hold one poll past --timeout.
    client = SyncClient(coordinator, token=token, timeout=10.0 if timeout is None else min(10.0, timeout + 0.5))
    if follow:
        raise typer.Exit(follow_job(client, job_id, interval, timeout, as_json))
    job = call(client.job, job_id)
    if as_json:
        return print_json(dump(job))
    p = job.progress
    console.print(f"[bold]{job.id}[/bold] {job.name}  state: [bold]{job.state}[/bold]  "
                  f"workload: {job.spec.workload}")
    console.print(f"epoch {p.epoch:.2f}  step {p.global_step}  accuracy {fmt(p.accuracy)}  "
                  f"loss {fmt(p.loss)}  {p.samples_per_second:.0f} samples/s  peers {p.peers}")
    if job.final_accuracy is not None:
        console.print(f"final test accuracy: [bold green]{job.final_accuracy:.4f}[/bold green]")
    if job.error:
        console.print(f"[red]error:[/red] {job.error}")
    print_contributions(job.contributions)
    members = Table("NODE", "SHARD", "STATE", "SINCE", "REASON", title="Assignments")
    for a in job.assignments:
        members.add_row(a.node_id, str(a.shard_index), a.state.value, ago(a.created_at), a.reason or "")
    console.print(members)
    for a in job.artifacts:
        console.print(f"artifact {a.name}: {a.size} bytes, sha256 {a.sha256[:16]}…{' (final)' if a.final else ''}")
    for e in job.events[-8:]:
        console.print(f"  [dim]{time.strftime('%H:%M:%S', time.localtime(e.at))}[/dim] {e.message}")


def print_contributions(rows: list[ContributionSummary]) -> None:
    table = Table("NODE", "CLAIMS", "SAMPLES CLAIMED", "SAMPLES CREDITED", "COMPUTE S", "PAID", "PENDING", "FLAGGED",
                  title="Contributions (peer-attested)")
    for c in rows:
        table.add_row(c.node_id, str(c.claims), str(c.claimed_samples), str(c.samples), f"{c.compute_seconds:.1f}",
                      f"{c.paid:.4f}", str(c.pending), f"[red]{c.flagged}[/red]" if c.flagged else "0")
    console.print(table if rows else "no contributions recorded yet")


@job_app.command("cancel")
def job_cancel(job_id: str, coordinator: CoordinatorURL = DEFAULT_URL, token: OwnerToken = None,
               as_json: JsonFlag = False) -> None:
    """Cancel a pending or running job; its nodes stop training within a heartbeat."""
    job = call(SyncClient(coordinator, token=token).cancel_job, job_id)
    print_json(dump(job)) if as_json else console.print(f"{job.id} cancelled")


@job_app.command("download")
def job_download(
    job_id: str,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Where to save the model.")] = None,
    tensorboard: Annotated[Path | None, typer.Option(
        "--tensorboard", metavar="LOGDIR",
        help="Instead of the model, save the job's TensorBoard event file as LOGDIR/JOB_ID/tensorboard.tfevents "
             "(also while it runs); view it with: tensorboard --logdir LOGDIR.")] = None,
    coordinator: CoordinatorURL = DEFAULT_URL,
    token: OwnerToken = None,
    as_json: JsonFlag = False,
) -> None:
    """Download a completed job's final model (checked against its SHA-256), or with --tensorboard its progress."""
    if tensorboard is not None and output is not None:
        raise fail("--output and --tensorboard conflict: --tensorboard saves the event file, not the model")
    client = SyncClient(coordinator, token=token)
    job = call(client.job, job_id)
    if tensorboard is not None:
        path, digest = call(client.download_tensorboard, job_id, tensorboard)
        size = path.stat().st_size
        if as_json:
            return print_json({"job_id": job_id, "path": str(path), "sha256": digest, "size": size,
                               "state": job.state.value})
        console.print(f"saved {path} ({size} bytes, progress of a {job.state} job); view it with: "
                      f"tensorboard --logdir {tensorboard}")
        return
    final = [a for a in job.artifacts if a.final]
    if not final:
        raise fail(f"job {job_id} has no final model yet (state: {job.state})")
    artifact = final[0]
    dest = output or Path(f"{job_id}-{artifact.name}")
    digest = call(client.download_artifact, job_id, artifact.name, dest)
    result = {"job_id": job_id, "path": str(dest), "sha256": digest, "size": artifact.size,
              "accuracy": artifact.accuracy}
    if as_json:
        print_json(result)
    else:
        console.print(f"saved {dest} ({artifact.size} bytes, reported test accuracy "
                      f"{fmt(artifact.accuracy)}); check it with: gpuswarm node evaluate {dest}")


@job_app.command("statement")
def job_statement(job_id: str, coordinator: CoordinatorURL = DEFAULT_URL, token: OwnerToken = None,
                  as_json: JsonFlag = False) -> None:
    """The money side of a job: budget, escrow, what each node was credited and paid, and the refund."""
    s = call(SyncClient(coordinator, token=token).job_statement, job_id)
    if as_json:
        return print_json(dump(s))
    console.print(f"[bold]{s.job_id}[/bold]  state: {s.state}  budget {s.budget:.6f}  reserved "
                  f"{s.reserved:.6f}  paid {s.paid:.6f}  refunded {s.refunded:.6f}  in escrow "
                  f"{s.escrow:.6f}  {'settled' if s.settled else 'not settled yet'}")
    print_contributions(s.nodes)


@job_app.command("validate")
def job_validate(file: Annotated[Path, typer.Argument(help="Job spec as TOML.")]) -> None:
    """Check a job file offline, as `job submit` would, and print its spec with every default filled in, as JSON.

    A problem is printed instead, and the exit code is 1."""
    print_json(spec_of(file, {}, []).model_dump(mode="json"))
