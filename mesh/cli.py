"""The mesh's command group: `gpuswarm mesh status`, this node's WireGuard interface and its peers.

Reads the interface name, the peer map and each peer's path (the path keeper's state, chosen endpoint and RTT,
or the relay a peer with no direct path goes through) that the node daemon keeps in STATE_DIR/mesh.json, and
asks the device itself (UAPI) for endpoints, handshakes and byte counts. A peer whose RTT the daemon has not
measured gets one ICMP echo from here.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from gpuswarm.console import console, fail, print_json

mesh_app = typer.Typer(help="Inspect this node's WireGuard mesh.", no_args_is_help=True)


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _path(path: dict | None) -> str:
    """The path keeper's state and which of the peer's candidates is in use, as in "settled 2/3" ("roamed": an
    address the peer reached us from, not one it reported)."""
    if not path:
        return "-"
    if path.get("via"):
        return f"relayed via {path['via']}"
    which = f"{path['candidate']}/{len(path.get('candidates', []))}" if path.get("candidate") else "roamed"
    return f"{path['state']} {which}"


@mesh_app.command("status")
def status(
    state_dir: Annotated[Path, typer.Option(help="The node's state directory.")] = Path("var/node"),
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """This node's interface, and each peer with its endpoint, latest handshake, rx/tx and RTT."""
    from gpuswarm.mesh.probe import icmp_rtt
    from gpuswarm.mesh.uapi import UAPIClient, UAPIError

    try:
        saved = json.loads((state_dir / "mesh.json").read_text())
    except (OSError, ValueError):
        raise fail(f"no mesh state in {state_dir} (is the node running with the mesh?)") from None
    try:
        device = UAPIClient.for_interface(saved["interface"]).get()
    except UAPIError as e:
        raise fail(f"interface {saved['interface']} does not answer: {e}") from None
    known = saved.get("peers", {})

    def path_of(key: str) -> dict:
        return known.get(key, {}).get("path") or {}

    def rtt_ms(key: str) -> float | None:
        for field in ("rtt_ms", "relay_rtt_ms"):  # the daemon's own measurement: its settled path, or the relay
            if path_of(key).get(field) is not None:
                return path_of(key)[field]
        if key not in known:
            return None
        seconds = icmp_rtt(known[key]["address"], wait_s=1.0)
        return None if seconds is None else round(seconds * 1000, 3)

    with ThreadPoolExecutor(max_workers=16) as pool:
        rtts = dict(zip([p.public_key for p in device.peers],
                        pool.map(lambda p: rtt_ms(p.public_key), device.peers), strict=True))
    now = time.time()
    peers = [{
        "node_id": known.get(p.public_key, {}).get("node_id"), "public_key": p.public_key,
        "address": known.get(p.public_key, {}).get("address"), "endpoint": p.endpoint,
        "candidates": known.get(p.public_key, {}).get("endpoints", []), "path": path_of(p.public_key) or None,
        "latest_handshake": p.latest_handshake, "rx_bytes": p.rx_bytes, "tx_bytes": p.tx_bytes,
        "rtt_ms": rtts[p.public_key],
    } for p in device.peers]
    result = {"interface": saved["interface"], "backend": saved.get("backend"), "address": saved["address"],
              "cidr": saved["cidr"], "listen_port": device.listen_port, "public_key": device.public_key,
              "relaying": bool(saved.get("forwarding")), "peers": peers}
    if as_json:
        print_json(result)
        return
    console.print(f"interface [bold]{result['interface']}[/bold] ({result['backend']})  address {result['address']}"
                  f"  network {result['cidr']}  port {result['listen_port']}  key {result['public_key']}"
                  + ("  [bold]relaying[/bold] for peers without a direct path" if result["relaying"] else ""))
    table = Table("NODE", "MESH ADDRESS", "ENDPOINT", "PATH", "HANDSHAKE", "RX", "TX", "RTT")
    for p in peers:
        handshake = "never" if p["latest_handshake"] is None else f"{now - p['latest_handshake']:.0f}s ago"
        table.add_row(p["node_id"] or p["public_key"][:12], p["address"] or "-", p["endpoint"] or "-",
                      _path(p["path"]), handshake, _size(p["rx_bytes"]), _size(p["tx_bytes"]),
                      "-" if p["rtt_ms"] is None else f"{p['rtt_ms']:.2f} ms")
    console.print(table if peers else "no peers")
