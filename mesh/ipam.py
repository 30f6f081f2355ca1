"""Mesh address management (IPAM): which mesh address each node's WireGuard public key gets. Pure; no I/O.

The state is plain JSON-able data that the caller (the coordinator) persists; every function that changes it takes
the state and `now` explicitly and returns a new state, leaving its argument untouched. Rules:

- The default network is 10.77.0.0/16: private (RFC 1918), 65,534 usable addresses, and away from the ranges
  home routers, Docker (172.17.0.0/16, 192.168.0.0/16 pools) and cloud VPCs (10.0.0.0/16, 10.1.0.0/16, ...) tend to
  use. Pass another CIDR to `new_state` where it clashes.
- An address is stable per public key: the preferred slot is derived from a hash of the key, so the same key gets
  the same address on any coordinator with the same CIDR; on a collision the next free slot is taken (linear
  probing, wrapping around).
- The network and broadcast addresses (first and last of the range) are never handed out.
- A released address is held back for a grace period (default 1 hour) before anyone else may get it, so that
  stale peers and DHT records that still name it age out first. The same key coming back within the grace
  period gets its old address back.
"""

from __future__ import annotations

import copy
import hashlib
import ipaddress
import math
from typing import Any

from gpuswarm.mesh.keys import decode_key, validate_key

DEFAULT_CIDR = "10.77.0.0/16"
DEFAULT_RELEASE_GRACE_S = 3600.0
STATE_VERSION = 1

IPState = dict[str, Any]


class IPAMError(ValueError):
    """Bad input or a malformed state."""


class PoolExhausted(IPAMError):
    """Every usable address is allocated or held back."""


def _network(cidr: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    try:
        net = ipaddress.ip_network(cidr, strict=True)
    except (ValueError, TypeError) as e:
        raise IPAMError(f"bad mesh CIDR {cidr!r}: {e}") from None
    if net.num_addresses < 4:
        raise IPAMError(f"mesh CIDR {cidr} is too small: it needs at least 2 usable addresses")
    return net


def _check_now(now: float) -> float:
    if not isinstance(now, int | float) or isinstance(now, bool) or not math.isfinite(now):
        raise IPAMError(f"now must be a finite number of seconds, not {now!r}")
    return float(now)


def new_state(cidr: str = DEFAULT_CIDR, release_grace_s: float = DEFAULT_RELEASE_GRACE_S) -> IPState:
    """An empty allocation table for `cidr`."""
    net = _network(cidr)
    if not isinstance(release_grace_s, int | float) or not math.isfinite(release_grace_s) or release_grace_s < 0:
        raise IPAMError(f"release_grace_s must be a finite number >= 0, not {release_grace_s!r}")
    return {
        "version": STATE_VERSION,
        "cidr": str(net),
        "release_grace_s": float(release_grace_s),
        "allocated": {},  # public key -> address
        "held": {},  # address -> {"public_key": ..., "released_at": ...}
    }


def _in_network(address: Any, net: ipaddress.IPv4Network | ipaddress.IPv6Network) -> bool:
    try:
        return isinstance(address, str) and ipaddress.ip_address(address) in net
    except ValueError:
        return False


def _checked(state: IPState, copied: bool = True) -> tuple[IPState, ipaddress.IPv4Network | ipaddress.IPv6Network]:
    """Validate a (possibly persisted) state and return it (a deep copy unless read-only) plus its network."""
    if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
        raise IPAMError(f"not an IPAM state of version {STATE_VERSION}")
    for name in ("allocated", "held"):
        if not isinstance(state.get(name), dict):
            raise IPAMError(f"IPAM state has no {name!r} table")
    net = _network(state.get("cidr"))
    grace = state.get("release_grace_s")
    if not isinstance(grace, int | float) or not math.isfinite(grace) or grace < 0:
        raise IPAMError(f"IPAM state has a bad release_grace_s: {grace!r}")
    for key, address in state["allocated"].items():
        if not isinstance(key, str) or not _in_network(address, net):
            raise IPAMError(f"IPAM state has a bad allocation {key!r} -> {address!r}")
    for address, hold in state["held"].items():
        if (
            not _in_network(address, net)
            or not isinstance(hold, dict)
            or not isinstance(hold.get("public_key"), str)
            or not isinstance(hold.get("released_at"), int | float)
            or not math.isfinite(hold["released_at"])
        ):
            raise IPAMError(f"IPAM state has a bad hold {address!r} -> {hold!r}")
    return (copy.deepcopy(state) if copied else state), net


def preferred_offset(public_key: str, cidr: str = DEFAULT_CIDR) -> int:
    """The key's preferred host offset in `cidr` (1 .. size-2): a hash of the key, never network or broadcast."""
    net = _network(cidr)
    usable = net.num_addresses - 2
    digest = hashlib.sha256(b"gpuswarm-ipam-v1\0" + decode_key(public_key)).digest()
    return int.from_bytes(digest[:16], "big") % usable + 1


def _expire(state: IPState, now: float) -> None:
    grace = state["release_grace_s"]
    for address, hold in list(state["held"].items()):
        if now - hold["released_at"] >= grace:
            del state["held"][address]


def expire(state: IPState, now: float) -> IPState:
    """Drop holds whose grace period has passed (allocate does this too; call it to keep the table small)."""
    state, _ = _checked(state)
    _expire(state, _check_now(now))
    return state


def allocate(state: IPState, public_key: str, now: float) -> tuple[IPState, str]:
    """Return (new state, address) for `public_key`: its current address, its held one, or a new slot."""
    state, net = _checked(state)
    public_key = validate_key(public_key)
    now = _check_now(now)
    if public_key in state["allocated"]:
        return state, state["allocated"][public_key]
    _expire(state, now)
    for address, hold in state["held"].items():
        if hold["public_key"] == public_key:  # back within the grace period: same address as before
            del state["held"][address]
            state["allocated"][public_key] = address
            return state, address
    taken = set(state["allocated"].values()) | set(state["held"])
    usable = net.num_addresses - 2
    start = preferred_offset(public_key, str(net))
    base = int(net.network_address)
    for step in range(usable):
        offset = (start - 1 + step) % usable + 1
        address = str(ipaddress.ip_address(base + offset))
        if address not in taken:
            state["allocated"][public_key] = address
            return state, address
    raise PoolExhausted(f"no free address in {net}: {len(state['allocated'])} allocated, {len(state['held'])} held")


def release(state: IPState, public_key: str, now: float) -> IPState:
    """Release the key's address; it is held back for the state's grace period. Unknown keys are a no-op."""
    state, _ = _checked(state)
    public_key = validate_key(public_key)
    now = _check_now(now)
    address = state["allocated"].pop(public_key, None)
    if address is not None:
        state["held"][address] = {"public_key": public_key, "released_at": now}
    return state


def address_of(state: IPState, public_key: str) -> str | None:
    """The key's allocated address, or None (a held address does not count: the node is gone)."""
    state, _ = _checked(state, copied=False)
    return state["allocated"].get(validate_key(public_key))


def prefix_length(state: IPState) -> int:
    """The prefix length a node puts on its interface address (the whole mesh is one on-link network)."""
    _, net = _checked(state, copied=False)
    return net.prefixlen
