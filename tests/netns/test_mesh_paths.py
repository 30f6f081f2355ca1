"""Path choice and failover with real wireguard-go: the node's `MeshLink` (path keeper included) in two namespaces.

Both namespaces sit on two networks (10.250.0.0/24, the lab's, and 10.251.0.0/24 added here), and each node is
handed the other as a peer with three candidate endpoints: an address nobody answers on, its 10.250 address, then
its 10.251 address. They must converge on the second candidate; when the 10.250 network is cut (the address is
removed in one namespace), traffic must resume over the third.

Each node is this file run as a script inside its namespace (`serve`): a real MeshLink with a UserspaceBackend,
fed MeshConfigs as JSON lines on stdin, as the daemon feeds it the coordinator's. The test reads what the node
writes to mesh.json, asks the WireGuard device itself, and pings over the mesh addresses.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.timeout(90), pytest.mark.keep_processes]  # the module fixture stops its nodes

HERE = Path(__file__).resolve()
PORT = 51820
CIDR = "10.77.0.0/16"
DEAD = "10.250.0.99"  # in the lab's subnet, held by nobody: ARP fails and WireGuard's packets vanish
SECOND_NET = "10.251.0.{}/24"
TIMINGS = {"try_timeout_s": 6.0, "check_timeout_s": 1.0, "probe_interval_s": 1.0, "lost_probes": 2,
           "stale_after_s": 180.0, "recheck_s": 3600.0}


def serve(state_dir: str, timings: str) -> None:
    """A mesh node: MeshLink with real wireguard-go; each stdin line is a MeshConfig to apply, EOF stops it."""
    import logging

    from gpuswarm.mesh.backend import UserspaceBackend
    from gpuswarm.mesh.paths import PathTimings
    from gpuswarm.node.meshlink import MeshLink
    from gpuswarm.proto.models import MeshConfig

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")

    async def main() -> None:
        link = MeshLink(Path(state_dir), PORT, backend=UserspaceBackend(stop_timeout=2.0),
                        timings=PathTimings(**json.loads(timings)), tick_s=0.5, probe_wait_s=0.5)
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        try:
            while not stop.is_set():
                reader = asyncio.ensure_future(asyncio.to_thread(sys.stdin.readline))
                waiter = asyncio.ensure_future(stop.wait())
                await asyncio.wait({reader, waiter}, return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                if not reader.done() or not (line := reader.result()):
                    break
                await link.apply(MeshConfig.model_validate_json(line))
                print(json.dumps({"ok": True, "interface": link._backend.interface}), flush=True)
        finally:
            await link.close()

    asyncio.run(main())


class Node:
    def __init__(self, lab, index: int, root: Path):
        from gpuswarm.mesh.keys import load_or_create_private_key

        self.lab, self.index = lab, index
        self.state_dir = root / f"node-{index}"
        self.keys = load_or_create_private_key(self.state_dir / "wireguard.key")
        self.address = f"10.77.0.{index + 1}"
        self.node_id = f"{index + 1:016x}"
        self.underlay = [lab.addresses[index], SECOND_NET.format(index + 1).split("/")[0]]
        self.log_path = root / f"node-{index}.log"
        with open(self.log_path, "wb") as log:
            self.proc = lab.popen(index, [sys.executable, str(HERE), "serve", str(self.state_dir), json.dumps(TIMINGS)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, bufsize=1)

    def candidates(self) -> list[str]:
        return [f"{DEAD}:{PORT}"] + [f"{a}:{PORT}" for a in self.underlay]

    def apply(self, peer: Node, version: int) -> dict:
        config = {"address": self.address, "cidr": CIDR, "version": version, "peers": [
            {"node_id": peer.node_id, "public_key": peer.keys.public_key, "address": peer.address,
             "endpoints": peer.candidates()}]}
        self.proc.stdin.write(json.dumps(config) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"node {self.index} exited: {self.log()[-2000:]}")
        return json.loads(line)

    def path_to(self, peer: Node) -> dict:
        try:
            state = json.loads((self.state_dir / "mesh.json").read_text())
        except (OSError, ValueError):
            return {}
        return state["peers"].get(peer.keys.public_key, {}).get("path") or {}

    def device_endpoint(self, peer: Node) -> str | None:
        from gpuswarm.mesh.uapi import UAPIClient

        interface = json.loads((self.state_dir / "mesh.json").read_text())["interface"]
        found = UAPIClient.for_interface(interface).get().peer(peer.keys.public_key)
        return found.endpoint if found else None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()  # the node takes its interface down on end of input
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc.stdout.close()


def wait_for(condition, timeout: float, what: str, nodes: list[Node]):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    logs = "\n".join(f"--- node {n.index}\n{n.log()[-3000:]}" for n in nodes)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}\n{logs}")


@pytest.fixture(scope="module")
def pair(tmp_path_factory, mesh_lab):
    a, b = nodes = [Node(mesh_lab, i, tmp_path_factory.mktemp("paths")) for i in range(2)]
    try:
        assert a.apply(b, 1)["ok"] and b.apply(a, 1)["ok"]
        yield a, b
    finally:
        for node in nodes:
            node.stop()


@pytest.fixture(scope="module")
def mesh_lab():
    import netlab

    with netlab.NetLab(2) as lab:
        for i in range(2):
            lab.exec(i, ["ip", "addr", "add", SECOND_NET.format(i + 1), "dev", "eth0"])
        yield lab


def test_dead_first_candidate_converges_on_the_second(pair):
    a, b = pair
    started = time.monotonic()
    second = f"{b.underlay[0]}:{PORT}"
    wait_for(lambda: a.path_to(b).get("state") == "settled" and b.path_to(a).get("state") == "settled", 40,
             "both nodes to settle a path", [a, b])
    took = time.monotonic() - started
    path = a.path_to(b)
    assert path["endpoint"] == second and path["candidate"] == 2, path
    assert a.device_endpoint(b) == second
    assert b.path_to(a)["endpoint"] == f"{a.underlay[0]}:{PORT}"
    # The dead candidate was tried first, and given up on after the deadline.
    assert f"no answer from {DEAD}:{PORT} within 6 s" in a.log() + b.log()
    assert a.lab.ping(0, b.address, count=3) and b.lab.ping(1, a.address, count=3)
    wait_for(lambda: a.path_to(b).get("rtt_ms") is not None, 10, "an RTT over the settled path", [a, b])
    print(f"converged in {took:.1f} s; RTT {a.path_to(b)['rtt_ms']} ms")


def test_failover_when_the_chosen_path_dies(pair):
    a, b = pair
    first, third = f"{b.underlay[0]}:{PORT}", f"{b.underlay[1]}:{PORT}"
    assert a.path_to(b)["endpoint"] == first
    # Cut the 10.250 network between them: b loses its address there (and with it its route to a's).
    b.lab.exec(1, ["ip", "addr", "del", f"{b.underlay[0]}/24", "dev", "eth0"])
    started = time.monotonic()
    wait_for(lambda: a.path_to(b).get("state") == "settled" and a.path_to(b).get("endpoint") == third, 30,
             "a to fail over to b's third candidate", [a, b])
    took = time.monotonic() - started
    assert a.device_endpoint(b) == third
    assert a.lab.ping(0, b.address, count=3), "no traffic over the new path"
    wait_for(lambda: b.path_to(a).get("state") == "settled"
             and b.path_to(a).get("endpoint") == f"{a.underlay[1]}:{PORT}", 30, "b to fail over too", [a, b])
    assert b.lab.ping(1, a.address, count=3)
    print(f"failed over in {took:.1f} s")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "serve":
        serve(sys.argv[2], sys.argv[3])
    else:
        sys.exit(f"usage: {sys.argv[0]} serve STATE_DIR TIMINGS_JSON")
