"""The coordinator operator's command group, `gpuswarm coordinator serve|migrate|create-owner|credit`.

`serve`, `migrate` and `create-owner` work on the service and its database, and need the gpuswarm[coordinator]
install (their imports are inside them); `credit` is a client of the running service's admin API. The job owner's
commands are client/jobcli.py's, the node listing client/nodescli.py's.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import time
from pathlib import Path
from typing import Annotated

import typer
from gpuswarm.client.api import SyncClient
from gpuswarm.client.common import DEFAULT_URL, AdminToken, CoordinatorURL, DataDir, JsonFlag, admin, call
from gpuswarm.proto import logs
from gpuswarm.proto.api import dump
from gpuswarm.proto.logs import LogFormat, LogLevel

from gpuswarm.console import console, fail, needs_extra, print_json

coordinator_app = typer.Typer(help="Run the coordinator service.", no_args_is_help=True)
EventLoop = enum.StrEnum("EventLoop", {name: name for name in ("auto", "uvloop", "asyncio")})


def new_event_loop(kind: EventLoop) -> asyncio.AbstractEventLoop:
    """The service's event loop: uvloop where installed ("auto"), measured to cost less CPU per request than the
    standard loop (docs/decisions/0019-heartbeats-at-scale.md); "asyncio" is the standard one."""
    if kind is not EventLoop.asyncio:
        try:
            import uvloop
        except ImportError:
            if kind is EventLoop.uvloop:
                raise fail("--event-loop uvloop: uvloop is not installed (pip install uvloop)") from None
        else:
            return uvloop.new_event_loop()
    return asyncio.new_event_loop()


@coordinator_app.command("serve")
def serve(
    host: Annotated[str, typer.Option(help="HTTP listen address.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="HTTP port.")] = 8470,
    data_dir: Annotated[Path, typer.Option(help="Database (SQLite) and blob store.")] = Path("var/coordinator"),
    database_url: Annotated[str | None, typer.Option(envvar="DATABASE_URL",
                                                     help="SQLAlchemy async URL (default: SQLite).")] = None,
    dht_host: Annotated[str, typer.Option(help="Address the DHT bootstrap peer binds and announces.")] = "127.0.0.1",
    dht_port: Annotated[int, typer.Option(help="DHT bootstrap peer TCP port (0: any free port).")] = 0,
    dht_initial_peer: Annotated[list[str] | None, typer.Option(
        help="Another coordinator's DHT multiaddr to join (repeatable): coordinators of one PostgreSQL database "
             "share one DHT.")] = None,
    blob_dir: Annotated[Path | None, typer.Option(
        help="Where the blob store keeps bytes (default DATA_DIR/blobs). Coordinators of one PostgreSQL database "
             "share it.")] = None,
    node_timeout: Annotated[float, typer.Option(help="Seconds without heartbeat before a node is lost.")] = 10.0,
    mesh_cidr: Annotated[str, typer.Option(help="Network the nodes' mesh addresses come from.")] = "10.77.0.0/16",
    settle_grace: Annotated[float, typer.Option(help="Seconds after a job ends before its books close: "
                                                     "unattested claims rejected, unspent budget refunded.")] = 30.0,
    audit_rate: Annotated[float, typer.Option(min=0, max=1, help="The share of credited rounds (jobs in mode diloco "
                                                                 "or fedavg) a third node re-computes.")] = 0.05,
    max_job_failures: Annotated[int, typer.Option(min=1, help="Node failures (a crash, the workload's error) after "
                                                             "which a job fails for good.")] = 3,
    owner_quota_gb: Annotated[float, typer.Option(min=0, help="Bytes (GiB) of code and data one job owner may hold "
                                                             "in the blob store.")] = 20.0,
    blob_retention: Annotated[float, typer.Option(min=0, help="Seconds a blob that no job or artifact references is "
                                                             "kept after its last use.")] = 24 * 3600.0,
    signature_process: Annotated[bool | None, typer.Option(
        "--signature-process/--no-signature-process",
        help="Check nodes' signatures in a child process, on another core than the event loop's (default: where "
             "there are 2+ CPUs).")] = None,
    log_level: LogLevel = "info",
    log_format: LogFormat = "text",
    event_loop: Annotated[EventLoop, typer.Option(help="auto: uvloop where installed, else asyncio's own.")] = "auto",
) -> None:
    """Serve the /v1 API, bootstrap the DHT, and match jobs to nodes until SIGTERM or Ctrl-C."""
    with needs_extra("coordinator"):
        from aiohttp import web
        from gpuswarm.coordinator.app import create_app
        from gpuswarm.coordinator.config import CoordinatorConfig

    logs.configure(log_level, log_format, "coordinator")
    config = CoordinatorConfig(data_dir=data_dir, database_url=database_url, dht_host=dht_host, dht_port=dht_port,
                               node_timeout=node_timeout, mesh_cidr=mesh_cidr, settle_grace=settle_grace,
                               audit_rate=audit_rate, max_job_failures=max_job_failures,
                               owner_quota_bytes=int(owner_quota_gb * 1024**3), blob_retention=blob_retention,
                               dht_initial_peers=list(dht_initial_peer or []), blob_store_dir=blob_dir,
                               signature_process=(os.cpu_count() or 1) > 1 if signature_process is None
                               else signature_process)
    try:
        app = create_app(config)
    except ValueError as e:  # IPAMError for a bad --mesh-cidr
        raise fail(str(e)) from None
    # Per-request access lines only at debug level: three nodes heart-beating every 2 s would drown the log.
    web.run_app(app, host=host, port=port, print=lambda _: logging.getLogger(__name__).info(
        "coordinator serving on http://%s:%d (data in %s)", host, port, data_dir), shutdown_timeout=5,
        access_log=logging.getLogger("aiohttp.access") if log_level.lower() == "debug" else None,
        loop=new_event_loop(EventLoop(event_loop)))


@coordinator_app.command("migrate")
def migrate(
    data_dir: Annotated[Path, typer.Option(help="Data dir holding the SQLite database.")] = Path("var/coordinator"),
    database_url: Annotated[str | None, typer.Option(envvar="DATABASE_URL",
                                                     help="SQLAlchemy async URL (default: SQLite).")] = None,
) -> None:
    """Upgrade the database to the current schema (`serve` does this too at start) and print its revision."""
    import asyncio

    with needs_extra("coordinator"):
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

    from gpuswarm.proto.models import NewOwner
    from pydantic import ValidationError

    with needs_extra("coordinator"):
        from gpuswarm.coordinator import migrate
        from gpuswarm.coordinator.auth import create_owner
        from gpuswarm.coordinator.config import CoordinatorConfig
        from gpuswarm.coordinator.db import make_engine, sessionmaker
        from gpuswarm.coordinator.errors import ApiError

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
    owner = call(SyncClient(coordinator, token=admin(admin_token, data_dir)).adjust_credits, owner_id, amount, memo)
    print_json(dump(owner)) if as_json else console.print(f"{owner.id} balance: {owner.balance:.6f}")
