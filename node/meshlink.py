"""The node's link to the WireGuard mesh: its WireGuard key, the interface, and keeping peers current.

Owns the node's WireGuard key file, bringing the interface up with the address the coordinator assigned,
turning the coordinator's peer list into `PeerConfig`s for `mesh.reconciler.MeshAgent`, the long-poll loop that
applies joins, leaves and revocations as the coordinator announces them, and `mesh.json` in the state directory
(what `gpuswarm mesh status` reads). Backend calls block (netlink, UAPI), so they run in a worker thread.

Path choice is simple for now: a peer's first candidate endpoint (its own report first, then the address the
coordinator saw it from). Probing candidates by handshake and RTT is not built yet.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import ipaddress
import json
import logging
import socket
import struct
from pathlib import Path

from gpuswarm.mesh.backend import MeshBackend, PeerConfig, choose_backend
from gpuswarm.mesh.keys import load_or_create_private_key
from gpuswarm.mesh.reconciler import MeshAgent
from gpuswarm.proto.models import MeshConfig, MeshRegistration

logger = logging.getLogger(__name__)
SIOCGIFADDR = 0x8915
KEEPALIVE = 25  # seconds; keeps NAT mappings open and handshakes fresh for status


class MeshUnavailable(RuntimeError):
    """The mesh cannot run here (no root, no wireguard-go, no kernel module)."""


def local_endpoints(port: int) -> list[str]:
    """This host's IPv4 addresses (one per interface; not loopback, not our own mesh interfaces) with `port`.

    Plain ioctls, no netlink library: it runs every few seconds on the daemon's event loop, and must never block."""
    found = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            if name.startswith("gs"):
                continue
            try:
                packed = fcntl.ioctl(sock.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on this interface
                continue
            ip = socket.inet_ntoa(packed[20:24])
            if not ipaddress.ip_address(ip).is_loopback:
                found.append(f"{ip}:{port}")
    return found


class MeshLink:
    def __init__(self, state_dir: Path, listen_port: int, endpoints: list[str] | None = None,
                 backend: MeshBackend | None = None):
        self.state_dir, self.listen_port = state_dir, listen_port
        self.keys = load_or_create_private_key(state_dir / "wireguard.key")
        self._endpoints = endpoints
        self._backend = backend
        self.agent: MeshAgent | None = None
        self.config: MeshConfig | None = None

    @property
    def address(self) -> str | None:
        return self.config.address if self.config else None

    async def registration(self) -> MeshRegistration:
        endpoints = self._endpoints or local_endpoints(self.listen_port)
        return MeshRegistration(public_key=self.keys.public_key, listen_port=self.listen_port, endpoints=endpoints)

    async def apply(self, config: MeshConfig) -> None:
        """Bring the interface up on first use, then make its peers exactly `config.peers`."""
        if self.agent is None:
            try:
                backend = self._backend or choose_backend()
                await asyncio.to_thread(backend.up, config.address, config.cidr, self.listen_port,
                                        self.keys.private_key)
            except Exception as e:
                raise MeshUnavailable(f"cannot bring up the WireGuard interface: {e}. The mesh needs root and "
                                      "wireguard-go (or the wireguard kernel module); --no-mesh runs without it, "
                                      "unencrypted") from e
            self._backend, self.agent = backend, MeshAgent(backend)
            logger.info("mesh interface %s up (%s) at %s, port %d", backend.interface, backend.kind,
                        config.address, self.listen_port)
        desired = [PeerConfig(public_key=p.public_key, allowed_ips=frozenset({f"{p.address}/32"}),
                              endpoint=p.endpoints[0] if p.endpoints else None, persistent_keepalive=KEEPALIVE)
                   for p in config.peers]
        changes = await asyncio.to_thread(self.agent.reconcile, desired)
        if changes:
            summary = ", ".join(f"{c.kind.value} {c.public_key[:8]}" for c in changes)
            logger.info("mesh v%d: %s", config.version, summary)
        self.config = config
        self._write_status_file()

    async def follow(self, client, stop: asyncio.Event) -> None:
        """Long-poll the coordinator for peer changes until `stop`; errors back off and never end the loop."""
        while not stop.is_set():
            try:
                config = await client.mesh_peers(self.config.version if self.config else -1)
                if self.config is None or config.version != self.config.version:
                    await self.apply(config)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                logger.warning("mesh update failed (%s); retrying", e)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=2.0)

    def _write_status_file(self) -> None:
        status = {"interface": self._backend.interface, "backend": self._backend.kind, "address": self.address,
                  "cidr": self.config.cidr, "listen_port": self.listen_port, "version": self.config.version,
                  "peers": {p.public_key: {"node_id": p.node_id, "address": p.address, "endpoints": p.endpoints}
                            for p in self.config.peers}}
        tmp = self.state_dir / "mesh.json.tmp"
        tmp.write_text(json.dumps(status, indent=2))
        tmp.replace(self.state_dir / "mesh.json")

    async def close(self) -> None:
        if self._backend is not None and self.agent is not None:
            await asyncio.to_thread(self._backend.down)
            logger.info("mesh interface %s down", self._backend.interface)
