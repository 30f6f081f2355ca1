"""Reading the swarm's DHT as an operator: a short-lived client-mode peer, raw lookups, and decoding what they find.

Owns `open_dht` (a client-mode `SwarmDHT`: it never becomes a routing peer and is always shut down), the calls
`gpuswarm dht` runs inside the DHT's process (raw records, the local peer's records, the routing table's peers),
the decoding of what the swarm keeps in the DHT (signed node adverts, hivemind's RSA-signed progress records, run
members, averager declarations) with a signature check on each raw record, and the key names a run uses. It never
stores anything in the DHT. Presentation (tables, JSON, the coordinator) is `gpuswarm.dht.cli`'s.

A Kademlia DHT cannot list its keys (a key is stored under its hash, on the peers nearest that hash), so `ls` and
`watch` look up the key names that can be known: `gpuswarm.nodes`, and for each run the keys gpuswarm and
hivemind 1.1.12 derive from its run id (see `run_keys`).

Imports hivemind (and so torch) at import time: `gpuswarm.dht.cli` imports this module inside its commands only.
Every call into the DHT's process is waited for in short slices that check for Ctrl-C (`gpuswarm.ctrl_c`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import re
import time
from dataclasses import dataclass
from typing import Any

from gpuswarm.dht import hivemind_adapter
from gpuswarm.dht.swarm import SwarmDHT
from gpuswarm.dht.validators import check_record, validators
from gpuswarm.proto.dht import NODES_KEY, RUN_SUFFIXES, decode_advert, job_run_id, split_proof
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import PeerID

from gpuswarm.ctrl_c import interrupted

RUN_ID_RE = re.compile(r"gpuswarm_j_[A-Za-z0-9]+")  # job_run_id of a coordinator job id (j-<hex>)


class DHTUnreachable(RuntimeError):
    pass


# ------------------------------------------------------------------------------------------------- the DHT peer


@contextlib.contextmanager
def open_dht(initial_peers: list[str], timeout: float, authority: str | None = None):
    """A client-mode DHT peer, always shut down. Its validators accept every record (strict=False), so that what
    fails can be shown and marked: `decode_record` checks each one against `authority` (the coordinator's key, kept
    as `dht.authority`)."""
    try:
        dht = SwarmDHT(initial_peers=initial_peers, client_mode=True, start=False, wait_timeout=min(timeout, 5.0),
                       record_validators=validators(authority, strict=False))
    except Exception as e:  # a malformed multiaddr
        raise DHTUnreachable(f"invalid --initial-peer: {e}") from None
    dht.authority = authority
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
        async def one(key: str):
            try:
                found = await asyncio.wait_for(node.get(key, latest=True), self.timeout)
            except TimeoutError:
                return {"error": f"lookup timed out after {self.timeout:.0f}s"}
            if found is None:
                return None
            raw = hivemind_adapter.cached_record(node, key)
            out = {"expiration": found.expiration_time, "key_id": hivemind_adapter.key_id(key)}
            if raw is not None and raw.subkeys is not None:
                out["subkeys"] = raw.subkeys
            elif raw is not None:
                out["value"] = raw.value
            else:  # not cached (should not happen): the decoded value, with no raw bytes to check a signature on
                out["decoded"] = {s: (i.value, i.expiration_time) for s, i in found.value.items()} \
                    if isinstance(found.value, dict) else found.value
            return out

        results = await asyncio.gather(*(one(k) for k in self.keys))
        return dict(zip(self.keys, results, strict=True))


async def _local_records(_dht, node) -> list[dict]:
    return hivemind_adapter.local_records(node)


def local_records(dht, timeout: float) -> list[dict]:
    """Every record the local peer holds (storage and lookup cache), by key hash: names cannot be recovered."""
    return run_in_dht(dht, _local_records, timeout)


@dataclass(frozen=True)
class _Peers:
    ping_timeout: float

    async def __call__(self, _dht, node) -> list[dict]:
        loop = asyncio.get_running_loop()
        table = hivemind_adapter.routing_peers(node)

        async def ping(peer_id):
            started = loop.time()
            try:
                ok = await asyncio.wait_for(hivemind_adapter.ping(node, peer_id), self.ping_timeout)
            except TimeoutError:
                ok = False
            return round((loop.time() - started) * 1000, 1) if ok else None

        latencies = await asyncio.gather(*(ping(p) for p in table))
        addrs = {str(info.peer_id): [str(a) for a in info.addrs] for info in await node.p2p.list_peers()}
        rows = []
        for (peer_id, dht_id), latency in zip(table.items(), latencies, strict=True):
            rows.append({"peer_id": str(peer_id), "routing": True, "dht_id": dht_id.hex()[:16],
                         "latency_ms": latency, "addrs": addrs.pop(str(peer_id), [])})
        for peer_id, peer_addrs in addrs.items():
            rows.append({"peer_id": peer_id, "routing": False, "dht_id": None, "latency_ms": None,
                         "addrs": peer_addrs})
        return rows


def peers(dht, timeout: float) -> list[dict]:
    """The routing table's peers (each pinged once, timed) and any other peer the p2p daemon is connected to."""
    return run_in_dht(dht, _Peers(min(timeout, 5.0)), timeout)


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
        owner = hivemind_adapter.rsa_owner(subkey)
        if owner is not None:  # the owner's RSA public key: shown as a short fingerprint
            return "rsa-owner:" + hashlib.sha256(owner).hexdigest()[:16]
        if "averager" in key:  # averagers declare themselves under their libp2p peer id
            return PeerID(subkey).to_base58()
    return str(jsonable(subkey))


def writer_of(key_id: bytes, subkey: Any, raw: bytes, expiration: float, authority: str | None) -> dict:
    """Who wrote a record, by its proof (gpuswarm.proto.dht): a node the coordinator registered, or not."""
    if authority is None:
        return {"registered": None, "writer": "not checked (no coordinator key: give --coordinator)"}
    try:
        chain, _ = check_record(DHTRecord(key_id, hivemind_adapter.pack(subkey), raw, expiration), authority)
    except Exception as e:  # noqa: BLE001 - whatever fails, the record is not one this swarm's peers accept
        return {"registered": False, "writer": f"UNREGISTERED: {e}"}
    return {"registered": True, "writer": f"node {chain.cert.node_id}"}


def decode_record(key: str, key_id: bytes, subkey: Any, raw: bytes, expiration: float,
                  authority: str | None = None) -> dict:
    """One record: its value decoded, who wrote it (`writer_of`), and how its own signature checked out."""
    writer = writer_of(key_id, subkey, raw, expiration, authority)
    try:
        raw = split_proof(raw)[0]
    except ValueError:
        pass
    signature = "unsigned"
    if hivemind_adapter.rsa_owner(key.encode()) is not None or \
            (isinstance(subkey, bytes) and hivemind_adapter.rsa_owner(subkey) is not None):
        verified, raw = hivemind_adapter.check_rsa_record(key_id, subkey, raw, expiration)
        signature = "rsa-verified" if verified else "rsa-INVALID"
    try:
        value = hivemind_adapter.unpack(raw)
    except Exception as e:
        return {"subkey": show_subkey(key, subkey), "expiration": expiration, "signature": signature,
                **writer, "value": None, "error": f"undecodable value: {e!r}"}
    row = {"subkey": show_subkey(key, subkey), "expiration": expiration, "signature": signature, **writer}
    if key == NODES_KEY:
        try:
            advert = decode_advert(value)
            signed_as = "ed25519-verified" if advert.node_id == subkey else "ed25519-verified, WRONG SUBKEY"
            row["signature"] = signed_as
            row["advert"] = advert.model_dump(mode="json")
        except Exception as e:
            row["signature"] = f"INVALID advert: {e}"
    if isinstance(value, dict) and isinstance(value.get("peer_id"), bytes):  # hivemind progress: a libp2p peer id
        value = dict(value, peer_id=PeerID(value["peer_id"]).to_base58())
    row["value"] = jsonable(value)
    return row


def decode_result(key: str, found: dict | None, authority: str | None = None) -> dict:
    """A lookup's answer as JSON: found or not, the key's expiry, and its records (one per subkey)."""
    if found is None:
        return {"key": key, "found": False, "records": []}
    if "error" in found:
        return {"key": key, "found": False, "error": found["error"], "records": []}
    out = {"key": key, "found": True, "expiration": found["expiration"]}
    if "subkeys" in found:
        out["records"] = [decode_record(key, found["key_id"], s, raw, exp, authority)
                          for s, (raw, exp) in sorted(found["subkeys"].items(), key=lambda kv: str(kv[0]))]
    elif "value" in found:
        out["records"] = [decode_record(key, found["key_id"], None, found["value"], found["expiration"], authority)]
    else:
        decoded = found["decoded"]
        items = decoded.items() if isinstance(decoded, dict) else [(None, (decoded, found["expiration"]))]
        out["records"] = [{"subkey": None if s is None else show_subkey(key, s), "expiration": exp,
                           "signature": "not re-checked (no raw record)", "value": jsonable(v)}
                          for s, (v, exp) in items]
    return out


def fetch(dht, keys: list[str], timeout: float) -> dict[str, dict]:
    """Look `keys` up and decode what was found: {key: decode_result(...)}."""
    raw = run_in_dht(dht, _FetchRaw(tuple(keys), timeout), timeout)
    return {key: decode_result(key, raw.get(key), getattr(dht, "authority", None)) for key in keys}


# ------------------------------------------------------------------------------------------------- key names


def run_keys(run_id: str) -> list[str]:
    """The DHT keys a run uses: hivemind's progress key, gpuswarm's members key, and the averagers' matchmaking and
    state-download keys (`hivemind_adapter.HIVEMIND_RUN_KEY_SUFFIXES` says why those)."""
    return [run_id + suffix for suffix in RUN_SUFFIXES]


def run_id_of(name: str) -> str | None:
    """The run id a name belongs to: a job id (j-...), a run id (gpuswarm_...), or one of a run's keys."""
    if name.startswith("j-"):
        name = job_run_id(name)  # also a job id followed by part of a key: j-0123_grad
    if (run := RUN_ID_RE.match(name)) is not None:  # a run id, or one of its keys: the run id ends at a . or _
        return run.group(0)
    return None


def candidate_keys(prefix: str, job_ids: list[str]) -> list[str]:
    """Every key name `ls` can know of that starts with `prefix` (a job id stands for its run id)."""
    runs = {job_run_id(j) for j in job_ids}
    if (own := run_id_of(prefix)) is not None:
        runs.add(own)
    wanted = job_run_id(prefix) if prefix.startswith("j-") else prefix
    names = [NODES_KEY] + [k for run in sorted(runs) for k in run_keys(run)]
    return [k for k in names if k.startswith(wanted)]


def key_hash(key: str) -> str:
    """A key's DHT id in hex, as `local_records` names the records it holds."""
    return hivemind_adapter.key_id(key).hex()
