"""The coordinator's command groups: `gpuswarm coordinator ...`, `gpuswarm job ...` and `gpuswarm nodes`.

`coordinator serve` runs the service; the job and node commands are clients of its HTTP API. Every listing
prints a table by default and machine-readable JSON with --json.
"""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import os
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer
from gpuswarm.coordinator.client import DEFAULT_URL, ApiClientError, CoordinatorClient
from gpuswarm.proto import logs
from gpuswarm.proto.logs import LogFormat, LogLevel
from gpuswarm.proto.models import JobSpec, JobState
from pydantic import ValidationError
from rich.cells import cell_len
from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

# Piped output (scripts, CI logs) is not cut to 80 columns; a terminal keeps its own width, and COLUMNS wins.
console = Console(width=None if sys.stdout.isatty() or os.environ.get("COLUMNS", "").isdigit() else 160)
err = Console(stderr=True)

coordinator_app = typer.Typer(help="Run the coordinator service.", no_args_is_help=True)
job_app = typer.Typer(help="Submit, watch, cancel and download training jobs.", no_args_is_help=True)

CoordinatorURL = Annotated[str, typer.Option("--coordinator", "-c", envvar="GPUSWARM_COORDINATOR",
                                             help="Coordinator base URL.")]
JsonFlag = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]
OwnerToken = Annotated[str | None, typer.Option("--token", envvar="GPUSWARM_TOKEN",
                                                help="Your API token (gso_...), from `coordinator create-owner`.")]
AdminToken = Annotated[str | None, typer.Option("--admin-token", envvar="GPUSWARM_ADMIN_TOKEN",
                                                help="Admin token (default: read from --data-dir).")]
DataDir = Annotated[Path, typer.Option(help="Coordinator data dir (database, admin.token).")]


def fail(message: str, code: int = 1) -> typer.Exit:
    err.print(f"[red]error:[/red] {message}")
    return typer.Exit(code)


def call(fn, *args):
    try:
        return fn(*args)
    except ApiClientError as e:
        raise fail(str(e)) from None


def print_json(value: Any) -> None:
    typer.echo(json.dumps(value, indent=2, sort_keys=True))


def ago(t: float | None) -> str:
    if not t:
        return "-"
    seconds = max(0.0, time.time() - t)
    return f"{seconds:.0f}s ago" if seconds < 120 else f"{seconds / 60:.0f}m ago" if seconds < 7200 else \
        f"{seconds / 3600:.0f}h ago"


def fmt(value: float | None, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


@dataclass(frozen=True)
class Col:
    """A column of a listing that keeps every row on one line, however many rows there are.

    Values longer than `max` end in an ellipsis. When the terminal is too narrow, the columns with the most room
    shrink toward `min` (an ID column: min == max, whole or not at all); if that is not enough, columns are left
    out, the highest `drop` first (0: never)."""

    header: str
    min: int
    max: int
    drop: int = 0
    justify: str = "left"


COLUMN_GAP = 2  # padding (0, 1) without edges: one space on each side of the line between two columns


def fit_table(columns: list[Col], rows: list[list[str]], width: int) -> tuple[Table, list[str]]:
    """A borderless table of `rows` no wider than `width`, and the headers of the columns left out to fit."""
    natural = [min(c.max, max(cell_len(v) for v in [c.header, *(r[i] for r in rows)])) for i, c in enumerate(columns)]
    floor = [min(n, c.min) for n, c in zip(natural, columns, strict=True)]
    keep = list(range(len(columns)))
    while True:
        widths = {i: natural[i] for i in keep}
        excess = sum(widths.values()) + COLUMN_GAP * (len(keep) - 1) - width
        while excess > 0:
            roomy = max(keep, key=lambda i: widths[i] - floor[i])
            if widths[roomy] <= floor[roomy]:
                break
            widths[roomy] -= 1
            excess -= 1
        droppable = [i for i in keep if columns[i].drop]
        if excess <= 0 or not droppable:
            break
        keep.remove(max(droppable, key=lambda i: columns[i].drop))
    table = Table(box=None, padding=(0, 1), pad_edge=False, show_edge=False, header_style="bold")
    for i in keep:
        table.add_column(columns[i].header, width=widths[i], no_wrap=True, overflow="ellipsis",
                         justify=columns[i].justify)
    for row in rows:
        table.add_row(*(Text(row[i]) for i in keep))  # Text: a name with [brackets] is not markup
    return table, [c.header for i, c in enumerate(columns) if i not in keep]


def print_listing(table: Table, hidden: list[str], summary: str) -> None:
    console.print(table)
    console.print(Text(summary))
    if hidden:
        console.print(Text(f"hidden to fit {console.width} columns: {', '.join(hidden)} (a wider terminal or "
                           f"--json shows them)"), style="dim")


def counted(counts: dict[str, int], order: list[str]) -> str:
    return ", ".join(f"{counts[k]} {k}" for k in order if counts.get(k))


# ---------------------------------------------------------------------------------------------------- coordinator


@coordinator_app.command("serve")
def serve(
    host: Annotated[str, typer.Option(help="HTTP listen address.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="HTTP port.")] = 8470,
    data_dir: Annotated[Path, typer.Option(help="Database (SQLite) and artifact store.")] = Path("var/coordinator"),
    database_url: Annotated[str | None, typer.Option(envvar="DATABASE_URL",
                                                     help="SQLAlchemy async URL (default: SQLite).")] = None,
    dht_host: Annotated[str, typer.Option(help="Address the DHT bootstrap peer binds and announces.")] = "127.0.0.1",
    dht_port: Annotated[int, typer.Option(help="DHT bootstrap peer TCP port (0: any free port).")] = 0,
    node_timeout: Annotated[float, typer.Option(help="Seconds without heartbeat before a node is lost.")] = 10.0,
    mesh_cidr: Annotated[str, typer.Option(help="Network the nodes' mesh addresses come from.")] = "10.77.0.0/16",
    settle_grace: Annotated[float, typer.Option(help="Seconds after a job ends before its books close: "
                                                     "unattested claims rejected, unspent budget refunded.")] = 30.0,
    log_level: LogLevel = "info",
    log_format: LogFormat = "text",
) -> None:
    """Serve the /v1 API, bootstrap the DHT, and match jobs to nodes until SIGTERM or Ctrl-C."""
    from aiohttp import web
    from gpuswarm.coordinator.app import create_app
    from gpuswarm.coordinator.config import CoordinatorConfig

    logs.configure(log_level, log_format, "coordinator")
    config = CoordinatorConfig(data_dir=data_dir, database_url=database_url, dht_host=dht_host, dht_port=dht_port,
                               node_timeout=node_timeout, mesh_cidr=mesh_cidr, settle_grace=settle_grace)
    try:
        app = create_app(config)
    except ValueError as e:  # IPAMError for a bad --mesh-cidr
        raise fail(str(e)) from None
    # Per-request access lines only at debug level: three nodes heart-beating every 2 s would drown the log.
    web.run_app(app, host=host, port=port, print=lambda _: logging.getLogger(__name__).info(
        "coordinator serving on http://%s:%d (data in %s)", host, port, data_dir), shutdown_timeout=5,
        access_log=logging.getLogger("aiohttp.access") if log_level.lower() == "debug" else None)


@coordinator_app.command("migrate")
def migrate(
    data_dir: Annotated[Path, typer.Option(help="Data dir holding the SQLite database.")] = Path("var/coordinator"),
    database_url: Annotated[str | None, typer.Option(envvar="DATABASE_URL",
                                                     help="SQLAlchemy async URL (default: SQLite).")] = None,
) -> None:
    """Upgrade the database to the current schema (`serve` does this too at start) and print its revision."""
    import asyncio

    from alembic.util import CommandError
    from gpuswarm.coordinator import migrate as migrations
    from gpuswarm.coordinator.config import CoordinatorConfig
    from sqlalchemy import make_url
    from sqlalchemy.exc import ArgumentError, SQLAlchemyError

    config = CoordinatorConfig(data_dir=data_dir, database_url=database_url)
    try:
        shown = make_url(config.db_url).render_as_string(hide_password=True)
    except ArgumentError as e:
        raise fail(f"invalid database URL: {e}") from None
    if database_url is None:
        data_dir.mkdir(parents=True, exist_ok=True)
    try:
        before, after = asyncio.run(migrations.upgrade(config.db_url))
    except (SQLAlchemyError, CommandError, OSError, ImportError) as e:  # CommandError: a revision we don't know
        raise fail(f"cannot migrate {shown}: {e}") from None
    console.print(f"database: {shown}")
    console.print(f"revision before: {before or 'none (empty database)'}")
    console.print(f"revision after:  {after}{' (unchanged)' if before == after else ''}")


# ---------------------------------------------------------------------------------------------------- jobs


def build_spec(file: Path | None, overrides: dict[str, Any], params: list[str]) -> JobSpec:
    spec: dict[str, Any] = {}
    if file is not None:
        try:
            spec = tomllib.loads(file.read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise fail(f"cannot read job file {file}: {e}") from None
    for key, value in overrides.items():
        if value is None:
            continue
        section, _, field = key.partition(".")
        if field:
            spec.setdefault(section, {})[field] = value
        else:
            spec[key] = value
    for item in params:
        name, sep, raw = item.partition("=")
        if not sep:
            raise fail(f"--param takes NAME=VALUE, got {item!r}")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        spec.setdefault("hyperparameters", {})[name.strip()] = value
    try:
        return JobSpec.model_validate(spec)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, x['loc'])) or 'spec'}: {x['msg']}" for x in e.errors())
        raise fail(f"invalid job spec: {problems}") from None


@job_app.command("submit")
def job_submit(
    file: Annotated[Path | None, typer.Argument(help="Job spec as TOML (flags override its values).")] = None,
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
    spec = build_spec(file, {"workload": workload, "name": name, "stop.target_accuracy": target_accuracy,
                             "stop.max_epochs": max_epochs, "min_nodes": min_nodes, "max_nodes": max_nodes,
                             "max_price_per_gpu_hour": max_price, "budget": budget, "gpus_per_node": gpus_per_node,
                             "requirements.verified_only": verified_only}, param or [])
    job = call(CoordinatorClient(coordinator, token=token).submit_job, spec.model_dump(mode="json"))
    if as_json:
        print_json(job)
    else:
        console.print(f"submitted [bold]{job['id']}[/bold] ({spec.workload}, {spec.min_nodes}-{spec.max_nodes} "
                      f"nodes); follow it with: gpuswarm job status {job['id']}")


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
    jobs = call(CoordinatorClient(coordinator, token=token).jobs, state)
    shown = jobs[:limit]
    if as_json:
        return print_json(shown)
    if not jobs:
        return console.print("no jobs")
    rows = [[j["id"], j["name"] or "-", j["spec"]["workload"], j["state"], str(j["active_nodes"]),
             fmt(j["progress"]["epoch"], 2), fmt(j["final_accuracy"] or j["progress"]["accuracy"]),
             ago(j["created_at"])] for j in shown]
    counts: dict[str, int] = {}
    for j in jobs:
        counts[j["state"]] = counts.get(j["state"], 0) + 1
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
    client = CoordinatorClient(coordinator, token=token, timeout=10.0 if timeout is None else min(10.0, timeout + 0.5))
    if follow:
        raise typer.Exit(follow_job(client, job_id, interval, timeout, as_json))
    job = call(client.job, job_id)
    if as_json:
        return print_json(job)
    p = job["progress"]
    console.print(f"[bold]{job['id']}[/bold] {job['name']}  state: [bold]{job['state']}[/bold]  "
                  f"workload: {job['spec']['workload']}")
    console.print(f"epoch {p['epoch']:.2f}  step {p['global_step']}  accuracy {fmt(p['accuracy'])}  "
                  f"loss {fmt(p['loss'])}  {p['samples_per_second']:.0f} samples/s  peers {p['peers']}")
    if job["final_accuracy"] is not None:
        console.print(f"final test accuracy: [bold green]{job['final_accuracy']:.4f}[/bold green]")
    if job["error"]:
        console.print(f"[red]error:[/red] {job['error']}")
    print_contributions(job["contributions"])
    members = Table("NODE", "SHARD", "STATE", "SINCE", "REASON", title="Assignments")
    for a in job["assignments"]:
        members.add_row(a["node_id"], str(a["shard_index"]), a["state"], ago(a["created_at"]), a["reason"] or "")
    console.print(members)
    for a in job["artifacts"]:
        console.print(f"artifact {a['name']}: {a['size']} bytes, sha256 {a['sha256'][:16]}…"
                      f"{' (final)' if a['final'] else ''}")
    for e in job["events"][-8:]:
        console.print(f"  [dim]{time.strftime('%H:%M:%S', time.localtime(e['at']))}[/dim] {e['message']}")


# ---------------------------------------------------------------------------------------------------- job status -f

EXIT_UNREACHABLE = 3
FOLLOW_EVENTS = 5  # events already there when following starts that are shown; later ones all are


def clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))


def duration(seconds: float) -> str:
    seconds = int(max(0.0, seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m{rest % 60:02d}s" if hours else \
        f"{rest // 60}m{rest % 60:02d}s" if rest >= 60 else f"{rest}s"


def toward_stop(job: dict) -> tuple[float | None, str]:
    """How far the job is toward its stop rule, 0..1 (None: nothing to measure yet), and what that is measured by.

    Training stops at whichever rule is met first, so with both rules the nearer one counts."""
    stop, p = job["spec"].get("stop") or {}, job["progress"]
    fractions, parts = [], []
    if stop.get("max_epochs"):
        fractions.append(p["epoch"] / stop["max_epochs"])
        parts.append(f"epoch {p['epoch']:.2f}/{stop['max_epochs']}")
    if stop.get("target_accuracy"):
        if p["accuracy"] is not None:
            fractions.append(p["accuracy"] / stop["target_accuracy"])
        parts.append(f"accuracy {fmt(p['accuracy'])}/{stop['target_accuracy']}")
    fraction = 1.0 if job["state"] == JobState.COMPLETED else min(1.0, max(fractions)) if fractions else None
    return fraction, " or ".join(parts)


def follow_facts(job: dict) -> list[tuple[str, str]]:
    """The numbers a follower watches, as (label, value), in display order; elapsed time is left to the caller."""
    p = job["progress"]
    facts = [("step", str(p["global_step"]))]
    if job["contributions"]:  # peer-attested samples; the job itself keeps no sample count
        facts.append(("samples credited", str(sum(c["samples"] for c in job["contributions"]))))
    facts += [("samples/s", f"{p['samples_per_second']:.0f}"), ("accuracy", fmt(p["accuracy"])),
              ("loss", fmt(p["loss"])), ("peers", str(p["peers"])),
              ("nodes", str(sum(a["state"] == "active" for a in job["assignments"])))]
    return facts


def elapsed(job: dict) -> str:
    start = job["started_at"] or job["created_at"]
    return duration((job["finished_at"] or time.time()) - start)


def plain_progress(job: dict) -> str:
    """One line of progress for logs and pipes; the same job gives the same line (no clock in it)."""
    fraction, measure = toward_stop(job)
    percent = "" if fraction is None else f" {fraction:.0%}"
    facts = "  ".join(f"{label} {value}" for label, value in follow_facts(job))
    return f"{job['state']}{percent}  {measure}  {facts}"


class FollowView:
    """The live display of `job status --follow` on a terminal; re-rendered on each refresh so elapsed time ticks."""

    def __init__(self) -> None:
        self.job: dict | None = None
        self.warning: str | None = None

    def __rich__(self) -> Group:
        lines: list[Any] = []
        if self.job is not None:
            job = self.job
            fraction, measure = toward_stop(job)
            lines.append(Text.assemble((job["id"], "bold"), f" {job['name']}  ", ("state ", "dim"),
                                       (job["state"], "bold"), ("  workload ", "dim"), job["spec"]["workload"],
                                       ("  elapsed ", "dim"), elapsed(job)))
            bar = Table.grid(padding=(0, 1))
            bar.add_row(ProgressBar(total=None if fraction is None else 1.0, completed=fraction or 0.0, width=40),
                        Text("   " if fraction is None else f"{fraction:4.0%}"), Text(measure))
            lines.append(bar)
            facts = Text()
            for label, value in follow_facts(job):
                facts.append(f"{label} ", "dim").append(f"{value}  ")
            lines.append(facts)
        if self.warning:
            lines.append(Text(self.warning, "yellow"))
        return Group(*lines)


def follow_job(client: CoordinatorClient, job_id: str, interval: float, timeout: float | None,
               as_json: bool) -> int:
    """Poll the job until it ends and return the exit code; Ctrl-C stops following (130), not the job."""
    view = FollowView()
    live = console.is_terminal and not as_json
    try:
        with Live(view, console=console, refresh_per_second=4) if live else contextlib.nullcontext():
            job = poll_until_final(client, job_id, interval, timeout, as_json, view if live else None)
    except KeyboardInterrupt:
        err.print("stopped following; the job keeps running")
        return 130
    except StopFollowing as e:
        err.print(f"[red]error:[/red] {escape(str(e))}")
        return e.code
    if not as_json:
        typer.echo(f"job {job['id']} {job['state']}: final accuracy {fmt(job['final_accuracy'])}"
                   + (f"; error: {job['error']}" if job["error"] else ""))
    return 0 if job["state"] == JobState.COMPLETED else 1


class StopFollowing(Exception):
    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


def poll_until_final(client: CoordinatorClient, job_id: str, interval: float, timeout: float | None,
                     as_json: bool, view: FollowView | None) -> dict:
    """The follow loop: `view` is the live display, or None for plain lines. Returns the job in its final state.

    A coordinator that cannot be reached (or answers 5xx) is retried every `interval` with a warning, until
    `timeout` seconds of it; a 4xx (unknown job, bad token) ends at once, as retrying cannot help."""
    seen_events: set[tuple[float, str]] = set()
    last_line, down_since, first = None, None, True
    while True:
        try:
            job = client.job(job_id)
        except ApiClientError as e:
            if e.status is not None and e.status < 500:
                raise StopFollowing(1, str(e)) from None
            now = time.monotonic()
            if down_since is None:
                down_since = now
                if view is None:
                    err.print(f"[yellow]warning:[/yellow] {escape(str(e))}; retrying every {interval:g}s",
                              soft_wrap=True)
            if view is not None:
                view.warning = f"{e}; retrying every {interval:g}s (for {duration(now - down_since)})"
            if timeout is not None and now - down_since >= timeout:
                raise StopFollowing(EXIT_UNREACHABLE,
                                    f"gave up: the coordinator was unreachable for {timeout:g}s") from None
            time.sleep(interval)
            continue
        if down_since is not None:
            down_since = None
            if view is None:
                err.print("coordinator reachable again")
            else:
                view.warning = None
        new_events = [e for e in job["events"] if (e["at"], e["message"]) not in seen_events]
        if first:
            new_events, first = new_events[-FOLLOW_EVENTS:], False
        seen_events.update((e["at"], e["message"]) for e in job["events"])
        if as_json:
            typer.echo(json.dumps(job, sort_keys=True))
        elif view is not None:
            for e in new_events:  # printed above the live display, where they stay
                console.print(Text.assemble((clock(e["at"]), "dim"), f" {e['message']}"))
            view.job = job
        else:
            for e in new_events:
                typer.echo(f"{clock(e['at'])} event: {e['message']}")
            line = plain_progress(job)
            if line != last_line:
                typer.echo(f"{clock(time.time())} {line}  elapsed {elapsed(job)}")
                last_line = line
        if JobState(job["state"]).is_final:
            return job
        time.sleep(interval)


def print_contributions(rows: list[dict]) -> None:
    table = Table("NODE", "CLAIMS", "SAMPLES CLAIMED", "SAMPLES CREDITED", "COMPUTE S", "PAID", "PENDING", "FLAGGED",
                  title="Contributions (peer-attested)")
    for c in rows:
        table.add_row(c["node_id"], str(c["claims"]), str(c["claimed_samples"]), str(c["samples"]),
                      f"{c['compute_seconds']:.1f}", f"{c['paid']:.4f}", str(c["pending"]),
                      f"[red]{c['flagged']}[/red]" if c["flagged"] else "0")
    console.print(table if rows else "no contributions recorded yet")


@job_app.command("cancel")
def job_cancel(job_id: str, coordinator: CoordinatorURL = DEFAULT_URL, token: OwnerToken = None,
               as_json: JsonFlag = False) -> None:
    """Cancel a pending or running job; its nodes stop training within a heartbeat."""
    job = call(CoordinatorClient(coordinator, token=token).cancel_job, job_id)
    print_json(job) if as_json else console.print(f"{job['id']} cancelled")


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
    client = CoordinatorClient(coordinator, token=token)
    job = call(client.job, job_id)
    if tensorboard is not None:
        path, digest = call(client.download_tensorboard, job_id, tensorboard)
        size = path.stat().st_size
        if as_json:
            return print_json({"job_id": job_id, "path": str(path), "sha256": digest, "size": size,
                               "state": job["state"]})
        console.print(f"saved {path} ({size} bytes, progress of a {job['state']} job); view it with: "
                      f"tensorboard --logdir {tensorboard}")
        return
    final = [a for a in job["artifacts"] if a["final"]]
    if not final:
        raise fail(f"job {job_id} has no final model yet (state: {job['state']})")
    artifact = final[0]
    dest = output or Path(f"{job_id}-{artifact['name']}")
    digest = call(client.download_artifact, job_id, artifact["name"], dest)
    result = {"job_id": job_id, "path": str(dest), "sha256": digest, "size": artifact["size"],
              "accuracy": artifact["accuracy"]}
    if as_json:
        print_json(result)
    else:
        console.print(f"saved {dest} ({artifact['size']} bytes, reported test accuracy "
                      f"{fmt(artifact['accuracy'])}); check it with: gpuswarm node evaluate {dest}")


# ---------------------------------------------------------------------------------------------------- nodes


nodes_app = typer.Typer(help="List and manage nodes.", invoke_without_command=True)


class NodeSort(enum.StrEnum):
    PRICE = "price"  # cheapest first
    REPUTATION = "reputation"  # best first
    LAST_SEEN = "last-seen"  # most recently heard from first
    STATE = "state"  # training, idle, ... offline, revoked


# --sort state: busy and ready nodes first, gone ones last.
STATE_ORDER = ["training", "idle", "registering", "starting", "disconnected", "stopping", "offline", "revoked"]
NODE_COLUMNS = [Col("NODE", 16, 16), Col("STATE", 8, 12), Col("GPUS", 10, 28, drop=2), Col("CPU/RAM", 8, 10, drop=5),
                Col("PRICE", 9, 9, justify="right"), Col("REP", 4, 4, justify="right"), Col("VERIFIED", 8, 8, drop=3),
                Col("JOB", 17, 17, drop=4), Col("LAST SEEN", 9, 9), Col("MESH", 15, 15, drop=6),
                Col("ADVERT", 12, 24, drop=7)]


def node_state(n: dict) -> str:
    return "revoked" if n["revoked"] else n["state"]


def sort_nodes(rows: list[dict], by: NodeSort | None) -> list[dict]:
    keys = {NodeSort.PRICE: lambda n: n["price_per_gpu_hour"], NodeSort.REPUTATION: lambda n: -n["reputation"],
            NodeSort.LAST_SEEN: lambda n: -(n["last_seen"] or 0.0),
            NodeSort.STATE: lambda n: STATE_ORDER.index(node_state(n)) if node_state(n) in STATE_ORDER else 99}
    return rows if by is None else sorted(rows, key=lambda n: (keys[by](n), n["id"]))  # stable: registration order


def node_summary(rows: list[dict]) -> str:
    """'120 nodes: 100 online (3 training), 18 offline, 2 revoked; 4 verified'."""
    online = [n for n in rows if n["online"] and not n["revoked"]]
    training = sum(n["state"] == "training" for n in online)
    offline = sum(not n["online"] and not n["revoked"] for n in rows)
    revoked = sum(bool(n["revoked"]) for n in rows)
    return (f"{len(rows)} node{'s' if len(rows) != 1 else ''}: {len(online)} online ({training} training), "
            f"{offline} offline{f', {revoked} revoked' if revoked else ''}; "
            f"{sum(bool(n['verified']) for n in rows)} verified")


def node_row(n: dict) -> list[str]:
    gpus = ", ".join(f"{g['count']}x {g['model']} {g['memory_gb']:.0f}G" for g in n["resources"]["gpus"]) or "cpu"
    advert = n["advert"]
    jobs = n["job_ids"]
    return [n["id"], node_state(n), gpus, f"{n['resources']['cpu_cores']}c/{n['resources']['ram_gb']:.0f}G",
            f"{n['price_per_gpu_hour']:.2f}", f"{n['reputation']:.2f}", "yes" if n["verified"] else "no",
            (jobs[0] + (f" +{len(jobs) - 1}" if len(jobs) > 1 else "")) if jobs else "-", ago(n["last_seen"]),
            n["mesh_address"] or "-",
            "-" if advert is None else f"{advert['state']}, {advert['expires_at'] - time.time():.0f}s left"]


@nodes_app.callback()
def nodes(
    ctx: typer.Context,
    sort: Annotated[NodeSort | None, typer.Option(help="Order (default: registration): price (cheapest first), "
                                                  "reputation (best first), last-seen (latest first), state.")] = None,
    limit: Annotated[int | None, typer.Option(min=1, help="Only the first N nodes (after --sort).")] = None,
    coordinator: CoordinatorURL = DEFAULT_URL,
    as_json: JsonFlag = False,
) -> None:
    """List registered nodes, one line each: resources, state, price, reputation, job, mesh address and advert;
    then a count by state. Columns that do not fit the terminal are left out (--json has everything)."""
    if ctx.invoked_subcommand is not None:
        return
    rows = call(CoordinatorClient(coordinator).nodes)
    shown = sort_nodes(rows, sort)[:limit]
    if as_json:
        return print_json(shown)
    if not rows:
        return console.print("no nodes registered")
    summary = node_summary(rows) + (f"; showing {len(shown)}" if len(shown) < len(rows) else "")
    print_listing(*fit_table(NODE_COLUMNS, [node_row(n) for n in shown], console.width), summary)


@nodes_app.command("revoke")
def nodes_revoke(
    node_id: str,
    admin_token: AdminToken = None,
    data_dir: DataDir = Path("var/coordinator"),
    coordinator: CoordinatorURL = DEFAULT_URL,
    as_json: JsonFlag = False,
) -> None:
    """Revoke a node: every peer drops it from the mesh within seconds, and its later requests are refused."""
    result = call(CoordinatorClient(coordinator, token=admin(admin_token, data_dir)).revoke_node, node_id)
    print_json(result) if as_json else console.print(f"node {node_id} revoked")


@nodes_app.command("statement")
def nodes_statement(node_id: str, coordinator: CoordinatorURL = DEFAULT_URL, as_json: JsonFlag = False) -> None:
    """What a node was credited and paid, job by job (public, like a work log)."""
    statement = call(CoordinatorClient(coordinator).node_statement, node_id)
    if as_json:
        return print_json(statement)
    console.print(f"[bold]node {node_id}[/bold]  balance: [bold]{statement['balance']:.6f}[/bold] credits")
    table = Table("JOB", "CLAIMS", "SAMPLES CREDITED", "COMPUTE S", "FLAGGED", "EARNED")
    for j in statement["jobs"]:
        table.add_row(j["job_id"], str(j["claims"]), str(j["samples"]), f"{j['compute_seconds']:.1f}",
                      str(j["flagged"]), f"{j['earned']:.6f}")
    console.print(table if statement["jobs"] else "no claims recorded")


@job_app.command("statement")
def job_statement(job_id: str, coordinator: CoordinatorURL = DEFAULT_URL, token: OwnerToken = None,
                  as_json: JsonFlag = False) -> None:
    """The money side of a job: budget, escrow, what each node was credited and paid, and the refund."""
    s = call(CoordinatorClient(coordinator, token=token).job_statement, job_id)
    if as_json:
        return print_json(s)
    console.print(f"[bold]{s['job_id']}[/bold]  state: {s['state']}  budget {s['budget']:.6f}  reserved "
                  f"{s['reserved']:.6f}  paid {s['paid']:.6f}  refunded {s['refunded']:.6f}  in escrow "
                  f"{s['escrow']:.6f}  {'settled' if s['settled'] else 'not settled yet'}")
    print_contributions(s["nodes"])


# ---------------------------------------------------------------------------------------------------- accounts


def admin(token: str | None, data_dir: Path) -> str:
    """The admin token: given, or read from the coordinator's data dir."""
    if token:
        return token
    try:
        return (data_dir / "admin.token").read_text().strip()
    except OSError as e:
        raise fail(f"no --admin-token given and cannot read {data_dir / 'admin.token'}: {e.strerror}") from None


@coordinator_app.command("create-owner")
def create_owner_command(
    name: Annotated[str, typer.Argument(help="Account name (letters, digits, _ . @ -).")],
    credits: Annotated[float, typer.Option(help="Initial credits.")] = 0.0,
    data_dir: DataDir = Path("var/coordinator"),
    database_url: Annotated[str | None, typer.Option(envvar="DATABASE_URL",
                                                     help="SQLAlchemy async URL (default: SQLite).")] = None,
    as_json: JsonFlag = False,
) -> None:
    """Create a job owner's account in the coordinator's database and print its API token (shown only once)."""
    import asyncio

    from gpuswarm.coordinator import migrate
    from gpuswarm.coordinator.auth import create_owner
    from gpuswarm.coordinator.config import CoordinatorConfig
    from gpuswarm.coordinator.db import make_engine, sessionmaker
    from gpuswarm.coordinator.errors import ApiError
    from gpuswarm.proto.models import NewOwner

    try:
        NewOwner(name=name, credits=credits)
    except ValidationError as e:
        raise fail(f"invalid owner: {e.errors()[0]['msg']}") from None
    config = CoordinatorConfig(data_dir=data_dir, database_url=database_url)
    config.data_dir.mkdir(parents=True, exist_ok=True)

    async def run() -> tuple:
        engine = make_engine(config.db_url)
        try:
            await migrate.upgrade(engine)
            async with sessionmaker(engine).begin() as session:
                return await create_owner(session, name, credits, time.time())
        finally:
            await engine.dispose()

    try:
        owner, token = asyncio.run(run())
    except ApiError as e:
        raise fail(e.message) from None
    if as_json:
        return print_json({"id": owner.id, "name": owner.name, "token": token, "balance": credits})
    console.print(f"owner [bold]{owner.name}[/bold] ({owner.id}) with {credits} credits. API token (shown once; "
                  f"use --token or GPUSWARM_TOKEN):\n{token}")


@coordinator_app.command("credit")
def credit_command(
    owner_id: Annotated[str, typer.Argument(help="Owner ID (o-...).")],
    amount: Annotated[float, typer.Argument(help="Credits to grant; negative withdraws.")],
    memo: Annotated[str, typer.Option(help="Why, for the ledger.")] = "",
    admin_token: AdminToken = None,
    data_dir: DataDir = Path("var/coordinator"),
    coordinator: CoordinatorURL = DEFAULT_URL,
    as_json: JsonFlag = False,
) -> None:
    """Admin: adjust an owner's credits (recorded in the ledger)."""
    owner = call(CoordinatorClient(coordinator, token=admin(admin_token, data_dir)).adjust_credits, owner_id,
                 amount, memo)
    print_json(owner) if as_json else console.print(f"{owner['id']} balance: {owner['balance']:.6f}")
