"""All-reduce benchmark: hivemind's averaging round (what the product runs between nodes) against
torch.distributed gloo and against the link floor, over a real WireGuard mesh in network namespaces.

Each network: N namespaces on the lab's bridge, every link rate-capped with tbf, every WireGuard packet crossing
the lab's WAN relay (scripts/wanrelay.py) with half the RTT of delay each way, and one peer process per namespace
(scripts/bench/allreduce_peer.py: the product's userspace WireGuard backend and reconciler, a hivemind DHT on the
mesh address). In the same run, iperf3 measures the bandwidth between two peers over the mesh; the floor of an
all-reduce of B bytes among N peers is 2 (N - 1) / N * B * 8 / bandwidth (what each peer must send and receive).

Times are from the trigger to each peer's result, the slowest peer's, median of the rounds: hivemind's group is
formed first (matchmaking is not the all-reduce), gloo's group is formed once.

The averagers run with the product's settings (gpuswarm.dht.hivemind_adapter.averager_options and
averager_compression; decision 0018).

Run as root: scripts/bench/run allreduce [--quick] [--json] [--mbytes 100] [--rounds 2] [--rtt 20] [--loss 0]
[--peers 2,4]. --quick: 2 peers at 100 Mbit/s, 16 MB, in under 5 minutes. --loss drops that share of WireGuard's
packets at the relay (the scaling bench's WAN has 0.5%). Prints a table (or one JSON object per case) and, unless
--no-write, appends the table to docs/benchmarks.md with a chart of it (docs/img/allreduce.png, or allreduce-quick.png).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import charts  # noqa: E402  (scripts/bench, beside this file)
import netlab  # noqa: E402
from gpuswarm.mesh.keys import KeyPair  # noqa: E402

PEER = Path(__file__).with_name("allreduce_peer.py")
WG_PORT = 51820
MESH = "10.88.0"
COMPRESSIONS = ("none", "fp16", "8bit")


class Peer:
    def __init__(self, lab: netlab.NetLab, index: int):
        self.index, self.keys, self.address = index, KeyPair.generate(), f"{MESH}.{index + 1}"
        self.proc = lab.popen(index, [sys.executable, str(PEER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, bufsize=1)

    def send(self, op: str, **args) -> None:
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()

    def answer(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"peer {self.index} exited ({self.proc.wait(5)})")
        reply = json.loads(line)
        if not reply.pop("ok"):
            raise RuntimeError(f"peer {self.index}: {reply['error']}")
        return reply

    def call(self, op: str, **args) -> dict:
        self.send(op, **args)
        return self.answer()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def all_do(peers: list[Peer], op: str, per_peer=lambda p: {}) -> list[dict]:
    """The same order to every peer at once (a round needs them all), then every answer."""
    for p in peers:
        p.send(op, **per_peer(p))
    return [p.answer() for p in peers]


def timed_round(peers: list[Peer], tolerance: float = 1e-3) -> tuple[float, bool]:
    """(the slowest peer's seconds, whether every peer ended with the same tensor: a whole round). Each peer keeps
    its own reduced part uncompressed, so compressed rounds agree only to the codec's rounding; a lost part moves
    the sum by about half."""
    answers = all_do(peers, "run")
    sums = [a["checksum"] for a in answers]
    whole = max(sums) - min(sums) <= tolerance * max(1.0, max(abs(v) for v in sums))
    return max(a["seconds"] for a in answers), whole


def iperf_mbit(lab: netlab.NetLab, server: Peer, client: Peer, seconds: int = 4) -> float:
    srv = lab.popen(server.index, ["iperf3", "-s", "-1", "-B", server.address], stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.5)
        out = lab.exec(client.index, ["iperf3", "-c", server.address, "-t", str(seconds), "-J"],
                       timeout=seconds + 30).stdout
        return json.loads(out)["end"]["sum_received"]["bits_per_second"] / 1e6
    finally:
        srv.kill()
        srv.wait(5)


def network(n: int, rate_mbit: float, rtt_ms: float, numel: int, rounds: int, compressions,
            loss_pct: float = 0.0) -> list[dict]:
    cases = []
    shaping = netlab.Shaping(rate_mbit=rate_mbit)
    with netlab.NetLab(n, shaping=shaping) as lab:
        relay = lab.start_relay(WG_PORT)
        peers = [Peer(lab, i) for i in range(n)]
        try:
            for p in peers:
                p.call("up", address=p.address, cidr=f"{MESH}.0/24", listen_port=WG_PORT,
                       private_key=p.keys.private_key)
            for p in peers:
                p.call("peers", peers=[{"public_key": q.keys.public_key, "allowed_ips": [f"{q.address}/32"],
                                        "endpoint": relay.endpoint(q.index)} for q in peers if q is not p])
            for p in peers[1:]:
                if not any(lab.ping(0, p.address, wait_s=1.0) for _ in range(5)):
                    raise RuntimeError(f"no mesh path from peer 0 to peer {p.index}")
            # The WAN's delay only once the handshakes are done: two peers that start their handshakes at the same
            # moment over a delayed path each drop the other's answer, and retry in lockstep.
            relay.set(delay_ms=rtt_ms / 2, loss_pct=loss_pct)
            bandwidth = iperf_mbit(lab, peers[1], peers[0])
            first = peers[0].call("dht", host=peers[0].address, initial_peers=[])["maddrs"]
            all_do(peers[1:], "dht", lambda p: {"host": p.address, "initial_peers": first})
            floor = 2 * (n - 1) / n * numel * 4 * 8 / (bandwidth * 1e6)
            gloo = []
            for _ in range(rounds):
                all_do(peers, "prepare", lambda p: {"kind": "gloo", "numel": numel, "rank": p.index, "world": n,
                                                    "master": peers[0].address})
                gloo.append(timed_round(peers)[0])
            for comp in compressions:
                times, whole = [], True
                order = {"kind": "hivemind", "numel": numel, "compression": comp, "group": n, "prefix": f"bench-{comp}"}
                for _ in range(rounds):
                    all_do(peers, "prepare", lambda p, order=order: order)
                    seconds, complete = timed_round(peers, 1e-3 if comp == "none" else 5e-2)
                    times.append(seconds)
                    whole = whole and complete
                all_do(peers, "close")
                seconds = statistics.median(times)
                cases.append({"peers": n, "bytes": numel * 4, "rate_mbit": rate_mbit, "rtt_ms": rtt_ms,
                              "loss_pct": loss_pct, "compression": comp, "seconds": round(seconds, 3),
                              "gloo_seconds": round(statistics.median(gloo), 3), "floor_seconds": round(floor, 3),
                              "floor_ratio": round(floor / seconds, 3), "iperf_mbit": round(bandwidth, 1),
                              "whole_rounds": whole})
                print(json.dumps(cases[-1]), file=sys.stderr, flush=True)
        finally:
            for p in peers:
                p.stop()
            relay.stop()
    return cases


def table(cases: list[dict], quick: bool) -> str:
    lines = [f"## allreduce ({time.strftime('%Y-%m-%d')}, {platform.machine()}, 2 cores, wireguard-go in namespaces, "
             f"tbf rate caps, the WAN relay's delay{', --quick' if quick else ''})", "",
             "| peers | MB | cap Mbit/s | iperf3 Mbit/s | RTT ms | loss % | compression | hivemind s | gloo s | "
             "floor s | floor / hivemind | gloo / hivemind | whole rounds |", "|---" * 13 + "|"]
    for c in cases:
        lines.append(f"| {c['peers']} | {c['bytes'] / 1e6:.0f} | {c['rate_mbit']:g} | {c['iperf_mbit']:.0f} | "
                     f"{c['rtt_ms']:g} | {c.get('loss_pct', 0):g} | {c['compression']} | {c['seconds']:.2f} | "
                     f"{c['gloo_seconds']:.2f} | {c['floor_seconds']:.2f} | {c['floor_ratio']:.2f} | "
                     f"{c['gloo_seconds'] / c['seconds']:.2f}x | {'yes' if c['whole_rounds'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def chart(cases: list[dict], quick: bool) -> str:
    """Seconds per round for each network: hivemind by compression, gloo and the link floor beside them. Returns the
    Markdown image line for under the table."""
    networks = list(dict.fromkeys((c["peers"], c["rate_mbit"]) for c in cases))
    by = {(c["peers"], c["rate_mbit"], c["compression"]): c for c in cases}
    first = {net: next(c for c in cases if (c["peers"], c["rate_mbit"]) == net) for net in networks}
    series = {f"hivemind {comp}": [by[(*net, comp)]["seconds"] if (*net, comp) in by else 0.0 for net in networks]
              for comp in COMPRESSIONS if any((*net, comp) in by for net in networks)}
    series["gloo"] = [first[net]["gloo_seconds"] for net in networks]
    series["link floor"] = [first[net]["floor_seconds"] for net in networks]
    mbytes = cases[0]["bytes"] / 1e6
    return charts.bars("allreduce-quick" if quick else "allreduce",
                       f"All-reduce of {mbytes:.0f} MB over WireGuard, {cases[0]['rtt_ms']:g} ms RTT, "
                       f"{cases[0]['loss_pct']:g}% loss (lower is better)",
                       [f"{n} peers, {rate:g} Mbit/s" for n, rate in networks], series, "seconds per round")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="2 peers, 100 Mbit/s, 16 MB: under 5 minutes")
    parser.add_argument("--json", action="store_true", help="one JSON object per case on stdout")
    parser.add_argument("--mbytes", type=float, help="tensor size in MB (default 100; 16 with --quick)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rtt", type=float, default=20.0, help="round-trip time the relay adds, ms")
    parser.add_argument("--loss", type=float, default=0.0, help="packet loss the relay adds, percent")
    parser.add_argument("--peers", help="peer counts, comma-separated (default 2,4; 2 with --quick)")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    reason = netlab.unavailable_reason()
    if reason:
        print(f"allreduce: {reason}", file=sys.stderr)
        return 1
    mbytes = args.mbytes or (16 if args.quick else 100)
    numel = int(mbytes * 1e6 / 4)
    networks = [(2, 100.0)] if args.quick else [(2, 100.0), (2, 1000.0), (4, 100.0), (4, 1000.0)]
    if args.peers:
        counts = [int(n) for n in args.peers.split(",")]
        networks = [(n, rate) for n in counts for rate in dict.fromkeys(r for _, r in networks)]
    cases = []
    for n, rate in networks:
        cases += network(n, rate, args.rtt, numel, args.rounds, COMPRESSIONS, args.loss)
    if args.json:
        for c in cases:
            print(json.dumps(c))
    text = table(cases, args.quick)
    if not args.json:
        print(text)
    if not args.no_write:
        with open(ROOT / "docs" / "benchmarks.md", "a") as f:
            f.write("\n" + text + "\n" + chart(cases, args.quick) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
