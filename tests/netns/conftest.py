"""Fixtures for the netns suite: a 3-namespace lab and a WireGuard mesh node (tests/netns/mesh_node.py) in each.

Every test here skips, with the reason, when the machine cannot run it: not root or no iproute2, and for the
mesh tests also no wireguard-go or no /dev/net/tun. The lab and the nodes are module-scoped (built once, about a
second), and torn down even when a test or the set-up itself fails.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import netlab  # scripts/, which tests/conftest.py puts on sys.path
import pytest
from gpuswarm.mesh import ipam
from gpuswarm.mesh.keys import KeyPair

HERE = Path(__file__).resolve().parent
MESH_CIDR = ipam.DEFAULT_CIDR
BASE_PORT = 51820


def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE not in Path(str(item.fspath)).resolve().parents:
            continue
        # Any fixture named after the mesh (mesh, mesh_swarm, mesh_lab) stands for real WireGuard.
        reason = netlab.unavailable_reason(wireguard=any("mesh" in name for name in getattr(item, "fixturenames", ())))
        if reason:
            item.add_marker(pytest.mark.skip(reason=f"netns tests: {reason}"))


class MeshNode:
    """The test's handle on one mesh_node.py process inside a lab namespace."""

    def __init__(self, lab: netlab.NetLab, index: int, keys: KeyPair, address: str, endpoint: str | None = None):
        self.index = index
        self.keys = keys
        self.address = address  # mesh address
        self.underlay = lab.addresses[index]
        self.port = BASE_PORT + index
        self._endpoint = endpoint  # where peers send to (the WAN relay's face for this node), if not its own
        self.proc = lab.popen(
            index,
            [sys.executable, str(HERE / "mesh_node.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )

    @property
    def endpoint(self) -> str:
        return self._endpoint or f"{self.underlay}:{self.port}"

    def peer_spec(self, **overrides) -> dict:
        spec = {"public_key": self.keys.public_key, "allowed_ips": [f"{self.address}/32"], "endpoint": self.endpoint}
        return {**spec, **overrides}

    def call(self, op: str, **args) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"mesh node {self.index} exited (code {self.proc.wait(5)})")
        return json.loads(line)

    def ok(self, op: str, **args) -> dict:
        reply = self.call(op, **args)
        if not reply.get("ok"):
            raise AssertionError(f"node {self.index} {op}: {reply.get('error')}")
        return reply

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()  # the node takes its interfaces down on end of input
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc.stdout.close()


@dataclass
class Mesh:
    lab: netlab.NetLab
    nodes: list[MeshNode]
    relay: netlab.Relay | None = None

    def desired_for(self, i: int) -> list[dict]:
        return [n.peer_spec() for n in self.nodes if n.index != i]

    def wait_ping(self, i: int, j: int, attempts: int = 3) -> bool:
        """Node i reaches node j's mesh address (the first packet may wait for a handshake)."""
        return any(self.lab.ping(i, self.nodes[j].address, wait_s=1.0) for _ in range(attempts))


@pytest.fixture(scope="module")
def lab():
    with netlab.NetLab(3) as built:
        yield built


@pytest.fixture(scope="module")
def mesh(lab):
    yield from _mesh(lab)


@pytest.fixture(scope="module")
def wan_mesh():
    """A 3-node WireGuard mesh whose every packet crosses the WAN relay (scripts/wanrelay.py) in the hub."""
    with netlab.NetLab(3) as lab:
        relay = lab.start_relay([BASE_PORT + i for i in range(3)])
        try:
            for mesh in _mesh(lab, relay):
                mesh.relay = relay
                yield mesh
        finally:
            relay.stop()


def _mesh(lab, relay=None):
    state = ipam.new_state(MESH_CIDR)
    nodes: list[MeshNode] = []
    try:
        for i in range(len(lab)):
            keys = KeyPair.generate()
            state, address = ipam.allocate(state, keys.public_key, now=time.time())
            nodes.append(MeshNode(lab, i, keys, address, relay.endpoint(i) if relay else None))
        for node in nodes:
            node.ok("up", address=node.address, cidr=MESH_CIDR, listen_port=node.port,
                    private_key=node.keys.private_key)
        built = Mesh(lab, nodes)
        for node in nodes:
            node.ok("reconcile", peers=built.desired_for(node.index))
        yield built
    finally:
        for node in nodes:
            node.stop()
