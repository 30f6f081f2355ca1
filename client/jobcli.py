"""The job owner's command group, `gpuswarm job ...`: validate, submit, list, status (--follow), logs, cancel,
artifacts, download, statement and audits, each a client of the coordinator's API (client/api.py) except
`validate`, which works offline.

`submit` packs the job's code and dataset (client/jobfile.py, client/pack.py), checks its params locally, uploads
only the blobs the coordinator lacks (with a progress bar on a terminal) and posts the spec by their hashes. What it
says along the way goes to stderr, so that --json's stdout is only JSON. Every listing prints a table by default and
the API's JSON with --json. The job file format is client/jobfile.py's; following a job is client/follow.py's.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from gpuswarm.client.api import ApiError, SyncClient
from gpuswarm.client.common import DEFAULT_URL, CoordinatorURL, JsonFlag, OwnerToken, ago, call, counted, fmt
from gpuswarm.client.follow import clock, follow_job, follow_logs, log_records
from gpuswarm.proto.api import ArtifactInfo, ContributionSummary, JobDetail, dump
from gpuswarm.proto.models import JobState
from rich.markup import escape
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table

from gpuswarm.console import Col, console, err, fail, fit_table, print_json, print_listing

if TYPE_CHECKING:
    from gpuswarm.client.jobfile import BuiltJob
    from gpuswarm.client.pack import Pack

job_app = typer.Typer(help="Submit, watch, cancel and download training jobs.", no_args_is_help=True)

JobFile = Annotated[Path | None, typer.Argument(help="Job spec as TOML (flags override its values).")]


NoLocalCheck = Annotated[bool, typer.Option(
    "--no-local-check", help="Do not import your code here to check its params (for a machine that cannot): a bad "
                             "param then fails on the node.")]


def job_of(file: Path | None, overrides: dict[str, Any], params: list[str], local_check: bool = True,
           table: dict[str, Any] | None = None) -> BuiltJob:
    """The job file (or `table`, a job's table from `file`) with the flags' overrides, checked and packed
    (client/jobfile.py), saying on stderr what it packs; a bad one exits 1 saying why."""
    from gpuswarm.client.jobfile import JobFileError, build_job

    try:
        built = build_job(file, overrides, params, local_check=local_check, on_pack=print_pack, table=table)
    except JobFileError as e:
        raise fail(str(e)) from None
    if built.spec.code is not None and not local_check:
        err.print(f"[yellow]warning:[/yellow] the params were not checked against {escape(built.spec.code.entrypoint)}"
                  f" (--no-local-check); a bad param fails on the node", soft_wrap=True)
    return built


def human_size(size: float) -> str:
    """Bytes in decimal units: 950 B, 12.3 KB, 4.5 MB."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if size < 1000 or unit == "TB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} TB"


def pack_summary(part: str, pack: Pack) -> str:
    """`code 3 files 12.3 KB sha256 1a2b3c4d…`: what a pack holds, for the owner to recognise it."""
    files = f"{pack.files} file{'s' if pack.files != 1 else ''}"
    what = files if pack.format == "tar" else f"{pack.format} {pack.source.name}"
    return f"{part} {what} {human_size(pack.content_bytes)} sha256 {pack.sha256[:8]}…"


def print_pack(part: str, pack: Pack) -> None:
    """on_pack: what was packed (stderr), and what was left out of it."""
    reused = " (unchanged since the last pack)" if pack.reused else ""
    err.print(escape(f"packed {pack_summary(part, pack)}{reused}"), soft_wrap=True)
    for warning in pack.warnings:
        err.print(f"[yellow]warning:[/yellow] {part}: {escape(warning)}", soft_wrap=True)
    if pack.left_out:
        err.print(f"[yellow]note:[/yellow] {part}: max_bytes left out the last {pack.left_out} files", soft_wrap=True)


def upload_missing(client: SyncClient, built: BuiltJob) -> None:
    """Upload the job's packs the coordinator lacks for this owner; say of each whether it was already there."""
    if not built.blobs:
        return
    missing = set(call(client.missing_blobs, [p.sha256 for p in built.blobs]))
    for part, pack in (("code", built.code), ("dataset", built.dataset)):
        if pack is None:
            continue
        if pack.sha256 not in missing:
            err.print(escape(f"{pack_summary(part, pack)} (already on the coordinator)"), soft_wrap=True)
            continue
        missing.discard(pack.sha256)  # code and dataset may be the same bytes: one upload
        upload_one(client, part, pack)


def upload_one(client: SyncClient, part: str, pack: Pack) -> None:
    """Stream one pack with a progress bar (bytes, rate, ETA) on a terminal, or a line before and after."""
    started = time.monotonic()
    try:
        if err.is_terminal:
            columns = (TextColumn(f"uploading {part}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                       TimeRemainingColumn())
            with Progress(*columns, console=err, transient=True) as bar:
                task = bar.add_task(part, total=pack.size)
                client.upload_blob(pack.path, pack.sha256, pack.size, lambda sent: bar.update(task, completed=sent))
        else:
            err.print(escape(f"uploading {pack_summary(part, pack)} ({human_size(pack.size)} to send)"),
                      soft_wrap=True)
            client.upload_blob(pack.path, pack.sha256, pack.size, None)
    except ApiError as e:
        raise fail(f"upload of the {part} ({human_size(pack.size)}) failed: {e.message}") from None
    seconds = max(time.monotonic() - started, 1e-6)
    err.print(escape(f"{pack_summary(part, pack)} uploaded in {seconds:.1f}s "
                     f"({human_size(pack.size / seconds)}/s)"), soft_wrap=True)


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
    param: Annotated[list[str] | None, typer.Option("--param", "-p", help="Param NAME=VALUE.")] = None,
    target: Annotated[str | None, typer.Option(help='Stop when a metric reaches this, e.g. "val_bpb <= 2.2".')] = None,
    max_steps: Annotated[int | None, typer.Option(help="Stop after this many global steps.")] = None,
    no_local_check: NoLocalCheck = False,
    coordinator: CoordinatorURL = DEFAULT_URL,
    token: OwnerToken = None,
    as_json: JsonFlag = False,
) -> None:
    """Submit a training job: pack its code and dataset, check its params, upload what the coordinator lacks."""
    built = job_of(file, {"workload": workload, "name": name, "stop.target_accuracy": target_accuracy,
                          "stop.max_epochs": max_epochs, "stop.target": target, "stop.max_steps": max_steps,
                          "min_nodes": min_nodes, "max_nodes": max_nodes, "max_price_per_gpu_hour": max_price,
                          "budget": budget, "gpus_per_node": gpus_per_node,
                          "requirements.verified_only": verified_only}, param or [], not no_local_check)
    client = SyncClient(coordinator, token=token)
    upload_missing(client, built)
    spec = built.spec
    job = call(client.submit_job, spec)
    if as_json:
        print_json(dump(job))
    else:
        console.print(f"submitted [bold]{job.id}[/bold] ({escape(spec.label)}, {spec.min_nodes}-{spec.max_nodes} "
                      f"nodes); follow it with: gpuswarm job status {job.id} --follow")


JOB_COLUMNS = [Col("ID", 14, 14), Col("NAME", 8, 32), Col("WORKLOAD", 8, 32, drop=2), Col("STATE", 9, 9),
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
    rows = [[j.id, j.name or "-", j.spec.label, j.state.value, str(j.active_nodes), fmt(j.progress.epoch, 2),
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
    console.print(f"[bold]{job.id}[/bold] {escape(job.name)}  state: [bold]{job.state}[/bold]  "
                  f"workload: {escape(job.spec.label)}")
    console.print(f"epoch {p.epoch:.2f}  step {p.global_step}  accuracy {fmt(p.accuracy)}  "
                  f"loss {fmt(p.loss)}  {p.samples_per_second:.0f} samples/s  peers {p.peers}")
    if p.metrics:
        console.print(f"metrics: {escape(metrics_line(p.metrics))}")
    if job.final_accuracy is not None:
        console.print(f"final test accuracy: [bold green]{job.final_accuracy:.4f}[/bold green]")
    if job.final_metrics:
        console.print(f"final metrics: [bold green]{escape(metrics_line(job.final_metrics))}[/bold green]")
    if job.error:
        console.print(f"[red]error:[/red] {job.error}")
    print_contributions(job.contributions)
    members = Table("NODE", "SHARD", "STATE", "SINCE", "REASON", title="Assignments")
    for a in job.assignments:
        members.add_row(a.node_id, str(a.shard_index), a.state.value, ago(a.created_at), a.reason or "")
    console.print(members)
    for a in job.artifacts:
        console.print(f"artifact {escape(a.name)}: {a.size} bytes, sha256 {a.sha256[:16]}…"
                      f"{' (final)' if a.final else ''}")
    for e in job.events[-8:]:
        console.print(f"  [dim]{time.strftime('%H:%M:%S', time.localtime(e.at))}[/dim] {escape(e.message)}")
    if len(job.events) > 8:
        console.print(f"  [dim]all of them: gpuswarm job logs {job.id}[/dim]")


def metrics_line(metrics: dict[str, float]) -> str:
    return "  ".join(f"{name} {value:.4g}" for name, value in sorted(metrics.items()))


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


ARTIFACT_COLUMNS = [Col("NAME", 12, 64), Col("KIND", 10, 10), Col("STEP", 4, 10, justify="right"),
                    Col("SIZE", 8, 8, justify="right"), Col("SHA256", 12, 12, drop=2), Col("CREATED", 9, 9, drop=1)]
CHECKPOINT_NAME = re.compile(r"^checkpoint-(\d+)\.pt$")


def artifact_kind(a: ArtifactInfo) -> tuple[str, int | None]:
    """("final" | "checkpoint" | "other", the checkpoint's global step or None)."""
    step = a.checkpoint_step
    if step is None and (match := CHECKPOINT_NAME.match(a.name)):
        step = int(match.group(1))
    if a.final:
        return "final", None
    return ("checkpoint", step) if step is not None else ("other", None)


def choose_artifact(job: JobDetail, name: str | None, checkpoint: str | None) -> ArtifactInfo:
    """The artifact `--name` or `--checkpoint latest|STEP` picks, else the final model; a miss exits 1 saying what
    there is."""
    if name is not None:
        found = [a for a in job.artifacts if a.name == name]
        if not found:
            names = ", ".join(a.name for a in job.artifacts) or "none yet"
            raise fail(f"job {job.id} has no artifact {name!r}; it has: {names}")
        return found[0]
    if checkpoint is not None:
        return choose_checkpoint(job, checkpoint)
    final = [a for a in job.artifacts if a.final]
    if not final:
        raise fail(f"job {job.id} has no final model yet (state: {job.state}); its checkpoints: gpuswarm job "
                   f"artifacts {job.id}")
    return final[0]


def choose_checkpoint(job: JobDetail, which: str) -> ArtifactInfo:
    steps = {step: a for a in job.artifacts if (kind := artifact_kind(a))[0] == "checkpoint"
             for step in [kind[1]]}
    if not steps:
        raise fail(f"job {job.id} has no checkpoint (state: {job.state})")
    if which == "latest":
        return steps[max(steps)]
    if not which.isdigit() or int(which) not in steps:
        raise fail(f"--checkpoint takes latest or a step of the job's checkpoints: "
                   f"{', '.join(map(str, sorted(steps)))}; got {which!r}")
    return steps[int(which)]


@job_app.command("artifacts")
def job_artifacts(job_id: str, coordinator: CoordinatorURL = DEFAULT_URL, token: OwnerToken = None,
                  as_json: JsonFlag = False) -> None:
    """List a job's artifacts: its final model, its checkpoints and the rest, oldest first."""
    job = call(SyncClient(coordinator, token=token).job, job_id)
    rows = sorted(job.artifacts, key=lambda a: a.created_at)
    if as_json:
        return print_json([dump(a) | dict(zip(("kind", "step"), artifact_kind(a), strict=True)) for a in rows])
    if not rows:
        return console.print(f"job {job_id} has no artifacts yet (state: {job.state})")
    lines = []
    for a in rows:
        kind, step = artifact_kind(a)
        lines.append([a.name, kind, "-" if step is None else str(step), human_size(a.size), a.sha256[:12],
                      ago(a.created_at)])
    kinds = [artifact_kind(a)[0] for a in rows]
    summary = f"{len(rows)} artifact{'s' if len(rows) != 1 else ''}: " + ", ".join(
        f"{kinds.count(k)} {k}" for k in ("final", "checkpoint", "other") if k in kinds)
    print_listing(*fit_table(ARTIFACT_COLUMNS, lines, console.width), summary)


@job_app.command("download")
def job_download(
    job_id: str,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Where to save it.")] = None,
    name: Annotated[str | None, typer.Option("--name", help="Any artifact by name (see `job artifacts`).")] = None,
    checkpoint: Annotated[str | None, typer.Option("--checkpoint", metavar="latest|STEP",
                                                   help="A checkpoint: the newest, or the one of this step.")] = None,
    tensorboard: Annotated[Path | None, typer.Option(
        "--tensorboard", metavar="LOGDIR",
        help="Instead of the model, save the job's TensorBoard event file as LOGDIR/JOB_ID/tensorboard.tfevents "
             "(also while it runs); view it with: tensorboard --logdir LOGDIR.")] = None,
    coordinator: CoordinatorURL = DEFAULT_URL,
    token: OwnerToken = None,
    as_json: JsonFlag = False,
) -> None:
    """Download a job's final model, any artifact (--name), a checkpoint (--checkpoint), or its progress.

    The file is checked against its SHA-256 before it is saved; --tensorboard saves the job's progress instead."""
    chosen = [flag for flag, value in (("--name", name), ("--checkpoint", checkpoint), ("--tensorboard", tensorboard))
              if value is not None]
    if len(chosen) > 1:
        raise fail(f"{' and '.join(chosen)} conflict: each picks what to download")
    if tensorboard is not None and output is not None:
        raise fail("--output and --tensorboard conflict: --tensorboard saves the event file, not the model")
    client = SyncClient(coordinator, token=token)
    job = call(client.job, job_id)
    if tensorboard is not None:
        return save_tensorboard(client, job, tensorboard, as_json)
    artifact = choose_artifact(job, name, checkpoint)
    dest = output or Path(f"{job_id}-{artifact.name}")
    digest = call(client.download_artifact, job_id, artifact.name, dest)
    kind, step = artifact_kind(artifact)
    if as_json:
        return print_json({"job_id": job_id, "name": artifact.name, "kind": kind, "step": step, "path": str(dest),
                           "sha256": digest, "size": artifact.size, "accuracy": artifact.accuracy})
    said = f"saved {dest} ({artifact.size} bytes"
    if kind == "checkpoint":
        console.print(escape(f"{said}, checkpoint of step {step})"))
    elif kind == "final" and job.spec.workload is not None:
        console.print(escape(f"{said}, reported test accuracy {fmt(artifact.accuracy)}); check it with: "
                             f"gpuswarm node evaluate {dest}"))
    elif kind == "final":
        metrics = f", reported {metrics_line(artifact.metrics)}" if artifact.metrics else ""
        console.print(escape(f"{said}{metrics})"))
    else:
        console.print(escape(f"{said})"))


def save_tensorboard(client: SyncClient, job: JobDetail, logdir: Path, as_json: bool) -> None:
    path, digest = call(client.download_tensorboard, job.id, logdir)
    size = path.stat().st_size
    if as_json:
        return print_json({"job_id": job.id, "path": str(path), "sha256": digest, "size": size,
                           "state": job.state.value})
    console.print(f"saved {path} ({size} bytes, progress of a {job.state} job); view it with: "
                  f"tensorboard --logdir {logdir}")


@job_app.command("logs")
def job_logs(
    job_id: str,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing new events until the job ends.")]
    = False,
    interval: Annotated[float, typer.Option(min=0.05, help="Seconds between polls with --follow.")] = 2.0,
    coordinator: CoordinatorURL = DEFAULT_URL,
    token: OwnerToken = None,
    as_json: JsonFlag = False,
) -> None:
    """Every event of a job with its time, oldest first, node failures with their full reason.

    This is where an import error in your code, or a stop rule naming a metric the workload does not report, shows."""
    client = SyncClient(coordinator, token=token)
    if follow:
        raise typer.Exit(follow_logs(client, job_id, interval, as_json))
    job = call(client.job, job_id)
    records = log_records(job)
    if as_json:
        return print_json([{"at": at, "message": message} for at, message in records])
    for at, message in records:
        typer.echo(f"{time.strftime('%Y-%m-%d', time.localtime(at))} {clock(at)} {message}")


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


@job_app.command("audits")
def job_audits(job_id: str, coordinator: CoordinatorURL = DEFAULT_URL, token: OwnerToken = None,
               as_json: JsonFlag = False) -> None:
    """The job's audits, newest first: whose round a third node re-computed, the outcome, the referees, and why
    one failed (a failed round bans its node from the job and takes back what it was paid)."""
    audits = call(SyncClient(coordinator, token=token).job_audits, job_id).audits
    if as_json:
        return print_json([dump(a) for a in audits])
    table = Table("AUDIT", "NODE", "ROUND", "STATE", "REFEREES", "DISTANCE", "REASON", title=f"Audits of {job_id}")
    for a in audits:
        table.add_row(a.audit_id, a.node_id, str(a.epoch), a.state, ", ".join(a.referees) or "-",
                      "-" if a.distance is None else f"{a.distance:.3g}", escape(a.reason) or "-")
    console.print(table)


@job_app.command("validate")
def job_validate(file: Annotated[Path, typer.Argument(help="Job spec as TOML.")],
                 no_local_check: NoLocalCheck = False) -> None:
    """Check a job file offline, as `job submit` would, and print its spec with every default filled in, as JSON.

    Packs and hashes its code and dataset and checks its params against the code's schema; a problem is printed
    instead, and the exit code is 1."""
    print_json(job_of(file, {}, [], not no_local_check).spec.model_dump(mode="json"))
