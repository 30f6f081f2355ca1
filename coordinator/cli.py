"""The coordinator's command groups: `gpuswarm coordinator ...`, `gpuswarm job ...` and `gpuswarm nodes`.

`coordinator serve` runs the service; the job and node commands are clients of its HTTP API. Every listing
prints a table by default and machine-readable JSON with --json.
"""

from __future__ import annotations

import json
import logging
import sys
import time
import tomllib
from pathlib import Path
from typing import Annotated, Any

import typer
from gpuswarm.coordinator.client import DEFAULT_URL, ApiClientError, CoordinatorClient
from gpuswarm.proto import logs
from gpuswarm.proto.logs import LogFormat, LogLevel
from gpuswarm.proto.models import JobSpec
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

# Piped output (scripts, CI logs) is not cut to 80 columns; a terminal keeps its own width.
console = Console(width=None if sys.stdout.isatty() else 160)
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


@job_app.command("list")
def job_list(
    state: Annotated[str | None, typer.Option(help="Only jobs in this state.")] = None,
    coordinator: CoordinatorURL = DEFAULT_URL,
    token: OwnerToken = None,
    as_json: JsonFlag = False,
) -> None:
    """List your jobs, newest first."""
    jobs = call(CoordinatorClient(coordinator, token=token).jobs, state)
    if as_json:
        return print_json(jobs)
    table = Table("ID", "NAME", "WORKLOAD", "STATE", "NODES", "EPOCH", "ACCURACY", "SUBMITTED")
    for j in jobs:
        table.add_row(j["id"], j["name"] or "-", j["spec"]["workload"], j["state"], str(j["active_nodes"]),
                      fmt(j["progress"]["epoch"], 2), fmt(j["final_accuracy"] or j["progress"]["accuracy"]),
                      ago(j["created_at"]))
    console.print(table if jobs else "no jobs")


@job_app.command("status")
def job_status(
    job_id: Annotated[str, typer.Argument(help="Job ID.")],
    coordinator: CoordinatorURL = DEFAULT_URL,
    token: OwnerToken = None,
    as_json: JsonFlag = False,
) -> None:
    """Show a job's state, progress, members, contributions, artifacts and recent events."""
    job = call(CoordinatorClient(coordinator, token=token).job, job_id)
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
    coordinator: CoordinatorURL = DEFAULT_URL,
    token: OwnerToken = None,
    as_json: JsonFlag = False,
) -> None:
    """Download a completed job's final model (checked against its SHA-256)."""
    client = CoordinatorClient(coordinator, token=token)
    job = call(client.job, job_id)
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


@nodes_app.callback()
def nodes(ctx: typer.Context, coordinator: CoordinatorURL = DEFAULT_URL, as_json: JsonFlag = False) -> None:
    """List registered nodes with their resources, state, mesh address and advert."""
    if ctx.invoked_subcommand is not None:
        return
    rows = call(CoordinatorClient(coordinator).nodes)
    if as_json:
        return print_json(rows)
    table = Table("NODE", "STATE", "ONLINE", "GPUS", "CPU/RAM", "PRICE", "REP", "VERIFIED", "MESH", "JOB",
                  "LAST SEEN", "ADVERT")
    for n in rows:
        gpus = ", ".join(f"{g['count']}x {g['model']} {g['memory_gb']:.0f}G" for g in n["resources"]["gpus"]) or "cpu"
        advert = n["advert"]
        advert_text = "-" if advert is None else f"{advert['state']}, {advert['expires_at'] - time.time():.0f}s left"
        table.add_row(n["id"], "revoked" if n["revoked"] else n["state"], "yes" if n["online"] else "no", gpus,
                      f"{n['resources']['cpu_cores']}c/{n['resources']['ram_gb']:.0f}G",
                      f"{n['price_per_gpu_hour']:.2f}", f"{n['reputation']:.2f}", "yes" if n["verified"] else "no",
                      n["mesh_address"] or "-", ",".join(n["job_ids"]) or "-",
                      ago(n["last_seen"]), advert_text)
    console.print(table if rows else "no nodes registered")


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
