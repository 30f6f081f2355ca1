"""`gpuswarm dht ...`: an operator's read-only view of the swarm's hivemind DHT, from any machine that can reach a
bootstrap peer.

Owns a short-lived client-mode DHT peer (it never becomes a routing peer and is shut down on exit), the decoding
of what the swarm keeps in the DHT (signed node adverts, hivemind's RSA-signed progress records, run members,
averager declarations), signature checks on the raw records, and the tables and JSON that show them. It never
stores anything in the DHT and never touches the coordinator: with --coordinator it only reads GET /v1/dht (the
bootstrap multiaddrs) and, for `ls`/`watch`, the public GET /v1/nodes (the job ids nodes are running).

A Kademlia DHT cannot list its keys (a key is stored under its hash, on the peers nearest that hash), so `ls` and
`watch` look up the key names that can be known: `gpuswarm.nodes`, and for each run the keys gpuswarm and
hivemind 1.1.12 derive from its run id (see `run_keys`).

Ctrl-C is taken by a handler that only sets a flag, checked at safe points in our own code (`interrupted`), and
system calls it interrupts are restarted. A KeyboardInterrupt raised anywhere else was seen to be lost (swallowed
while hivemind and torch were being imported) or to hang the process for good (while an MPFuture, one per call
into the DHT process, mapped shared memory through torch). A second Ctrl-C leaves at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

dht_app = typer.Typer(help="Inspect the swarm's DHT (read-only): peers, keys, records, adverts, progress.",
                      no_args_is_help=True)

DEFAULT_TIMEOUT = 15.0
OWNER_RE = re.compile(rb"\[owner:(.+?)\]")
# Suffixes hivemind 1.1.12 and gpuswarm append to a run id (hivemind.Optimizer, ProgressTracker, the averagers'
# GroupKeyManager and state-download declarations, gpuswarm.node.worker.wait_for_members).
RUN_SUFFIXES = ("_progress", ".members", "_grad_averager.0b", "_state_averager.0b", "_grad_averager.all_averagers",
                "_state_averager.all_averagers")

RUN_ID_RE = re.compile(r"gpuswarm_j_[A-Za-z0-9]+")  # job_run_id of a coordinator job id (j-<hex>)

InitialPeers = Annotated[list[str] | None, typer.Option(
    "--initial-peer", "-i", help="Multiaddr of a DHT peer to bootstrap from (repeatable); wins over --coordinator.")]
Coordinator = Annotated[str | None, typer.Option(
    "--coordinator", "-c", envvar="GPUSWARM_COORDINATOR",
    help="Coordinator base URL: its GET /v1/dht gives the bootstrap multiaddrs.")]
Timeout = Annotated[float, typer.Option(help="Seconds to wait for the DHT (start and each round of lookups).")]
JsonFlag = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]


class DHTUnreachable(RuntimeError):
    pass


# Piped output (scripts, CI logs) is not cut to 80 columns; a terminal keeps its own width.
console = Console(width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True)


def fail(message: str, code: int = 1) -> typer.Exit:
    err.print(f"[red]error:[/red] {escape(message)}")
    return typer.Exit(code)


def print_json(value: Any) -> None:
    typer.echo(json.dumps(value, indent=2, sort_keys=True))


def coordinator_get(coordinator: str, path: str, timeout: float) -> Any:
    """GET a public route of the coordinator's API (plain HTTP: the node package does not import the coordinator's
    client). Raises OSError or ValueError."""
    with urllib.request.urlopen(coordinator.rstrip("/") + path, timeout=timeout) as response:
        return json.loads(response.read())


# ------------------------------------------------------------------------------------------------- the DHT peer


def resolve_initial_peers(initial_peers: list[str] | None, coordinator: str | None, timeout: float) -> list[str]:
    if initial_peers:
        return initial_peers
    if not coordinator:
        raise fail("give --initial-peer MULTIADDR or --coordinator URL (or set GPUSWARM_COORDINATOR)")
    try:
        peers = coordinator_get(coordinator, "/v1/dht", timeout).get("initial_peers") or []
    except (OSError, ValueError, AttributeError) as e:
        raise fail(f"cannot get the DHT's bootstrap peers from {coordinator}: {e}") from None
    if not peers:
        raise fail(f"the coordinator at {coordinator} runs no DHT bootstrap peer")
    return peers


@contextlib.contextmanager
def open_dht(initial_peers: list[str], timeout: float):
    """A client-mode DHT peer that validates (and so can decode) adverts and RSA-signed records; always shut down."""
    from gpuswarm.proto.dht import NodeAdvertValidator, SwarmDHT
    from hivemind.dht.crypto import RSASignatureValidator

    try:
        dht = SwarmDHT(initial_peers=initial_peers, client_mode=True, start=False, wait_timeout=min(timeout, 5.0),
                           record_validators=[NodeAdvertValidator(), RSASignatureValidator()])
    except Exception as e:  # a malformed multiaddr
        raise DHTUnreachable(f"invalid --initial-peer: {e}") from None
    dht.run_in_background(await_ready=False)
    try:
        try:
            dht.wait_until_ready(timeout=timeout)
        except TimeoutError:
            raise DHTUnreachable(f"no DHT peer answered within {timeout:.0f}s") from None
        except Exception as e:  # p2pd: "failed to connect to bootstrap peers"; hivemind: "bootstrap failed"
            reason = re.sub(r"\d{4}/\d\d/\d\d \d\d:\d\d:\d\d ", "", str(e))  # p2pd's log timestamp
            raise DHTUnreachable(reason or type(e).__name__) from None
        yield dht
    finally:
        with contextlib.suppress(Exception):
            if dht.is_alive():
                dht.shutdown()
        if dht.is_alive():
            dht.terminate()


_INTERRUPTED = threading.Event()


def _on_sigint(_signum, _frame) -> None:
    if _INTERRUPTED.is_set():
        os._exit(130)  # the second Ctrl-C: the user does not want to wait for a clean shutdown
    _INTERRUPTED.set()


def interrupted(wait: float = 0.0) -> None:
    """Raise KeyboardInterrupt here, in our code, if Ctrl-C was pressed (waiting up to `wait` seconds for it)."""
    if _INTERRUPTED.wait(wait):
        raise KeyboardInterrupt


@dht_app.callback()
def take_ctrl_c() -> None:
    """Before any subcommand (and its imports of hivemind and torch, whose own code may swallow a
    KeyboardInterrupt): Ctrl-C sets a flag from now on, and system calls it interrupts are restarted, since torch's
    shared-memory client hangs on EINTR."""
    signal.signal(signal.SIGINT, _on_sigint)
    signal.siginterrupt(signal.SIGINT, False)


def run_in_dht(dht, coroutine_fn, timeout: float):
    """Run `coroutine_fn(dht, node)` in the DHT's process; a lookup that never answers gives up after `timeout`,
    and Ctrl-C stops waiting for it."""
    future = dht.run_coroutine(coroutine_fn, return_future=True)
    deadline = time.monotonic() + timeout + 2.0
    while True:
        interrupted()
        try:
            return future.result(timeout=min(0.2, max(0.0, deadline - time.monotonic())))
        except TimeoutError:
            if time.monotonic() >= deadline:
                raise DHTUnreachable(f"the DHT did not answer within {timeout:.0f}s") from None


@dataclass(frozen=True)
class _FetchRaw:
    """Look keys up and return the raw records (signatures still attached) from the node's cache. Runs in the DHT
    process: hivemind strips signatures from what `get` returns, so they are read from where the lookup left them."""

    keys: tuple[str, ...]
    timeout: float

    async def __call__(self, _dht, node) -> dict[str, Any]:
        from hivemind.dht.routing import DHTID
        from hivemind.dht.storage import DictionaryDHTValue

        async def one(key: str):
            try:
                found = await asyncio.wait_for(node.get(key, latest=True), self.timeout)
            except TimeoutError:
                return {"error": f"lookup timed out after {self.timeout:.0f}s"}
            if found is None:
                return None
            raw = node.protocol.cache.get(DHTID.generate(source=key)) or node.protocol.storage.get(
                DHTID.generate(source=key))
            out = {"expiration": found.expiration_time, "key_id": DHTID.generate(source=key).to_bytes()}
            if raw is not None and isinstance(raw.value, DictionaryDHTValue):
                out["subkeys"] = {subkey: (item.value, item.expiration_time) for subkey, item in raw.value.items()}
            elif raw is not None and isinstance(raw.value, bytes):
                out["value"] = raw.value
            else:  # not cached (should not happen): the decoded value, with no raw bytes to check a signature on
                out["decoded"] = {s: (i.value, i.expiration_time) for s, i in found.value.items()} \
                    if isinstance(found.value, dict) else found.value
            return out

        results = await asyncio.gather(*(one(k) for k in self.keys))
        return dict(zip(self.keys, results, strict=True))


async def _local_records(_dht, node) -> list[dict]:
    """Every record the local peer holds (storage and lookup cache), by key hash: names cannot be recovered."""
    from hivemind.dht.storage import DictionaryDHTValue

    out = []
    for where, timed in (("storage", node.protocol.storage), ("cache", node.protocol.cache)):
        for key_id, item in timed.items():
            subkeys = len(item.value) if isinstance(item.value, DictionaryDHTValue) else None
            out.append({"key_id": key_id.to_bytes().hex(), "where": where, "subkeys": subkeys,
                        "expiration": item.expiration_time})
    return out


@dataclass(frozen=True)
class _Peers:
    ping_timeout: float

    async def __call__(self, _dht, node) -> list[dict]:
        """The routing table's peers (each pinged once, timed) and any other peer the p2p daemon is connected to."""
        loop = asyncio.get_running_loop()
        table = dict(node.protocol.routing_table.peer_id_to_uid)

        async def ping(peer_id):
            started = loop.time()
            try:
                ok = await asyncio.wait_for(node.protocol.call_ping(peer_id, validate=False), self.ping_timeout)
            except TimeoutError:
                ok = None
            return None if ok is None else round((loop.time() - started) * 1000, 1)

        latencies = await asyncio.gather(*(ping(p) for p in table))
        addrs = {str(info.peer_id): [str(a) for a in info.addrs] for info in await node.p2p.list_peers()}
        rows = []
        for (peer_id, dht_id), latency in zip(table.items(), latencies, strict=True):
            rows.append({"peer_id": str(peer_id), "routing": True, "dht_id": dht_id.to_bytes().hex()[:16],
                         "latency_ms": latency, "addrs": addrs.pop(str(peer_id), [])})
        for peer_id, peer_addrs in addrs.items():
            rows.append({"peer_id": peer_id, "routing": False, "dht_id": None, "latency_ms": None,
                         "addrs": peer_addrs})
        return rows


# ------------------------------------------------------------------------------------------------- decoding


def jsonable(value: Any) -> Any:
    """msgpack -> JSON: bytes become text when they are printable UTF-8, else "hex:..."."""
    if isinstance(value, bytes):
        try:
            text = value.decode()
            if text.isprintable():
                return text
        except UnicodeDecodeError:
            pass
        return "hex:" + value.hex()
    if isinstance(value, dict):
        return {str(jsonable(k)): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, float) and value != value:
        return None
    return value


def show_subkey(key: str, subkey: Any) -> str:
    if isinstance(subkey, bytes):
        owner = OWNER_RE.search(subkey)
        if owner:  # the owner's RSA public key: shown as a short fingerprint
            import hashlib

            return "rsa-owner:" + hashlib.sha256(owner.group(1)).hexdigest()[:16]
        if "averager" in key:  # averagers declare themselves under their libp2p peer id
            from hivemind.p2p import PeerID

            return PeerID(subkey).to_base58()
    return str(jsonable(subkey))


def decode_record(key: str, key_id: bytes, subkey: Any, raw: bytes, expiration: float) -> dict:
    """One record: its value decoded, and how (whether) its signature checked out."""
    from gpuswarm.proto.dht import NODES_KEY, decode_advert
    from hivemind.dht.crypto import RSASignatureValidator
    from hivemind.dht.validation import DHTRecord
    from hivemind.utils import MSGPackSerializer

    subkey_bytes = MSGPackSerializer.dumps(subkey) if subkey is not None else b""
    signature = "unsigned"
    if OWNER_RE.search(key.encode()) or (isinstance(subkey, bytes) and OWNER_RE.search(subkey)):
        validator = RSASignatureValidator()
        record = DHTRecord(key_id, subkey_bytes, raw, expiration)
        signature = "rsa-verified" if validator.validate(record) else "rsa-INVALID"
        raw = validator.strip_value(record)
    try:
        value = MSGPackSerializer.loads(raw)
    except Exception as e:
        return {"subkey": show_subkey(key, subkey), "expiration": expiration, "signature": signature,
                "value": None, "error": f"undecodable value: {e!r}"}
    row = {"subkey": show_subkey(key, subkey), "expiration": expiration, "signature": signature}
    if key == NODES_KEY:
        try:
            advert = decode_advert(value)
            signed_as = "ed25519-verified" if advert.node_id == subkey else "ed25519-verified, WRONG SUBKEY"
            row["signature"] = signed_as
            row["advert"] = advert.model_dump(mode="json")
        except Exception as e:
            row["signature"] = f"INVALID advert: {e}"
    if isinstance(value, dict) and isinstance(value.get("peer_id"), bytes):  # hivemind progress: a libp2p peer id
        from hivemind.p2p import PeerID

        value = dict(value, peer_id=PeerID(value["peer_id"]).to_base58())
    row["value"] = jsonable(value)
    return row


def decode_result(key: str, found: dict | None) -> dict:
    """A lookup's answer as JSON: found or not, the key's expiry, and its records (one per subkey)."""
    if found is None:
        return {"key": key, "found": False, "records": []}
    if "error" in found:
        return {"key": key, "found": False, "error": found["error"], "records": []}
    out = {"key": key, "found": True, "expiration": found["expiration"]}
    if "subkeys" in found:
        out["records"] = [decode_record(key, found["key_id"], s, raw, exp)
                          for s, (raw, exp) in sorted(found["subkeys"].items(), key=lambda kv: str(kv[0]))]
    elif "value" in found:
        out["records"] = [decode_record(key, found["key_id"], None, found["value"], found["expiration"])]
    else:
        decoded = found["decoded"]
        items = decoded.items() if isinstance(decoded, dict) else [(None, (decoded, found["expiration"]))]
        out["records"] = [{"subkey": None if s is None else show_subkey(key, s), "expiration": exp,
                           "signature": "not re-checked (no raw record)", "value": jsonable(v)}
                          for s, (v, exp) in items]
    return out


def fetch(dht, keys: list[str], timeout: float) -> dict[str, dict]:
    raw = run_in_dht(dht, _FetchRaw(tuple(keys), timeout), timeout)
    return {key: decode_result(key, raw.get(key)) for key in keys}


# ------------------------------------------------------------------------------------------------- key names


def run_keys(run_id: str) -> list[str]:
    """The DHT keys a run uses: hivemind's progress key, gpuswarm's members key, and the averagers' matchmaking and
    state-download keys (the matchmaking key is `<prefix>.0b` because hivemind.Optimizer starts averagers with
    empty group bits, which never change then)."""
    return [run_id + suffix for suffix in RUN_SUFFIXES]


def run_id_of(name: str) -> str | None:
    """The run id a name belongs to: a job id (j-...), a run id (gpuswarm_...), or one of a run's keys."""
    from gpuswarm.proto.dht import job_run_id

    if name.startswith("j-"):
        name = job_run_id(name)  # also a job id followed by part of a key: j-0123_grad
    if (run := RUN_ID_RE.match(name)) is not None:  # a run id, or one of its keys: the run id ends at a . or _
        return run.group(0)
    return None


def candidate_keys(prefix: str, job_ids: list[str]) -> list[str]:
    """Every key name `ls` can know of that starts with `prefix` (a job id stands for its run id)."""
    from gpuswarm.proto.dht import NODES_KEY, job_run_id

    runs = {job_run_id(j) for j in job_ids}
    if (own := run_id_of(prefix)) is not None:
        runs.add(own)
    wanted = job_run_id(prefix) if prefix.startswith("j-") else prefix
    names = [NODES_KEY] + [k for run in sorted(runs) for k in run_keys(run)]
    return [k for k in names if k.startswith(wanted)]


def coordinator_job_ids(coordinator: str | None, timeout: float) -> list[str]:
    """Job ids the coordinator's public node list says are running (best effort: empty when it cannot tell)."""
    if not coordinator:
        return []
    try:
        nodes = coordinator_get(coordinator, "/v1/nodes", timeout)["nodes"]
        return sorted({j for n in nodes for j in n.get("job_ids") or []})
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []


# ------------------------------------------------------------------------------------------------- output


def expires_in(expiration: float | None) -> str:
    from hivemind.utils import get_dht_time

    if expiration is None:
        return "-"
    left = expiration - get_dht_time()
    return "expired" if left < 0 else f"{left:.0f}s"


def short(value: Any, width: int = 70) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":")) if not isinstance(value, str) else value
    return text if len(text) <= width else text[: width - 1] + "…"


@contextlib.contextmanager
def session(initial_peer: list[str] | None, coordinator: str | None, timeout: float):
    """Bootstrap, yield the DHT, shut it down; DHT trouble becomes a clear message and exit code 1."""
    peers = resolve_initial_peers(initial_peer, coordinator, timeout)
    interrupted()
    try:
        with open_dht(peers, timeout) as dht:
            interrupted()
            yield dht
    except DHTUnreachable as e:
        raise fail(f"cannot reach the DHT via {', '.join(peers)}: {e}") from None


# ------------------------------------------------------------------------------------------------- commands


@dht_app.command("peers")
def peers_command(initial_peer: InitialPeers = None, coordinator: Coordinator = None,
                  timeout: Timeout = DEFAULT_TIMEOUT, as_json: JsonFlag = False) -> None:
    """The DHT peers we see, with their addresses and ping latency.

    Listed: the peers in our routing table after bootstrap (DHT servers near our id; in a swarm of more than ~20
    servers, a subset), each pinged once through the DHT (LATENCY: that ping's round trip), plus any other peer our
    p2p daemon is connected to (no latency). Client-mode peers (training processes in client mode, other CLIs)
    route nothing and are not listed."""
    with session(initial_peer, coordinator, timeout) as dht:
        rows = run_in_dht(dht, _Peers(min(timeout, 5.0)), timeout)
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
    names = candidate_keys(prefix, (job or []) + coordinator_job_ids(coordinator, timeout))
    with session(initial_peer, coordinator, timeout) as dht:
        found = fetch(dht, names, timeout) if names else {}
        local = run_in_dht(dht, _local_records, timeout)
    from hivemind.dht.routing import DHTID

    named = {DHTID.generate(source=k).to_bytes().hex() for k in names}
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

    "ed25519-verified": a node advert's signed envelope (proto.dht.decode_advert); "rsa-verified": a record whose
    subkey names an RSA owner (hivemind's progress records), checked on the raw record by hivemind's
    RSASignatureValidator; "unsigned": anything else."""
    with session(initial_peer, coordinator, timeout) as dht:
        result = fetch(dht, [key], timeout)[key]
    if "error" in result:
        raise fail(f"{key}: {result['error']}")
    if as_json:
        return print_json(result)
    if not result["found"]:
        return console.print(f"no record under {key!r}")
    table = Table("SUBKEY", "SIGNATURE", "EXPIRES IN", "VALUE",
                  title=f"{key} (expires in {expires_in(result['expiration'])})")
    for rec in result["records"]:
        table.add_row(rec["subkey"] or "(value)", rec["signature"], expires_in(rec["expiration"]),
                      escape(json.dumps(rec["value"], sort_keys=True)))
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
                interrupted(wait=interval)
    except KeyboardInterrupt:
        if not as_json:
            err.print("[dim]stopped[/dim]")


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


@dht_app.command("nodes")
def nodes_command(initial_peer: InitialPeers = None, coordinator: Coordinator = None,
                  timeout: Timeout = DEFAULT_TIMEOUT, as_json: JsonFlag = False) -> None:
    """The nodes' GPU adverts (gpuswarm.nodes), each checked against its node's Ed25519 signature."""
    from gpuswarm.proto.dht import NODES_KEY

    with session(initial_peer, coordinator, timeout) as dht:
        result = fetch(dht, [NODES_KEY], timeout)[NODES_KEY]
    if "error" in result:
        raise fail(result["error"])
    rows = [dict(rec.get("advert") or {"node_id": rec["subkey"]}, signature=rec["signature"],
                 dht_expiration=rec["expiration"]) for rec in result["records"]]
    if as_json:
        return print_json(rows)
    table = Table("NODE", "STATE", "GPUS", "CPU/RAM", "PRICE", "MADDRS", "EXPIRES IN", "SIGNATURE")
    for n in rows:
        res = n.get("resources")
        gpus = "-" if res is None else ", ".join(
            f"{g['count']}x {g['model']} {g['memory_gb']:.0f}G" for g in res["gpus"]) or "cpu"
        table.add_row(n["node_id"], n.get("state", "-"), gpus,
                      "-" if res is None else f"{res['cpu_cores']}c/{res['ram_gb']:.0f}G",
                      "-" if res is None else f"{n['price_per_gpu_hour']:.2f}", "\n".join(n.get("maddrs") or []) or "-",
                      expires_in(n["dht_expiration"]), n["signature"])
    console.print(table if rows else "no node adverts in the DHT")


@dht_app.command("progress")
def progress_command(job_id: Annotated[str, typer.Argument(help="Job ID (j-...).")],
                     initial_peer: InitialPeers = None, coordinator: Coordinator = None,
                     timeout: Timeout = DEFAULT_TIMEOUT, as_json: JsonFlag = False) -> None:
    """A job's training progress as hivemind publishes it, one RSA-signed record per training peer.

    Reads <run id>_progress, the key hivemind's ProgressTracker keeps for the job's run (proto.dht.job_run_id)."""
    from gpuswarm.proto.dht import job_run_id

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
