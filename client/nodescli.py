"""The node listing for readers and the admin, `gpuswarm nodes [revoke|statement]`: clients of the coordinator's
API (client/api.py).

`nodes` lists every registered node, one line each, fitted to the terminal (--json: the API's list); `nodes
statement` is a node's public work log; `nodes revoke` is the admin's.
"""

from __future__ import annotations

import enum
import time
from pathlib import Path
from typing import Annotated

import typer
from gpuswarm.client.api import SyncClient
from gpuswarm.client.common import DEFAULT_URL, AdminToken, CoordinatorURL, DataDir, JsonFlag, admin, ago, call
from gpuswarm.proto.api import NodeInfo, dump
from rich.table import Table

from gpuswarm.console import Col, console, fit_table, print_json, print_listing

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


def node_state(n: NodeInfo) -> str:
    return "revoked" if n.revoked else n.state.value


def sort_nodes(rows: list[NodeInfo], by: NodeSort | None) -> list[NodeInfo]:
    keys = {NodeSort.PRICE: lambda n: n.price_per_gpu_hour, NodeSort.REPUTATION: lambda n: -n.reputation,
            NodeSort.LAST_SEEN: lambda n: -(n.last_seen or 0.0),
            NodeSort.STATE: lambda n: STATE_ORDER.index(node_state(n)) if node_state(n) in STATE_ORDER else 99}
    return rows if by is None else sorted(rows, key=lambda n: (keys[by](n), n.id))  # stable: registration order


def node_summary(rows: list[NodeInfo]) -> str:
    """'120 nodes: 100 online (3 training), 18 offline, 2 revoked; 4 verified'."""
    online = [n for n in rows if n.online and not n.revoked]
    training = sum(n.state == "training" for n in online)
    offline = sum(not n.online and not n.revoked for n in rows)
    revoked = sum(n.revoked for n in rows)
    return (f"{len(rows)} node{'s' if len(rows) != 1 else ''}: {len(online)} online ({training} training), "
            f"{offline} offline{f', {revoked} revoked' if revoked else ''}; "
            f"{sum(n.verified for n in rows)} verified")


def node_row(n: NodeInfo) -> list[str]:
    gpus = ", ".join(f"{g.count}x {g.model} {g.memory_gb:.0f}G" for g in n.resources.gpus) or "cpu"
    advert, jobs = n.advert, n.job_ids
    return [n.id, node_state(n), gpus, f"{n.resources.cpu_cores}c/{n.resources.ram_gb:.0f}G",
            f"{n.price_per_gpu_hour:.2f}", f"{n.reputation:.2f}", "yes" if n.verified else "no",
            (jobs[0] + (f" +{len(jobs) - 1}" if len(jobs) > 1 else "")) if jobs else "-", ago(n.last_seen),
            n.mesh_address or "-",
            "-" if advert is None else f"{advert.state.value}, {advert.expires_at - time.time():.0f}s left"]


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
    rows = call(SyncClient(coordinator).nodes)
    shown = sort_nodes(rows, sort)[:limit]
    if as_json:
        return print_json(dump(shown))
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
    result = call(SyncClient(coordinator, token=admin(admin_token, data_dir)).revoke_node, node_id)
    print_json(dump(result)) if as_json else console.print(f"node {node_id} revoked")


@nodes_app.command("statement")
def nodes_statement(node_id: str, coordinator: CoordinatorURL = DEFAULT_URL, as_json: JsonFlag = False) -> None:
    """What a node was credited and paid, job by job (public, like a work log)."""
    statement = call(SyncClient(coordinator).node_statement, node_id)
    if as_json:
        return print_json(dump(statement))
    console.print(f"[bold]node {node_id}[/bold]  balance: [bold]{statement.balance:.6f}[/bold] credits")
    table = Table("JOB", "CLAIMS", "SAMPLES CREDITED", "COMPUTE S", "FLAGGED", "EARNED")
    for j in statement.jobs:
        table.add_row(j.job_id, str(j.claims), str(j.samples), f"{j.compute_seconds:.1f}", str(j.flagged),
                      f"{j.earned:.6f}")
    console.print(table if statement.jobs else "no claims recorded")
