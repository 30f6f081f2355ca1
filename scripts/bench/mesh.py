"""Mesh benchmark: join convergence and tunnel throughput, measured on the real product in network namespaces.

1. A coordinator and 8 node daemons (mesh on, wireguard-go) form a mesh; a 9th node joins. Measured: from the
   joiner's registration (its mesh.json appears) to the first completed handshake with each of the 8 peers, read
   from the WireGuard devices themselves (UAPI), and to all 8.
2. iperf3 between two of those namespaces, through the raw veth path and through the WireGuard tunnel, in the
   same run; reported as a ratio.

Run as root: .venv/bin/python scripts/bench/mesh.py [--nodes 8] [--seconds 5]. Prints a table and appends it to
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import netlab  # noqa: E402
from gpuswarm.mesh.uapi import UAPIClient, UAPIError  # noqa: E402
from meshswarm import MeshSwarm, wait_for  # noqa: E402


def handshake_times(swarm: MeshSwarm, peers: list[int], key: str) -> dict[int, float]:
    found = {}
    for i in peers:
        state = swarm.mesh_state(i)
        try:
            peer = UAPIClient.for_interface(state["interface"]).get().peer(key)
        except (UAPIError, TypeError, KeyError):
            continue
        if peer is not None and peer.latest_handshake:
            found[i] = peer.latest_handshake
    return found


def iperf(lab: netlab.NetLab, server: int, client: int, address: str, seconds: int) -> float:
    srv = lab.popen(server, ["iperf3", "-s", "-1", "-B", address], stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.5)
        out = lab.exec(client, ["iperf3", "-c", address, "-t", str(seconds), "-J"], timeout=seconds + 30).stdout
        return json.loads(out)["end"]["sum_received"]["bits_per_second"] / 1e6
    finally:
        srv.kill()
        srv.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--seconds", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=ROOT / "var" / "bench-mesh")
    args = parser.parse_args()
    subprocess.run(["rm", "-rf", str(args.dir)], check=True)
    args.dir.mkdir(parents=True)
    n = args.nodes
    with netlab.NetLab(n + 2) as lab:
        swarm = MeshSwarm(lab, args.dir)
        try:
            swarm.start_coordinator()
            for i in range(1, n + 1):
                swarm.start_node(i)
            wait_for(lambda: all(len(swarm.peers_of(i)) == n - 1 for i in range(1, n + 1)), 120, "the mesh")
            joiner = n + 1
            swarm.start_node(joiner)
            wait_for(lambda: swarm.mesh_state(joiner), 60, "the joiner to register", interval=0.01)
            registered = (swarm.state_dir(joiner) / "mesh.json").stat().st_mtime
            key = swarm.wg_key(joiner)
            # Traffic starts the handshakes: each peer pings the joiner once it has it.
            peers = list(range(1, n + 1))
            for i in peers:
                lab.popen(i, [sys.executable, str(ROOT / "scripts" / "netlab.py"), "ping",
                              swarm.mesh_state(joiner)["address"], "--count", "20", "--wait", "0.25"])
            times = wait_for(lambda: (t := handshake_times(swarm, peers, key)) and len(t) == n and t, 60,
                             "handshakes with every peer", interval=0.05)
            lags = sorted(t - registered for t in times.values())
            underlay = iperf(lab, 1, 2, lab.addresses[1], args.seconds)
            tunnel = iperf(lab, 1, 2, swarm.mesh_state(1)["address"], args.seconds)
        finally:
            for i in sorted(swarm.procs, reverse=True):
                swarm.stop(i)
    rows = [
        ("new node joining a mesh of", f"{n} nodes"),
        ("registration -> first handshake", f"{lags[0]:.2f} s"),
        ("registration -> handshakes with all peers", f"{lags[-1]:.2f} s"),
        ("raw veth throughput (iperf3)", f"{underlay:,.0f} Mbit/s"),
        ("wireguard-go tunnel throughput (iperf3)", f"{tunnel:,.0f} Mbit/s"),
        ("tunnel / raw", f"{tunnel / underlay:.3f}"),
    ]
    table = "\n".join(["| measure | value |", "|---|---|", *(f"| {a} | {b} |" for a, b in rows)])
    print(table)
    with open(ROOT / "docs" / "benchmarks.md", "a") as f:
        f.write(f"\n## mesh ({time.strftime('%Y-%m-%d')}, 2-core machine, wireguard-go in namespaces)\n\n{table}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
