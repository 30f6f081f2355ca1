"""`gpuswarm dht ...`: an operator's read-only view of the swarm's hivemind DHT, from any machine that can reach a
bootstrap peer.

Owns the command group (`dht_app`), its options, the tables and JSON it prints, `watch`'s change detection, and
finding the bootstrap peers. With --coordinator it only reads the coordinator's public GET /v1/dht (the bootstrap
multiaddrs) and, for `ls`/`watch`, GET /v1/nodes (the job ids nodes are running), through the API client
(`gpuswarm.client.api.SyncClient`).
Talking to the DHT and decoding its records is `gpuswarm.dht.inspect`'s; this module never stores anything.

`gpuswarm.dht.inspect` brings hivemind and torch: it is imported inside the commands, under
`needs_extra("node")`, so `gpuswarm --help` loads neither and a base install says which extra it lacks. Ctrl-C is
taken before any subcommand runs (`gpuswarm.ctrl_c`, which says why).
"""

from __future__ import annotations

import contextlib
import json
import time
from typing import Annotated, Any

import typer
from gpuswarm.client.common import JsonFlag
from gpuswarm.proto.dht import NODES_KEY, job_run_id
from rich.markup import escape
from rich.table import Table

from gpuswarm import ctrl_c
from gpuswarm.console import console, err, fail, needs_extra, print_json

dht_app = typer.Typer(help="Inspect the swarm's DHT (read-only): peers, keys, records, adverts, progress.",
                      no_args_is_help=True)

DEFAULT_TIMEOUT = 15.0

InitialPeers = Annotated[list[str] | None, typer.Option(
    "--initial-peer", "-i", help="Multiaddr of a DHT peer to bootstrap from (repeatable); wins over --coordinator.")]
Coordinator = Annotated[str | None, typer.Option(
    "--coordinator", "-c", envvar="GPUSWARM_COORDINATOR",
    help="Coordinator base URL: its GET /v1/dht gives the bootstrap multiaddrs.")]
Timeout = Annotated[float, typer.Option(help="Seconds to wait for the DHT (start and each round of lookups).")]


@dht_app.callback()
def take_ctrl_c() -> None:
    """Before any subcommand (and its imports of hivemind and torch, whose own code may swallow a
    KeyboardInterrupt): Ctrl-C sets a flag from now on, and system calls it interrupts are restarted, since torch's
    shared-memory client hangs on EINTR."""
    ctrl_c.take_ctrl_c()


# ------------------------------------------------------------------------------------------------- bootstrap


def coordinator_api(coordinator: str, timeout: float):
    """The coordinator's API client, for its GET /v1/dht and GET /v1/nodes."""
    from gpuswarm.client.api import SyncClient

    return SyncClient(coordinator, timeout=timeout)


def resolve_initial_peers(initial_peers: list[str] | None, coordinator: str | None,
                          timeout: float) -> tuple[list[str], str | None]:
    """(the bootstrap multiaddrs, the coordinator's authority key that records are checked against: None without
    --coordinator)."""
    if not initial_peers and not coordinator:
        raise fail("give --initial-peer MULTIADDR or --coordinator URL (or set GPUSWARM_COORDINATOR)")
    if not coordinator:
        return initial_peers, None
    from gpuswarm.client.api import ApiError

    try:
        with coordinator_api(coordinator, timeout) as api:
            info = api.dht()
    except ApiError as e:
        raise fail(f"cannot get the DHT's bootstrap peers from {coordinator}: {e}") from None
    peers = initial_peers or info.initial_peers
    if not peers:
        raise fail(f"the coordinator at {coordinator} runs no DHT bootstrap peer")
    return peers, info.authority


def coordinator_job_ids(coordinator: str | None, timeout: float) -> list[str]:
    """Job ids the coordinator's public node list says are running (best effort: empty when it cannot tell)."""
    if not coordinator:
        return []
    from gpuswarm.client.api import ApiError

    try:
        with coordinator_api(coordinator, timeout) as api:
            return sorted({j for n in api.nodes() for j in n.job_ids})
    except ApiError:
        return []


@contextlib.contextmanager
def session(initial_peer: list[str] | None, coordinator: str | None, timeout: float):
    """Bootstrap, yield the DHT, shut it down; DHT trouble becomes a clear message and exit code 1."""
    from gpuswarm.dht.inspect import DHTUnreachable, open_dht  # the command imported it already

    peers, authority = resolve_initial_peers(initial_peer, coordinator, timeout)
    ctrl_c.interrupted()
    try:
        with open_dht(peers, timeout, authority) as dht:
            ctrl_c.interrupted()
            yield dht
    except DHTUnreachable as e:
        raise fail(f"cannot reach the DHT via {', '.join(peers)}: {e}") from None


# ------------------------------------------------------------------------------------------------- output


def expires_in(expiration: float | None) -> str:
    from hivemind.utils import get_dht_time  # loaded with gpuswarm.dht.inspect

    if expiration is None:
        return "-"
    left = expiration - get_dht_time()
    return "expired" if left < 0 else f"{left:.0f}s"


def short(value: Any, width: int = 70) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":")) if not isinstance(value, str) else value
    return text if len(text) <= width else text[: width - 1] + "…"


CHANGE_MARKS = {"added": "[green]+[/green]", "changed": "[yellow]~[/yellow]", "gone": "[red]-[/red]"}


def print_change(change: dict, as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps(change, sort_keys=True))
        return
    value = "" if change["change"] == "gone" else " " + short(change["value"], 70)
    console.print(f"{time.strftime('%H:%M:%S')} {CHANGE_MARKS[change['change']]} "
                  + escape(f"{change['key']}[{change['subkey']}] {change.get('signature', '')}{value}"))


def diff(before: dict[tuple[str, str], dict], after: dict[tuple[str, str], dict]) -> list[dict]:
    """What changed between two polls. A record re-declared with a later expiry but the same value is no change."""
    changes = []
    for (key, subkey), rec in after.items():
        old = before.get((key, subkey))
        if old is None or old["value"] != rec["value"]:
            changes.append({"change": "added" if old is None else "changed", "key": key, "subkey": subkey,
                            "signature": rec["signature"], "value": rec["value"], "expiration": rec["expiration"]})
    for key, subkey in before.keys() - after.keys():
        changes.append({"change": "gone", "key": key, "subkey": subkey})
    return changes


# ------------------------------------------------------------------------------------------------- commands


@dht_app.command("peers")
def peers_command(initial_peer: InitialPeers = None, coordinator: Coordinator = None,
                  timeout: Timeout = DEFAULT_TIMEOUT, as_json: JsonFlag = False) -> None:
    """The DHT peers we see, with their addresses and ping latency.

    Listed: the peers in our routing table after bootstrap (DHT servers near our id; in a swarm of more than ~20
    servers, a subset), each pinged once through the DHT (LATENCY: that ping's round trip), plus any other peer our
    p2p daemon is connected to (no latency). Client-mode peers (training processes in client mode, other CLIs)
    route nothing and are not listed."""
    with needs_extra("node"):
        from gpuswarm.dht.inspect import peers

    with session(initial_peer, coordinator, timeout) as dht:
        rows = peers(dht, timeout)
        own = str(dht.peer_id)
    if as_json:
        return print_json({"self": own, "peers": rows})
    table = Table("PEER ID", "ROUTING", "LATENCY", "ADDRESSES")
    for r in rows:
        latency = "-" if r["latency_ms"] is None else f"{r['latency_ms']:.1f} ms"
        table.add_row(r["peer_id"], "yes" if r["routing"] else "no", latency, "\n".join(r["addrs"]) or "-")
    console.print(table if rows else "no peers seen")


@dht_app.command("ls")
def ls_command(
    prefix: Annotated[str, typer.Argument(help="Key prefix: gpuswarm (everything known), gpuswarm.nodes, a job "
                                               "id (j-...) or run id (gpuswarm_j_...).")] = "gpuswarm",
    job: Annotated[list[str] | None, typer.Option("--job", help="Also look up this job's run keys (repeatable).")]
    = None,
    initial_peer: InitialPeers = None, coordinator: Coordinator = None, timeout: Timeout = DEFAULT_TIMEOUT,
    as_json: JsonFlag = False,
) -> None:
    """Known keys under PREFIX, with their subkeys and expiry.

    A DHT cannot list its keys, so this looks up every key name that can be known and shows those found:
    gpuswarm.nodes, and for each run named by PREFIX, --job, or the coordinator's node list (with --coordinator):
    <run>_progress, <run>.members, <run>_{grad,state}_averager.0b (matchmaking) and
    <run>_{grad,state}_averager.all_averagers (state download). Records the local peer holds under keys it has
    no name for are listed by key hash (for this client-mode peer, normally none). Keys whose names nobody knows
    cannot be found."""
    with needs_extra("node"):
        from gpuswarm.dht.inspect import candidate_keys, fetch, key_hash, local_records

    names = candidate_keys(prefix, (job or []) + coordinator_job_ids(coordinator, timeout))
    with session(initial_peer, coordinator, timeout) as dht:
        found = fetch(dht, names, timeout) if names else {}
        local = local_records(dht, timeout)
    named = {key_hash(k) for k in names}
    unnamed = [r for r in local if r["key_id"] not in named]
    rows = [r for r in found.values() if r["found"] or "error" in r]
    if as_json:
        return print_json({"prefix": prefix, "looked_up": names, "keys": rows, "unnamed_local_records": unnamed})
    table = Table("KEY", "SUBKEYS", "EXPIRES IN", "SUBKEY", "SUBKEY EXPIRES IN", title=f"keys under {prefix!r}")
    for r in rows:
        if "error" in r:
            table.add_row(r["key"], "-", "-", f"[red]{r['error']}[/red]", "-")
            continue
        records = r["records"] or [{"subkey": "-", "expiration": None}]
        for i, rec in enumerate(records):
            table.add_row(r["key"] if i == 0 else "", str(len(r["records"])) if i == 0 else "",
                          expires_in(r["expiration"]) if i == 0 else "", rec["subkey"] or "(value)",
                          expires_in(rec["expiration"]))
    for r in unnamed:
        table.add_row(f"#{r['key_id'][:16]} ({r['where']})", str(r["subkeys"] or "-"), expires_in(r["expiration"]),
                      "", "")
    console.print(table if rows or unnamed else f"no keys found under {prefix!r} (looked up: {', '.join(names)})")
    err.print(f"[dim]looked up {len(names)} known key name(s); a DHT cannot list keys it has no name for[/dim]")


@dht_app.command("get")
def get_command(key: Annotated[str, typer.Argument(help="The key, e.g. gpuswarm.nodes or gpuswarm_j_..._progress.")],
                initial_peer: InitialPeers = None, coordinator: Coordinator = None,
                timeout: Timeout = DEFAULT_TIMEOUT, as_json: JsonFlag = False) -> None:
    """A record, decoded (msgpack -> JSON), with each subkey's signature status.

    WRITER: the node whose proof the record carries, checked against the coordinator's key (with --coordinator):
    "UNREGISTERED" and why for a record no honest peer accepts (gpuswarm.proto.dht says what a proof is).
    SIGNATURE: "ed25519-verified": a node advert's signed envelope (proto.dht.decode_advert); "rsa-verified": a
    record whose key or subkey names an RSA owner (hivemind's progress records), checked on the raw record by
    hivemind's RSASignatureValidator; "unsigned": anything else."""
    with needs_extra("node"):
        from gpuswarm.dht.inspect import fetch

    with session(initial_peer, coordinator, timeout) as dht:
        result = fetch(dht, [key], timeout)[key]
    if "error" in result:
        raise fail(f"{key}: {result['error']}")
    if as_json:
        return print_json(result)
    if not result["found"]:
        return console.print(f"no record under {key!r}")
    table = Table("SUBKEY", "WRITER", "SIGNATURE", "EXPIRES IN", "VALUE",
                  title=f"{key} (expires in {expires_in(result['expiration'])})")
    for rec in result["records"]:
        table.add_row(rec["subkey"] or "(value)", escape(rec["writer"]), rec["signature"],
                      expires_in(rec["expiration"]), escape(json.dumps(rec["value"], sort_keys=True)))
    console.print(table)


@dht_app.command("watch")
def watch_command(
    prefix: Annotated[str, typer.Argument(help="Key prefix, as for `dht ls`.")] = "gpuswarm",
    interval: Annotated[float, typer.Option(help="Seconds between polls.", min=0.5)] = 5.0,
    job: Annotated[list[str] | None, typer.Option("--job", help="Also watch this job's run keys (repeatable).")]
    = None,
    initial_peer: InitialPeers = None, coordinator: Coordinator = None, timeout: Timeout = DEFAULT_TIMEOUT,
    as_json: JsonFlag = False,
) -> None:
    """Print changes to the keys `dht ls PREFIX` would show, until Ctrl-C.

    Polls every --interval seconds; prints + new, ~ changed, - gone (a record re-declared with the same value is
    no change). With --json, one JSON object per change and line."""
    with needs_extra("node"):
        from gpuswarm.dht.inspect import DHTUnreachable, candidate_keys, fetch

    names = candidate_keys(prefix, (job or []) + coordinator_job_ids(coordinator, timeout))
    if not names:
        raise fail(f"no known key name starts with {prefix!r}")
    seen: dict[tuple[str, str], dict] = {}
    try:
        with session(initial_peer, coordinator, timeout) as dht:
            if not as_json:
                err.print(f"[dim]watching {len(names)} known key name(s) under {prefix!r} every {interval:g}s; "
                          "Ctrl-C ends[/dim]")
            while True:
                try:
                    results = fetch(dht, names, timeout)
                except DHTUnreachable as e:
                    err.print(f"[yellow]poll failed:[/yellow] {e}")
                    results = None
                if results is not None:
                    now = {(r["key"], rec["subkey"] or ""): rec for r in results.values() for rec in r["records"]}
                    for change in diff(seen, now):
                        print_change(change, as_json)
                    seen = now
                ctrl_c.interrupted(wait=interval)
    except KeyboardInterrupt:
        if not as_json:
            err.print("[dim]stopped[/dim]")


@dht_app.command("nodes")
def nodes_command(initial_peer: InitialPeers = None, coordinator: Coordinator = None,
                  timeout: Timeout = DEFAULT_TIMEOUT, as_json: JsonFlag = False) -> None:
    """The nodes' GPU adverts (gpuswarm.nodes), each checked against its node's Ed25519 signature and, with
    --coordinator, against the coordinator's key: REGISTERED says "NO" (and why) for an advert whose node the
    coordinator never registered, or whose proof fails; no honest peer stores or returns such an advert."""
    with needs_extra("node"):
        from gpuswarm.dht.inspect import fetch

    with session(initial_peer, coordinator, timeout) as dht:
        result = fetch(dht, [NODES_KEY], timeout)[NODES_KEY]
    if "error" in result:
        raise fail(result["error"])
    rows = [dict(rec.get("advert") or {"node_id": rec["subkey"]}, signature=rec["signature"],
                 registered=rec["registered"], writer=rec["writer"], dht_expiration=rec["expiration"])
            for rec in result["records"]]
    if as_json:
        return print_json(rows)
    table = Table("NODE", "STATE", "GPUS", "CPU/RAM", "PRICE", "MADDRS", "EXPIRES IN", "SIGNATURE", "REGISTERED")
    for n in rows:
        res = n.get("resources")
        gpus = "-" if res is None else ", ".join(
            f"{g['count']}x {g['model']} {g['memory_gb']:.0f}G" for g in res["gpus"]) or "cpu"
        table.add_row(n["node_id"], n.get("state", "-"), gpus,
                      "-" if res is None else f"{res['cpu_cores']}c/{res['ram_gb']:.0f}G",
                      "-" if res is None else f"{n['price_per_gpu_hour']:.2f}", "\n".join(n.get("maddrs") or []) or "-",
                      expires_in(n["dht_expiration"]), n["signature"], registered_cell(n))
    console.print(table if rows else "no node adverts in the DHT")


def registered_cell(row: dict) -> str:
    if row["registered"] is None:
        return "? (give --coordinator)"
    return "yes" if row["registered"] else f"[red]NO[/red]: {escape(row['writer'].removeprefix('UNREGISTERED: '))}"


@dht_app.command("progress")
def progress_command(job_id: Annotated[str, typer.Argument(help="Job ID (j-...).")],
                     initial_peer: InitialPeers = None, coordinator: Coordinator = None,
                     timeout: Timeout = DEFAULT_TIMEOUT, as_json: JsonFlag = False) -> None:
    """A job's training progress as hivemind publishes it, one RSA-signed record per training peer.

    Reads <run id>_progress, the key hivemind's ProgressTracker keeps for the job's run (proto.dht.job_run_id)."""
    with needs_extra("node"):
        from gpuswarm.dht.inspect import fetch

    key = f"{job_run_id(job_id)}_progress"
    with session(initial_peer, coordinator, timeout) as dht:
        result = fetch(dht, [key], timeout)[key]
    if "error" in result:
        raise fail(result["error"])
    rows = []
    for rec in result["records"]:
        v = rec["value"] if isinstance(rec["value"], dict) else {}
        rows.append({"peer_id": v.get("peer_id"), "owner": rec["subkey"], "epoch": v.get("epoch"),
                     "samples_accumulated": v.get("samples_accumulated"),
                     "samples_per_second": v.get("samples_per_second"), "time": v.get("time"),
                     "client_mode": v.get("client_mode"), "expiration": rec["expiration"],
                     "signature": rec["signature"]})
    if as_json:
        return print_json({"job_id": job_id, "key": key, "peers": rows})
    table = Table("PEER", "EPOCH", "SAMPLES", "SAMPLES/S", "REPORTED", "CLIENT", "EXPIRES IN", "SIGNATURE",
                  title=key)
    for r in rows:
        sps = "-" if r["samples_per_second"] is None else f"{r['samples_per_second']:.1f}"
        reported = "-" if r["time"] is None else time.strftime("%H:%M:%S", time.localtime(r["time"]))
        table.add_row(str(r["peer_id"]), str(r["epoch"]), str(r["samples_accumulated"]), sps, reported,
                      "yes" if r["client_mode"] else "no", expires_in(r["expiration"]), r["signature"])
    console.print(table if rows else f"no progress records under {key}")
