"""The mesh's command group: `gpuswarm mesh status`, this node's WireGuard interface and its peers.

Reads the interface name and the peer map that the node daemon keeps in STATE_DIR/mesh.json, asks the device
itself (UAPI) for endpoints, handshakes and byte counts, and measures each peer's RTT with one ICMP echo.
"""

from __future__ import annotations

import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

mesh_app = typer.Typer(help="Inspect this node's WireGuard mesh.", no_args_is_help=True)
console = Console(width=None if sys.stdout.isatty() else 160)


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


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
        typer.echo(f"error: no mesh state in {state_dir} (is the node running with the mesh?)", err=True)
        raise typer.Exit(1) from None
    try:
        device = UAPIClient.for_interface(saved["interface"]).get()
    except UAPIError as e:
        typer.echo(f"error: interface {saved['interface']} does not answer: {e}", err=True)
        raise typer.Exit(1) from None
    known = saved.get("peers", {})
    with ThreadPoolExecutor(max_workers=16) as pool:
        rtts = dict(zip([p.public_key for p in device.peers], pool.map(
            lambda p: icmp_rtt(known[p.public_key]["address"], wait_s=1.0) if p.public_key in known else None,
            device.peers), strict=True))
    now = time.time()
    peers = [{
        "node_id": known.get(p.public_key, {}).get("node_id"), "public_key": p.public_key,
        "address": known.get(p.public_key, {}).get("address"), "endpoint": p.endpoint,
        "latest_handshake": p.latest_handshake, "rx_bytes": p.rx_bytes, "tx_bytes": p.tx_bytes,
        "rtt_ms": None if rtts[p.public_key] is None else round(rtts[p.public_key] * 1000, 3),
    } for p in device.peers]
    result = {"interface": saved["interface"], "backend": saved.get("backend"), "address": saved["address"],
              "cidr": saved["cidr"], "listen_port": device.listen_port, "public_key": device.public_key,
              "peers": peers}
    if as_json:
        typer.echo(json.dumps(result, indent=2))
        return
    console.print(f"interface [bold]{result['interface']}[/bold] ({result['backend']})  address {result['address']}"
                  f"  network {result['cidr']}  port {result['listen_port']}  key {result['public_key']}")
    table = Table("NODE", "MESH ADDRESS", "ENDPOINT", "HANDSHAKE", "RX", "TX", "RTT")
    for p in peers:
        handshake = "never" if p["latest_handshake"] is None else f"{now - p['latest_handshake']:.0f}s ago"
        table.add_row(p["node_id"] or p["public_key"][:12], p["address"] or "-", p["endpoint"] or "-", handshake,
                      _size(p["rx_bytes"]), _size(p["tx_bytes"]),
                      "-" if p["rtt_ms"] is None else f"{p['rtt_ms']:.2f} ms")
    console.print(table if peers else "no peers")
