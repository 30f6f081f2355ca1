"""The node's link to the WireGuard mesh: its WireGuard key, the interface, and keeping peers and paths current.

Owns the node's WireGuard key file, bringing the interface up with the address the coordinator assigned,
turning the coordinator's peer list into `PeerConfig`s for `mesh.reconciler.MeshAgent`, the long-poll loop that
applies joins, leaves and revocations as the coordinator announces them, the path keeper, and `mesh.json` in the
state directory (what `gpuswarm mesh status` reads). Backend calls block (netlink, UAPI), so they run in a worker
thread.

Path choice: the coordinator's peer list is the source of each peer's candidate endpoints (its own report first,
then the address the coordinator saw it from). A new peer starts on its first candidate. The path keeper, a task
started with the interface (and stopped by `close()`), runs every `tick_s` (1 s): it sends an ICMP echo through
the tunnel to each peer whose path is on trial or due a probe (`mesh.probe.icmp_rtts`, all at once), reads each
peer's endpoint and latest handshake from the device, lets `mesh.paths.next_path` decide, and writes a changed
endpoint as a one-field per-peer update through the reconciler's `MeshAgent.apply` (never `replace_peers`, so sessions
survive). The rules (try the next candidate after 6 s without a handshake or echo, keep the lowest RTT, re-check
every 5 min, fail over after 3 lost echoes or 180 s without a handshake) and why are in `gpuswarm.mesh.paths`.
Each peer's path state, chosen endpoint and RTT go into mesh.json; `peer_rtts()` gives the RTTs by node id, and
`device_peers()` the device's latest per-peer handshake and byte counters (for metrics).

Relays: a peer the path keeper has found no path to for `UNREACHABLE_AFTER` seconds is reported in the heartbeat
(`unreachable_peers()`); the coordinator may answer with a relay (`MeshPeer.via`), and `gpuswarm.mesh.relays`
gives the AllowedIPs that route the peer through it. A relayed peer stays on the device without AllowedIPs, its
path on trial: echoes to it now travel through the relay (they measure the relayed RTT, shown in mesh.json, and
prove nothing about a direct path), so only a handshake settles it, and each new candidate endpoint gets a
keepalive "kick" (persistent keepalive off and on, which makes WireGuard send one) to start that handshake. Once a
direct handshake completes the peer is reachable again and the coordinator drops the relay. A node the coordinator
picks as a relay (`MeshConfig.forward`) forwards between its peers (`MeshBackend.set_forwarding`).

Supervision: the path keeper also checks every tick that the interface's process lives; when wireguard-go has
exited it brings the interface back (`MeshBackend.revive`) and applies every peer again on the endpoint its path
had, and mesh.json counts the restarts.
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
import time
from collections.abc import Callable
from pathlib import Path

from gpuswarm.mesh.backend import MeshBackend, PeerConfig, choose_backend
from gpuswarm.mesh.keys import load_or_create_private_key
from gpuswarm.mesh.paths import (
    PathFacts,
    PathPhase,
    PathState,
    PathTimings,
    next_path,
    start,
    wants_probe,
    with_candidates,
)
from gpuswarm.mesh.probe import icmp_rtts
from gpuswarm.mesh.reconciler import ChangeKind, MeshAgent, PeerChange
from gpuswarm.mesh.relays import allowed_ips
from gpuswarm.mesh.uapi import PeerStatus, normalize_endpoint
from gpuswarm.proto.models import MeshConfig, MeshPeer, MeshRegistration

logger = logging.getLogger(__name__)
SIOCGIFADDR = 0x8915
KEEPALIVE = 25  # seconds; keeps NAT mappings open and handshakes fresh (mesh.paths relies on it for staleness)
# A peer with no working path this long is reported unreachable (relay wanted): two candidate trials, so a peer
# that just joined or a path being failed over is not relayed for nothing.
UNREACHABLE_AFTER = 15.0
STATUS_EVERY = 5.0  # seconds between mesh.json rewrites for fresh RTTs alone (a path change writes at once)
Prober = Callable[[list[str], float], dict[str, float | None]]  # (mesh addresses, wait) -> seconds or None


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


def candidate_endpoints(peer: MeshPeer) -> list[str]:
    """The peer's candidates as the device writes endpoints (canonical IP:port); names the UAPI cannot take are
    skipped."""
    found = []
    for endpoint in peer.endpoints:
        try:
            found.append(normalize_endpoint(endpoint))
        except ValueError:
            logger.debug("peer %s: endpoint %r is not IP:port; skipped", peer.node_id, endpoint)
    return list(dict.fromkeys(found))


class MeshLink:
    def __init__(self, state_dir: Path, listen_port: int, endpoints: list[str] | None = None,
                 backend: MeshBackend | None = None, *, timings: PathTimings | None = None,
                 prober: Prober | None = None, tick_s: float = 1.0, probe_wait_s: float = 1.0):
        """`timings`, `prober` (ICMP through the tunnel by default), `tick_s` and `probe_wait_s` drive the path
        keeper; tests shrink them."""
        self.state_dir, self.listen_port = state_dir, listen_port
        self.keys = load_or_create_private_key(state_dir / "wireguard.key")
        self._endpoints = endpoints
        self._backend = backend
        self.agent: MeshAgent | None = None
        self.config: MeshConfig | None = None
        self.timings = timings or PathTimings()
        self.tick_s, self.probe_wait_s = tick_s, probe_wait_s
        self._prober = prober or icmp_rtts
        self._probing = True  # off when raw sockets are refused: paths are then judged by handshakes alone
        self._peers: dict[str, MeshPeer] = {}  # by WireGuard public key
        self._paths: dict[str, PathState] = {}
        self._routes: dict[str, frozenset[str]] = {}  # AllowedIPs by public key (`mesh.relays.allowed_ips`)
        self._via: dict[str, str] = {}  # relayed peers: public key -> the relay's node id
        self._relay_rtts: dict[str, float] = {}  # relayed peers: the RTT in ms through the relay
        self._unsettled_since: dict[str, float] = {}  # peers with no working path: since when
        self._forwarding = False
        self._device_peers: dict[str, PeerStatus] = {}  # the path keeper's latest device read, by public key
        self._lock = asyncio.Lock()  # apply() and the path keeper both change peers' endpoints
        self._paths_task: asyncio.Task | None = None
        self._status_written = 0.0
        self._status_signature: object = None
        self.restarts = 0  # times the supervisor brought the interface back

    @property
    def address(self) -> str | None:
        return self.config.address if self.config else None

    async def registration(self) -> MeshRegistration:
        endpoints = self._endpoints or local_endpoints(self.listen_port)
        return MeshRegistration(public_key=self.keys.public_key, listen_port=self.listen_port, endpoints=endpoints)

    def peer_rtts(self) -> dict[str, float]:
        """{peer node id: RTT in ms over its settled path, or through its relay}, for the peers with a measured
        RTT (the coordinator's relay plan never takes a relayed RTT for a direct path: that pair is also reported
        unreachable)."""
        found = {key: state.rtt_ms for key, state in self._paths.items() if state.rtt_ms is not None}
        found.update({key: rtt for key, rtt in self._relay_rtts.items() if key in self._via})
        return {self._peers[key].node_id: round(rtt, 3) for key, rtt in found.items() if key in self._peers}

    def unreachable_peers(self, now: float | None = None) -> list[str]:
        """The node ids of peers with no working path for `UNREACHABLE_AFTER` seconds or more."""
        now = time.time() if now is None else now
        return sorted(self._peers[key].node_id for key, since in self._unsettled_since.items()
                      if now - since >= UNREACHABLE_AFTER and key in self._peers)

    def device_peers(self) -> dict[str, PeerStatus]:
        """{peer node id: the device's view of it (latest handshake, rx/tx bytes)} as of the path keeper's latest
        read, at most `tick_s` old; read-only, for metrics."""
        return {self._peers[key].node_id: status for key, status in self._device_peers.items() if key in self._peers}

    async def apply(self, config: MeshConfig) -> None:
        """Bring the interface up on first use (and start the path keeper), then make its peers exactly
        `config.peers`."""
        async with self._lock:
            await self._apply(config)
        if self._paths_task is None:
            self._paths_task = asyncio.create_task(self._keep_paths(), name="mesh-paths")

    async def _apply(self, config: MeshConfig) -> None:
        if self.agent is None:
            try:
                # Held before `up` returns: a stop that cuts this short must still take down what `up` started
                # (`close`; wireguard-go does not die with the daemon).
                self._backend = backend = self._backend or choose_backend()
                await asyncio.to_thread(backend.up, config.address, config.cidr, self.listen_port,
                                        self.keys.private_key)
            except Exception as e:
                raise MeshUnavailable(f"cannot bring up the WireGuard interface: {e}. The mesh needs root and "
                                      "wireguard-go (or the wireguard kernel module); --no-mesh runs without it, "
                                      "unencrypted") from e
            self.agent = MeshAgent(backend)
            logger.info("mesh interface %s up (%s) at %s, port %d", backend.interface, backend.kind,
                        config.address, self.listen_port)
        # A new peer starts on its first candidate. For a known peer the path keeper owns the endpoint: None
        # ("no opinion") leaves the device's alone, unless the peer's new candidates no longer hold the one in use.
        now = time.time()
        self._routes = allowed_ips(config)
        by_id = {p.node_id: p for p in config.peers}
        self._via = {p.public_key: p.via for p in config.peers if p.via and not self._routes[p.public_key]
                     and p.via in by_id}
        desired, paths = [], {}
        for p in config.peers:
            old = self._paths.get(p.public_key)
            new = start(candidate_endpoints(p), now) if old is None else \
                with_candidates(old, candidate_endpoints(p), now)
            paths[p.public_key] = new
            desired.append(self._peer_config(p, new.endpoint if old is None or new.endpoint != old.endpoint
                                             else None))
        if config.forward != self._forwarding:
            await asyncio.to_thread(self._backend.set_forwarding, config.forward, config.cidr)
            self._forwarding = config.forward
            logger.info("mesh: %s forwarding between peers", "relaying: started" if config.forward else
                        "no longer relaying: stopped")
        changes = await asyncio.to_thread(self.agent.reconcile, desired)
        if changes:
            summary = ", ".join(f"{c.kind.value} {c.public_key[:8]}" for c in changes)
            logger.info("mesh v%d: %s", config.version, summary)
        self.config = config
        self._peers = {p.public_key: p for p in config.peers}
        self._paths = paths
        self._unsettled_since = {k: v for k, v in self._unsettled_since.items() if k in paths}
        self._relay_rtts = {k: v for k, v in self._relay_rtts.items() if k in self._via}
        self._write_status_file(force=True)

    def _peer_config(self, peer: MeshPeer, endpoint: str | None, keepalive: int = KEEPALIVE) -> PeerConfig:
        return PeerConfig(public_key=peer.public_key, allowed_ips=self._routes.get(peer.public_key, frozenset()),
                          endpoint=endpoint, persistent_keepalive=keepalive)

    def _kick(self, peer: MeshPeer) -> None:
        """Make WireGuard start a handshake with a relayed peer on its current endpoint: no traffic goes to it
        directly, so nothing else would. Switching persistent keepalive on sends one keepalive at once."""
        for keepalive in (0, KEEPALIVE):
            self.agent.apply(PeerChange(ChangeKind.UPDATE, peer.public_key, self._peer_config(peer, None, keepalive),
                                        frozenset({"persistent_keepalive"})))

    async def _keep_paths(self) -> None:
        """The path keeper: one `_check_paths` every `tick_s` until cancelled; a failed round never ends it."""
        failures = 0
        while True:
            started = time.monotonic()
            try:
                if not self._backend.is_running():
                    await self._revive()
                await self._check_paths()
                failures = 0
            except asyncio.CancelledError:
                raise
            except Exception as e:
                failures += 1
                if failures in (1, 10) or failures % 100 == 0:  # a gone device would otherwise flood the log
                    logger.warning("mesh path check failed (%d in a row): %s", failures, e)
            await asyncio.sleep(max(0.0, self.tick_s - (time.monotonic() - started)))

    async def _revive(self) -> None:
        """The supervisor: wireguard-go died, so start it again and put every peer back on its path's endpoint
        (setting the keepalive sends one at once, so handshakes resume within a second or two)."""
        async with self._lock:
            if not await asyncio.to_thread(self._backend.revive):
                return
            desired = [self._peer_config(self._peers[key], state.endpoint) for key, state in self._paths.items()
                       if key in self._peers]
            await asyncio.to_thread(self.agent.reconcile, desired)
            if self._forwarding:
                await asyncio.to_thread(self._backend.set_forwarding, True, self.config.cidr)
            self.restarts += 1
            logger.warning("mesh interface %s restarted (%d so far); %d peer(s) applied again",
                           self._backend.interface, self.restarts, len(desired))
            self._write_status_file(force=True)

    async def _probe(self, due: dict[str, PathState]) -> tuple[bool, dict[str, float]]:
        """Echo the due peers through the tunnel: (whether echoes went out, RTT in ms by public key of those that
        answered)."""
        if not due or not self._probing:
            return False, {}
        addresses = {key: self._peers[key].address for key in due if key in self._peers}
        try:
            found = await asyncio.to_thread(self._prober, sorted(set(addresses.values())), self.probe_wait_s)
        except PermissionError as e:
            self._probing = False
            logger.warning("no raw ICMP socket (%s): mesh paths are judged by handshakes alone, without RTTs", e)
            return False, {}
        except OSError as e:  # this round learns nothing from echoes; the next one tries again
            logger.warning("mesh path probe failed: %s", e)
            return False, {}
        return True, {key: found[a] * 1000 for key, a in addresses.items() if found.get(a) is not None}

    async def _check_paths(self) -> None:
        """One round: probe the peers that are due, read the device, step each peer's path, apply new endpoints."""
        due = {key: state for key, state in self._paths.items()
               if wants_probe(state, time.time(), self.timings)}
        probed, rtts = await self._probe(due)
        async with self._lock:
            device = {p.public_key: p for p in (await asyncio.to_thread(self._backend.status)).peers}
            self._device_peers = device
            now = time.time()
            for key, state in list(self._paths.items()):
                peer, info = device.get(key), self._peers.get(key)
                if peer is None or info is None:
                    continue  # not on the device (yet): the next reconcile adds it
                # An echo counts only if it went out over the endpoint this state has (apply() may have moved it),
                # and never for a relayed peer: it went through the relay.
                was_probed = probed and due.get(key) is state
                relayed = key in self._via
                if relayed and was_probed and key in rtts:
                    self._relay_rtts[key] = rtts[key]
                was_probed = was_probed and not relayed
                facts = PathFacts(now=now, device_endpoint=peer.endpoint, latest_handshake=peer.latest_handshake,
                                  probed=was_probed, rtt_ms=rtts.get(key) if was_probed else None)
                new = next_path(state, facts, self.timings)
                if new.endpoint is not None and new.endpoint != peer.endpoint:
                    change = PeerChange(ChangeKind.UPDATE, key, self._peer_config(info, new.endpoint),
                                        frozenset({"endpoint"}))
                    try:
                        await asyncio.to_thread(self.agent.apply, change)
                    except Exception as e:  # keep the old state: the next round decides again
                        logger.warning("mesh: cannot set %s's endpoint to %s: %s", info.node_id, new.endpoint, e)
                        continue
                if relayed and new.phase is PathPhase.TRYING and new.since != state.since:
                    try:  # a new trial of a direct path
                        await asyncio.to_thread(self._kick, info)
                    except Exception as e:
                        logger.debug("mesh: cannot start a handshake with %s: %s", info.node_id, e)
                self._log_path(info, state, new)
                self._paths[key] = new
                if new.phase is PathPhase.TRYING:
                    self._unsettled_since.setdefault(key, now)
                else:
                    self._unsettled_since.pop(key, None)
            self._write_status_file()

    @staticmethod
    def _log_path(peer: MeshPeer, old: PathState, new: PathState) -> None:
        if (new.phase, new.endpoint) == (old.phase, old.endpoint):
            return
        # Trials and settling on a new path are news; the re-check's trips to other candidates are not.
        important = new.phase is PathPhase.TRYING or (new.phase is PathPhase.SETTLED and new.endpoint != old.chosen)
        logger.log(logging.INFO if important else logging.DEBUG, "mesh path to %s: %s %s (%s)", peer.node_id,
                   new.phase.value, new.endpoint, new.reason)

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
                    async with asyncio.timeout(2.0):
                        await stop.wait()

    def _path_status(self, key: str) -> dict | None:
        state = self._paths.get(key)
        if state is None:
            return None
        via = self._via.get(key)
        return {"state": state.phase.value, "endpoint": state.endpoint, "candidates": list(state.candidates),
                "via": via, "relay_rtt_ms": round(self._relay_rtts[key], 3) if via and key in self._relay_rtts
                else None,
                "candidate": state.candidates.index(state.endpoint) + 1 if state.endpoint in state.candidates
                else None,
                "rtt_ms": None if state.rtt_ms is None else round(state.rtt_ms, 3),
                "rtts_ms": {k: round(v, 3) for k, v in state.rtts.items()}, "since": round(state.since, 3),
                "reason": state.reason}

    def _write_status_file(self, force: bool = False) -> None:
        """mesh.json: at once when a peer or a path changed, otherwise every STATUS_EVERY s for fresh RTTs."""
        signature = (tuple((k, s.phase, s.endpoint) for k, s in sorted(self._paths.items())),
                     tuple(sorted(self._via.items())), self._forwarding)
        if not force and signature == self._status_signature and \
                time.monotonic() - self._status_written < STATUS_EVERY:
            return
        status = {"interface": self._backend.interface, "backend": self._backend.kind, "address": self.address,
                  "cidr": self.config.cidr, "listen_port": self.listen_port, "version": self.config.version,
                  "restarts": self.restarts, "forwarding": self._forwarding,
                  "updated_at": round(time.time(), 3),
                  "peers": {p.public_key: {"node_id": p.node_id, "address": p.address, "endpoints": p.endpoints,
                                           "path": self._path_status(p.public_key)}
                            for p in self.config.peers}}
        tmp = self.state_dir / "mesh.json.tmp"
        tmp.write_text(json.dumps(status, indent=2))
        tmp.replace(self.state_dir / "mesh.json")
        self._status_signature, self._status_written = signature, time.monotonic()

    async def stop_keeping(self) -> None:
        """Stop the path keeper (and with it the supervisor): a node shutting down must not bring back a
        wireguard-go that the same SIGTERM stopped."""
        if self._paths_task is not None:
            self._paths_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                async with asyncio.timeout(5.0):
                    await self._paths_task
            self._paths_task = None

    async def close(self) -> None:
        await self.stop_keeping()
        if self._forwarding:
            with contextlib.suppress(Exception):  # the rule is harmless once its interface is gone
                await asyncio.to_thread(self._backend.set_forwarding, False, self.config.cidr)
        if self._backend is not None:  # down is idempotent, and waits for an `up` still under way
            await asyncio.to_thread(self._backend.down)
            logger.info("mesh interface %s down", self._backend.interface)
