#!/usr/bin/env python3
"""A network lab: N network namespaces joined through one bridge, with optional per-link shaping. Root only.

Layout of a lab with prefix P (P = "gsl" + 6 hex characters, unique per lab, so parallel labs never clash):

    P-hub: bridge br0, with veth ports v0 .. v(N-1)
    P-n0 .. P-n(N-1): eth0 (the other end of vI), address 10.250.0.(I+1)/24 by default, and lo

The bridge lives in its own namespace, so the host's own namespace gets no interfaces or routes, and deleting the
lab's namespaces removes every link. Shaping (rate, delay, jitter, loss) applies to both directions of a node's
link: tc on eth0 (what the node sends) and on vI (what it receives). Delay and loss need the netem qdisc; a
rate-only shape uses tbf, which needs nothing more than the base kernel.

These kernels have no netem, so delay, jitter, loss and partitions come from a userspace UDP relay in the hub
(scripts/wanrelay.py, `NetLab.start_relay`): nodes whose WireGuard endpoints point at the relay's faces get a WAN
between them, changeable while they run; tbf (rate only) still works on the links themselves.

A lab tool, not product code: it shells out to `ip` and `tc`. Use it as a context manager (teardown runs even
after a failure, including a failure half-way through building the lab), or from the shell:

    python scripts/netlab.py up 4 [--rate 100] [--delay 20] [--loss 1]   # prints the lab as JSON
    python scripts/netlab.py down [PREFIX]                                # all labs when no prefix is given
    python scripts/netlab.py list
    python scripts/netlab.py ping ADDRESS [--count N] [--wait S]           # ICMP echo, no iputils needed
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

from gpuswarm.mesh.probe import icmp_ping

LAB_PREFIX_RE = re.compile(r"^gsl[0-9a-f]{6}$")
LAB_NAMESPACE_RE = re.compile(r"^(gsl[0-9a-f]{6})-(hub|n\d+)$")
DEFAULT_SUBNET = "10.250.0.0/24"


class LabError(RuntimeError):
    pass


@dataclass(frozen=True)
class Shaping:
    """Per-link shaping; None leaves that aspect alone."""

    rate_mbit: float | None = None
    delay_ms: float | None = None
    jitter_ms: float | None = None
    loss_pct: float | None = None

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if value is not None and (not isinstance(value, int | float) or value < 0):
                raise ValueError(f"{name} must be a number >= 0, not {value!r}")
        if self.loss_pct is not None and self.loss_pct > 100:
            raise ValueError("loss_pct is at most 100")
        if self.jitter_ms and not self.delay_ms:
            raise ValueError("jitter needs a delay")

    @property
    def needs_netem(self) -> bool:
        return bool(self.delay_ms or self.loss_pct)

    def tc_args(self) -> list[str]:
        """The qdisc part of `tc qdisc replace dev DEV root ...`."""
        if self.needs_netem:
            args = ["netem"]
            if self.delay_ms:
                args += ["delay", f"{self.delay_ms}ms"] + ([f"{self.jitter_ms}ms"] if self.jitter_ms else [])
            if self.loss_pct:
                args += ["loss", f"{self.loss_pct}%"]
            if self.rate_mbit:
                args += ["rate", f"{self.rate_mbit}mbit"]
            return args
        if self.rate_mbit:
            burst = max(16_000, int(self.rate_mbit * 1e6 / 8 / 100))  # 10 ms worth of bytes
            return ["tbf", "rate", f"{self.rate_mbit}mbit", "burst", str(burst), "latency", "100ms"]
        return []


def unavailable_reason(wireguard: bool = False) -> str | None:
    """Why a lab cannot be built here, or None; with `wireguard`, also why it could not run a WireGuard mesh."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"{tool} (iproute2) is not installed"
    if wireguard and shutil.which("wireguard-go") is None:
        return "wireguard-go is not installed (apt-get install wireguard-go)"
    if wireguard and not os.path.exists("/dev/net/tun"):
        return "/dev/net/tun is missing"
    return None


def _run(argv: list[str], check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise LabError(f"{' '.join(argv)} did not finish within {timeout} s") from None
    if check and result.returncode != 0:
        raise LabError(f"{' '.join(argv)} failed ({result.returncode}): {result.stderr.strip()}")
    return result


def list_namespaces(prefix: str | None = None) -> list[str]:
    """Lab namespaces on this host (all labs, or one prefix's)."""
    result = _run(["ip", "netns", "list"], check=False)
    names = []
    for line in result.stdout.splitlines():
        name = line.split(" ", 1)[0]
        match = LAB_NAMESPACE_RE.match(name)
        if match and (prefix is None or match.group(1) == prefix):
            names.append(name)
    return names


def _namespace_pids(namespace: str) -> list[int]:
    result = _run(["ip", "netns", "pids", namespace], check=False)
    return [int(p) for p in result.stdout.split() if p.isdigit()]


def destroy(prefix: str | None = None, grace_s: float = 2.0) -> list[str]:
    """Remove a lab's namespaces (every lab's if prefix is None), first ending the processes still running in
    them (they were started there by the lab's users: SIGTERM, then SIGKILL after `grace_s`)."""
    if prefix is not None and not LAB_PREFIX_RE.match(prefix):
        raise ValueError(f"not a lab prefix: {prefix!r}")
    namespaces = list_namespaces(prefix)
    pids = {pid for ns in namespaces for pid in _namespace_pids(ns)}
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while pids and time.monotonic() < deadline:
            pids = {pid for pid in pids if os.path.exists(f"/proc/{pid}")}
            if pids:
                time.sleep(0.1)
        if not pids:
            break
    errors = []
    for ns in namespaces:
        result = _run(["ip", "netns", "del", ns], check=False)
        if result.returncode != 0 and ns in list_namespaces(prefix):
            errors.append(f"{ns}: {result.stderr.strip()}")
    if errors:
        raise LabError("could not delete: " + "; ".join(errors))
    return namespaces


@dataclass
class Relay:
    """The lab's running WAN relay: `endpoint(i)` is node i's face; `set(...)` changes the WAN at once."""

    proc: subprocess.Popen
    control: str
    address: str
    base_port: int

    def endpoint(self, i: int) -> str:
        return f"{self.address}:{self.base_port + i}"

    def set(self, **changes) -> dict:
        """delay_ms, jitter_ms, loss_pct, rate_mbit (None: no cap), partition ([[0, 1], [2]]; [] heals)."""
        import wanrelay

        return wanrelay.control(self.control, changes)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc.stdout.close()


class NetLab:
    """N namespaces on one bridge. `with NetLab(3) as lab: lab.exec(0, ["ping", "-c1", lab.addresses[1]])`."""

    def __init__(
        self,
        n: int,
        *,
        subnet: str = DEFAULT_SUBNET,
        prefix: str | None = None,
        shaping: Shaping | dict[int, Shaping] | None = None,
    ):
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 200:
            raise ValueError(f"a lab has 1..200 namespaces, not {n!r}")
        self.prefix = prefix or "gsl" + secrets.token_hex(3)
        if not LAB_PREFIX_RE.match(self.prefix):
            raise ValueError(f"a lab prefix is 'gsl' + 6 hex characters, not {self.prefix!r}")
        net = ipaddress.ip_network(subnet, strict=True)
        hosts = list(net.hosts())
        if len(hosts) < n:
            raise ValueError(f"{subnet} has room for {len(hosts)} namespaces, not {n}")
        self.subnet = net
        self.hub = f"{self.prefix}-hub"
        self.namespaces = [f"{self.prefix}-n{i}" for i in range(n)]
        self.addresses = [str(hosts[i]) for i in range(n)]
        if isinstance(shaping, Shaping):
            shaping = {i: shaping for i in range(n)}
        self.shaping = dict(shaping or {})

    def __len__(self) -> int:
        return len(self.namespaces)

    def _ip(self, namespace: str, *args: str) -> None:
        _run(["ip", "-n", namespace, *args])

    def up(self) -> NetLab:
        reason = unavailable_reason()
        if reason:
            raise LabError(reason)
        try:
            _run(["ip", "netns", "add", self.hub])
            self._ip(self.hub, "link", "set", "lo", "up")
            self._ip(self.hub, "link", "add", "br0", "type", "bridge")
            self._ip(self.hub, "link", "set", "br0", "up")
            for i, (ns, address) in enumerate(zip(self.namespaces, self.addresses, strict=True)):
                _run(["ip", "netns", "add", ns])
                self._ip(ns, "link", "set", "lo", "up")
                # Created inside the hub with its peer end placed straight into the node: no names in the host ns.
                self._ip(self.hub, "link", "add", f"v{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
                self._ip(self.hub, "link", "set", f"v{i}", "master", "br0", "up")
                self._ip(ns, "addr", "add", f"{address}/{self.subnet.prefixlen}", "dev", "eth0")
                self._ip(ns, "link", "set", "eth0", "up")
            for i, shape in self.shaping.items():
                self.shape(i, shape)
        except BaseException:
            self.down()
            raise
        return self

    def shape(self, i: int, shaping: Shaping) -> None:
        """Shape node i's link in both directions (replacing any earlier shape); an empty Shaping clears it."""
        args = shaping.tc_args()
        for ns, dev in ((self.namespaces[i], "eth0"), (self.hub, f"v{i}")):
            if not args:
                _run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)
                continue
            result = _run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", *args], check=False)
            if result.returncode != 0:
                hint = ""
                if shaping.needs_netem and "unknown" in result.stderr.lower():
                    hint = " (this kernel has no netem qdisc: delay and loss are unavailable; rate alone uses tbf)"
                raise LabError(f"tc on {ns}/{dev} failed: {result.stderr.strip()}{hint}")

    def isolate(self, i: int, cut: bool = True) -> None:
        """Cut node i off from every other namespace (its link to the hub goes down), or (`cut=False`) join it
        again: a partition of one node from the coordinator and its peers alike."""
        self._ip(self.hub, "link", "set", f"v{i}", "down" if cut else "up")

    def separate(self, nodes: list[int], apart: bool = True) -> None:
        """Take away the direct links among `nodes` (bridge port isolation: isolated ports never exchange frames),
        or (`apart=False`) give them back. Each of them still reaches every other namespace and the hub: two
        nodes with no direct path that a third reaches, as behind two NATs that never meet."""
        for i in nodes:
            _run(["bridge", "-n", self.hub, "link", "set", "dev", f"v{i}", "isolated", "on" if apart else "off"])

    def start_relay(self, node_port: int | list[int], *, base_port: int = 52000, **impairment) -> Relay:
        """Start the WAN relay (scripts/wanrelay.py) in the hub, at the subnet's last address, with one face per
        node: give node i `relay.endpoint(i)` as the endpoint its peers use. `node_port` is the UDP port each node's
        WireGuard listens on (one for all, or one per node); `impairment` as wanrelay's control takes it. Add delay
        after the mesh's first handshakes: two peers that both start one over a delayed path answer each other's
        initiations, drop each other's responses, and retry in lockstep."""
        ports = node_port if isinstance(node_port, list) else [node_port] * len(self)
        address = str(list(self.subnet.hosts())[-1])
        self._ip(self.hub, "addr", "replace", f"{address}/{self.subnet.prefixlen}", "dev", "br0")
        control = f"/run/{self.prefix}-relay.sock"
        argv = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "wanrelay.py"), "run",
                "--listen", address, "--base-port", str(base_port), "--control", control]
        for node, port in zip(self.addresses, ports, strict=True):
            argv += ["--node", f"{node}:{port}"]
        proc = subprocess.Popen(["ip", "netns", "exec", self.hub, *argv], stdout=subprocess.PIPE, text=True)
        line = proc.stdout.readline()
        if '"ready"' not in line:
            proc.kill()
            raise LabError(f"the WAN relay did not start (exit {proc.wait(5)})")
        relay = Relay(proc, control, address, base_port)
        if impairment:
            relay.set(**impairment)
        return relay

    def down(self) -> None:
        destroy(self.prefix)

    def __enter__(self) -> NetLab:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    def command(self, i: int, argv: list[str]) -> list[str]:
        """`argv` wrapped to run inside node i's namespace."""
        return ["ip", "netns", "exec", self.namespaces[i], *argv]

    def exec(self, i: int, argv: list[str], *, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
        return _run(self.command(i, argv), check=check, timeout=timeout)

    def popen(self, i: int, argv: list[str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen(self.command(i, argv), **kwargs)

    def ping(self, i: int, address: str, *, count: int = 1, wait_s: float = 1.0) -> bool:
        """Whether node i gets an ICMP echo reply from `address` (this script's own ping: no iputils needed)."""
        argv = [sys.executable, os.path.abspath(__file__), "ping", address]
        argv += ["--count", str(count), "--wait", str(wait_s)]
        return self.exec(i, argv, check=False, timeout=count * wait_s + 10).returncode == 0

    def describe(self) -> dict:
        return {
            "prefix": self.prefix,
            "hub": self.hub,
            "subnet": str(self.subnet),
            "nodes": [{"namespace": ns, "address": a} for ns, a in zip(self.namespaces, self.addresses, strict=True)],
        }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Network namespaces on a bridge, for testing the mesh.")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="build a lab and print it as JSON")
    up.add_argument("n", type=int, help="number of namespaces")
    up.add_argument("--subnet", default=DEFAULT_SUBNET)
    up.add_argument("--rate", type=float, help="Mbit/s per link")
    up.add_argument("--delay", type=float, help="ms per direction (needs netem)")
    up.add_argument("--jitter", type=float, help="ms (needs netem)")
    up.add_argument("--loss", type=float, help="percent per direction (needs netem)")
    down = sub.add_parser("down", help="tear a lab down (every lab without a prefix)")
    down.add_argument("prefix", nargs="?")
    sub.add_parser("list", help="list lab namespaces")
    ping = sub.add_parser("ping", help="ICMP echo (exit 0 on a reply); used inside lab namespaces")
    ping.add_argument("address")
    ping.add_argument("--count", type=int, default=1)
    ping.add_argument("--wait", type=float, default=1.0, help="seconds to wait for each reply")
    args = parser.parse_args(argv)
    try:
        if args.command == "up":
            shaping = Shaping(args.rate, args.delay, args.jitter, args.loss)
            lab = NetLab(args.n, subnet=args.subnet, shaping=shaping if shaping.tc_args() else None)
            print(json.dumps(lab.up().describe(), indent=2))
        elif args.command == "down":
            removed = destroy(args.prefix)
            print(f"removed {len(removed)} namespaces" + (f": {' '.join(removed)}" if removed else ""))
        elif args.command == "ping":
            return 0 if icmp_ping(args.address, args.count, args.wait) else 1
        else:
            print("\n".join(list_namespaces()))
    except (LabError, ValueError) as e:
        print(f"netlab: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
