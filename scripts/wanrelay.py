#!/usr/bin/env python3
"""A userspace UDP relay that makes the netns lab a WAN: delay, jitter, loss, a rate cap and partitions, all
changeable while it runs. These kernels have no netem, and WireGuard runs over UDP, so relaying WireGuard's packets
shapes everything inside the mesh. A lab tool, not product code (scripts/netlab.py starts it in the lab's hub).

How packets flow. The relay has one socket per node ("the node's face", RELAY_IP:BASE+i). Node i is told that
node k is at RELAY_IP:BASE+k (its WireGuard endpoint). A packet from node i arriving on k's face is sent on to
node k from i's face, so k sees it come from i's face and WireGuard's roaming keeps k's replies on the relay too.
Each packet is dropped (partition, loss, or a full queue) or delayed: it waits for its sender's uplink (a token
bucket at the rate cap, queueing at most `queue_ms`), then `delay_ms` plus uniform jitter of +-`jitter_ms`.

Control: a Unix socket taking one JSON object per line, answered with the settings and counters:
    {"delay_ms": 20, "jitter_ms": 2, "loss_pct": 0.5, "rate_mbit": 100, "partition": [[0, 1], [2, 3]]}
Keys left out keep their values; `partition` lists groups that cannot reach each other ([] heals everything).

    python scripts/wanrelay.py run --listen 10.250.0.254 --base-port 52000 --node 10.250.0.1:51820 ...
                                   --control /run/wanrelay.sock [--delay 20 --jitter 2 --loss 0.5 --rate 100]
    python scripts/wanrelay.py set --control /run/wanrelay.sock --delay 40 --partition 0,1/2,3
    python scripts/wanrelay.py show --control /run/wanrelay.sock
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import socket
import sys
from dataclasses import asdict, dataclass, field, replace


@dataclass(frozen=True)
class Impairment:
    delay_ms: float = 0.0  # one way, added to every packet
    jitter_ms: float = 0.0  # uniform in [-jitter, +jitter], never below zero delay
    loss_pct: float = 0.0
    rate_mbit: float | None = None  # each node's uplink; None: no cap
    queue_ms: float = 200.0  # the most a packet waits for its uplink before it is dropped
    partition: tuple[tuple[int, ...], ...] = ()  # groups that cannot reach each other

    def __post_init__(self) -> None:
        for name in ("delay_ms", "jitter_ms", "loss_pct", "queue_ms"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a number >= 0, not {value!r}")
        if self.loss_pct > 100:
            raise ValueError("loss_pct is at most 100")
        if self.rate_mbit is not None and not (math.isfinite(self.rate_mbit) and self.rate_mbit > 0):
            raise ValueError(f"rate_mbit must be > 0 (or null for no cap), not {self.rate_mbit!r}")

    def with_changes(self, changes: dict) -> Impairment:
        unknown = set(changes) - {f for f in self.__dataclass_fields__}
        if unknown:
            raise ValueError(f"unknown setting(s): {', '.join(sorted(unknown))}")
        if "partition" in changes:
            groups = changes["partition"]
            if not isinstance(groups, list) or not all(isinstance(g, list) and all(isinstance(i, int) for i in g)
                                                       for g in groups):
                raise ValueError("partition is a list of lists of node indexes")
            changes = {**changes, "partition": tuple(tuple(g) for g in groups)}
        return replace(self, **changes)

    def blocked(self, a: int, b: int) -> bool:
        """Whether a partition separates nodes a and b (a node in no group is cut off from every group)."""
        if not self.partition:
            return False
        group = {i: n for n, members in enumerate(self.partition) for i in members}
        return group.get(a, -1 - a) != group.get(b, -1 - b)


@dataclass
class Counters:
    forwarded: int = 0
    lost: int = 0
    partitioned: int = 0
    queue_full: int = 0
    unknown_source: int = 0
    bytes: int = 0


@dataclass
class Relay:
    listen: str
    base_port: int
    nodes: list[tuple[str, int]]  # node i's real WireGuard address
    impairment: Impairment = field(default_factory=Impairment)
    counters: Counters = field(default_factory=Counters)

    def __post_init__(self) -> None:
        self.index = {addr: i for i, addr in enumerate(self.nodes)}
        self.faces: list[asyncio.DatagramTransport] = []
        self.uplink_free = [0.0] * len(self.nodes)  # when node i's uplink is next free (loop time)
        self.rng = random.Random()

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        for k in range(len(self.nodes)):
            transport, _ = await loop.create_datagram_endpoint(
                lambda k=k: _Face(self, k), local_addr=(self.listen, self.base_port + k))
            sock = transport.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
            self.faces.append(transport)

    def received(self, k: int, data: bytes, source: tuple[str, int]) -> None:
        """A packet from `source` for node k, arriving on k's face."""
        i = self.index.get(source[:2])
        c, imp = self.counters, self.impairment
        if i is None or i == k:
            c.unknown_source += 1
            return
        if imp.blocked(i, k):
            c.partitioned += 1
            return
        if imp.loss_pct and self.rng.random() * 100 < imp.loss_pct:
            c.lost += 1
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        depart = now
        if imp.rate_mbit:
            depart = max(now, self.uplink_free[i])
            if depart - now > imp.queue_ms / 1000:
                c.queue_full += 1
                return
            self.uplink_free[i] = depart + len(data) * 8 / (imp.rate_mbit * 1e6)
        delay = imp.delay_ms + (self.rng.uniform(-imp.jitter_ms, imp.jitter_ms) if imp.jitter_ms else 0.0)
        at = depart + max(0.0, delay) / 1000
        c.forwarded += 1
        c.bytes += len(data)
        if at <= now:
            self.faces[i].sendto(data, self.nodes[k])
        else:
            loop.call_at(at, self.faces[i].sendto, data, self.nodes[k])

    def state(self) -> dict:
        return {"impairment": asdict(self.impairment), "counters": asdict(self.counters)}


class _Face(asyncio.DatagramProtocol):
    def __init__(self, relay: Relay, k: int):
        self.relay, self.k = relay, k

    def datagram_received(self, data: bytes, addr) -> None:
        self.relay.received(self.k, data, addr)

    def error_received(self, exc: Exception) -> None:  # an ICMP error for an earlier send: nothing to do
        pass


async def serve_control(relay: Relay, path: str) -> asyncio.AbstractServer:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async for line in reader:
                try:
                    changes = json.loads(line) if line.strip() else {}
                    if not isinstance(changes, dict):
                        raise ValueError("send a JSON object")
                    relay.impairment = relay.impairment.with_changes(changes)
                    answer = relay.state()
                except (ValueError, TypeError) as e:
                    answer = {"error": str(e), **relay.state()}
                writer.write(json.dumps(answer).encode() + b"\n")
                await writer.drain()
        finally:
            writer.close()

    if os.path.exists(path):
        os.unlink(path)
    return await asyncio.start_unix_server(handle, path)


def control(path: str, changes: dict, timeout: float = 5.0) -> dict:
    """Send `changes` to a running relay and return its settings and counters ({} changes: just read them)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(path)
        sock.sendall(json.dumps(changes).encode() + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    answer = json.loads(data)
    if "error" in answer:
        raise ValueError(answer["error"])
    return answer


def _endpoint(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def _settings(args: argparse.Namespace) -> dict:
    changes = {name: getattr(args, arg) for arg, name in (("delay", "delay_ms"), ("jitter", "jitter_ms"),
                                                          ("loss", "loss_pct"), ("rate", "rate_mbit"))
               if getattr(args, arg) is not None}
    if args.rate == 0:
        changes["rate_mbit"] = None
    if args.partition is not None:
        changes["partition"] = [[int(i) for i in g.split(",") if i] for g in args.partition.split("/") if g] \
            if args.partition not in ("", "none") else []
    return changes


async def _run(args: argparse.Namespace) -> None:
    relay = Relay(args.listen, args.base_port, [_endpoint(n) for n in args.node])
    relay.impairment = relay.impairment.with_changes(_settings(args))
    await relay.start()
    server = await serve_control(relay, args.control)
    print(json.dumps({"ready": True, "faces": [f"{args.listen}:{args.base_port + k}" for k in range(len(args.node))]}),
          flush=True)
    async with server:
        await asyncio.Event().wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="UDP relay with delay, jitter, loss, rate cap and partitions.")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run")
    run.add_argument("--listen", required=True)
    run.add_argument("--base-port", type=int, default=52000)
    run.add_argument("--node", action="append", required=True, help="node i's real HOST:PORT (repeat, in order)")
    change = sub.add_parser("set")
    for p in (run, change, sub.add_parser("show")):
        p.add_argument("--control", required=True, help="the relay's Unix control socket")
    for p in (run, change):
        p.add_argument("--delay", type=float, help="one-way ms")
        p.add_argument("--jitter", type=float, help="ms, uniform +-")
        p.add_argument("--loss", type=float, help="percent")
        p.add_argument("--rate", type=float, help="Mbit/s per node uplink (0: no cap)")
        p.add_argument("--partition", help="groups that cannot reach each other, e.g. 0,1/2,3 ('none' heals)")
    args = parser.parse_args(argv)
    try:
        if args.command == "run":
            asyncio.run(_run(args))
        else:
            print(json.dumps(control(args.control, _settings(args) if args.command == "set" else {}), indent=2))
    except (OSError, ValueError) as e:
        print(f"wanrelay: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
