"""Mesh backends: one small interface (`MeshBackend`) over the two ways to run a WireGuard interface.

- `UserspaceBackend` spawns `wireguard-go -f IFACE` as a child process (foreground: its self-daemonising mode
  failed on our machines), waits for its UAPI socket, configures it through `gpuswarm.mesh.uapi` (incremental per
  peer, never `replace_peers`), and sets the address and link state with pyroute2 (netlink, no `ip` commands).
  It works inside a network namespace: everything it does acts on the namespace the process runs in.
  If wireguard-go exits on its own, its TUN device, and so the interface, go with it: `is_running()` turns
  False, and every later call but `down()` and `revive()` raises BackendError with the exit code and the tail of
  wireguard-go's output. `revive()` starts it again with the same key, port, address and MTU; the peers are the
  caller's to apply again (the node's supervisor, the path keeper in `gpuswarm.node.meshlink`, does both).
- `KernelBackend` drives the in-kernel WireGuard through pyroute2's netlink support. Minimal, and NOT exercised
  by the test suite: the development and CI machines have no wireguard kernel module.

`choose_backend()` picks one (kernel only where the module is loaded) and logs which. Owns the interface and the
wireguard-go process; does not decide which peers should exist (that is the reconciler's) nor allocate addresses
(IPAM's). All methods block (netlink, a unix socket, process waits); async callers use `asyncio.to_thread`.

Relaying (`MeshBackend.set_forwarding`, for a node the coordinator chose to relay between two peers that have no
direct path): IPv4 forwarding on this interface alone, and only back into the mesh. Packets that arrive on the
interface are looked up in a table of their own (a policy rule on the input interface) that holds the mesh route
and an `unreachable` default, so a peer can never use a relay to reach its LAN or the internet; local delivery
(the local table comes first) is unchanged.
"""

from __future__ import annotations

import abc
import asyncio
import base64
import concurrent.futures
import contextlib
import fcntl
import ipaddress
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import zlib
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from gpuswarm.mesh.keys import validate_key
from gpuswarm.mesh.uapi import (
    UAPI_DIR,
    DeviceStatus,
    PeerStatus,
    UAPIClient,
    UAPIConnectionError,
    UAPIError,
    normalize_allowed_ip,
    normalize_endpoint,
    socket_path,
)

logger = logging.getLogger(__name__)

PEER_FIELDS = frozenset({"endpoint", "allowed_ips", "persistent_keepalive"})
RELAY_RULE_PRIORITY = 100  # before the main table (32766): packets from the mesh never reach its default route
INTERFACE_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,15}$")  # IFNAMSIZ - 1
T = TypeVar("T")


class BackendError(RuntimeError):
    """The WireGuard interface could not be brought up, configured, read or is gone."""


def new_interface_name() -> str:
    """`gs` + 6 hex characters: UAPI sockets in /var/run/wireguard are shared by all namespaces of a host."""
    return "gs" + secrets.token_hex(3)


@dataclass(frozen=True)
class PeerConfig:
    """One peer as the mesh wants it. Normalised on construction, so equal configs compare equal.

    `endpoint=None` means "no opinion": the backend keeps whatever endpoint the device has (set earlier or learnt
    by roaming). `persistent_keepalive` is in seconds, 0 = off.
    """

    public_key: str
    allowed_ips: frozenset[str]
    endpoint: str | None = None
    persistent_keepalive: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "public_key", validate_key(self.public_key))
        if isinstance(self.allowed_ips, str):
            raise ValueError("allowed_ips is a collection of CIDRs, not one string")
        object.__setattr__(self, "allowed_ips", frozenset(normalize_allowed_ip(ip) for ip in self.allowed_ips))
        if self.endpoint is not None:
            object.__setattr__(self, "endpoint", normalize_endpoint(self.endpoint))
        keepalive = self.persistent_keepalive
        if isinstance(keepalive, bool) or not isinstance(keepalive, int) or not 0 <= keepalive <= 65535:
            raise ValueError(f"persistent_keepalive must be 0..65535 seconds, not {keepalive!r}")

    @classmethod
    def from_status(cls, peer: PeerStatus) -> PeerConfig:
        return cls(peer.public_key, frozenset(peer.allowed_ips), peer.endpoint, peer.persistent_keepalive)


def _interface_address(address: str, cidr: str) -> tuple[str, int]:
    try:
        net = ipaddress.ip_network(cidr, strict=True)
        ip = ipaddress.ip_address(address)
    except ValueError as e:
        raise ValueError(f"bad mesh address {address!r} or CIDR {cidr!r}: {e}") from None
    if ip not in net or ip in (net.network_address, net.broadcast_address):
        raise ValueError(f"mesh address {address} is not a host address of {cidr}")
    return str(ip), net.prefixlen


def _check_port(listen_port: int) -> None:
    if isinstance(listen_port, bool) or not isinstance(listen_port, int) or not 0 <= listen_port <= 65535:
        raise ValueError(f"listen_port must be 0..65535, not {listen_port!r}")


def _check_fields(fields: Collection[str] | None) -> frozenset[str]:
    if fields is None:
        return PEER_FIELDS
    unknown = set(fields) - PEER_FIELDS
    if unknown:
        raise ValueError(f"unknown peer fields {sorted(unknown)}; known: {sorted(PEER_FIELDS)}")
    return frozenset(fields)


def _off_loop(fn: Callable[[], T]) -> T:
    """Run a pyroute2 call where it works: pyroute2 0.9's sync API fails in a thread with a running asyncio loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return fn()
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(fn).result()


def _configure_link(interface: str, address: str, prefixlen: int, mtu: int | None) -> None:
    from pyroute2 import IPRoute
    from pyroute2.netlink.exceptions import NetlinkError

    def apply() -> None:
        with IPRoute() as ipr:
            found = ipr.link_lookup(ifname=interface)
            if not found:
                raise BackendError(f"interface {interface} does not exist in this network namespace")
            index = found[0]
            try:
                ipr.addr("add", index=index, address=address, prefixlen=prefixlen)
            except NetlinkError as e:
                if e.code != 17:  # EEXIST: the address is already there, which is what we want
                    raise BackendError(f"cannot add {address}/{prefixlen} to {interface}: {e}") from None
            try:
                if mtu is not None:
                    ipr.link("set", index=index, mtu=mtu)
                ipr.link("set", index=index, state="up")
            except NetlinkError as e:
                raise BackendError(f"cannot bring {interface} up: {e}") from None

    _off_loop(apply)


def _relay_table(interface: str) -> int:
    """The routing table of the interface's relay rule: stable per name (the ifindex changes when wireguard-go
    is restarted), clear of the reserved tables (253-255)."""
    return 0x10000000 + zlib.crc32(interface.encode()) % 0x0FFFFFFF


def _set_forwarding(interface: str, on: bool, cidr: str) -> None:
    from pyroute2 import IPRoute
    from pyroute2.netlink.exceptions import NetlinkError

    net = ipaddress.ip_network(cidr, strict=True)
    table = _relay_table(interface)
    sysctl = Path(f"/proc/sys/net/ipv4/conf/{interface}/forwarding")

    def apply() -> None:
        with IPRoute() as ipr:
            found = ipr.link_lookup(ifname=interface)
            if not on:
                if found:
                    sysctl.write_text("0")
                with contextlib.suppress(NetlinkError):  # ENOENT: no rule, already off
                    ipr.rule("del", table=table, priority=RELAY_RULE_PRIORITY, iifname=interface)
                ipr.flush_routes(table=table)
                return
            if not found:
                raise BackendError(f"interface {interface} does not exist in this network namespace")
            try:
                ipr.route("replace", dst=str(net.network_address), dst_len=net.prefixlen, oif=found[0], table=table)
                ipr.route("replace", dst="0.0.0.0", dst_len=0, type="unreachable", table=table)
                rules = [r for r in ipr.get_rules(family=socket.AF_INET)
                         if r.get_attr("FRA_TABLE") == table and r.get_attr("FRA_IIFNAME") == interface]
                if not rules:
                    ipr.rule("add", table=table, priority=RELAY_RULE_PRIORITY, iifname=interface)
            except NetlinkError as e:
                raise BackendError(f"cannot set up relay routing on {interface}: {e}") from None
            sysctl.write_text("1")

    try:
        _off_loop(apply)
    except OSError as e:
        raise BackendError(f"cannot {'enable' if on else 'disable'} forwarding on {interface}: {e}") from None


class MeshBackend(abc.ABC):
    """A WireGuard interface the node owns. Peers are changed one at a time; nothing ever replaces them all."""

    kind: ClassVar[str]
    interface: str

    @abc.abstractmethod
    def up(self, address: str, cidr: str, listen_port: int, private_key: str) -> None:
        """Create the interface with `private_key`, listening on `listen_port` (0 = any), with `address` on the
        mesh network `cidr`, and bring it up. Raises BackendError (after cleaning up) if any step fails."""

    @abc.abstractmethod
    def add_or_update_peer(self, peer: PeerConfig, fields: Collection[str] | None = None) -> None:
        """Create the peer, or update the given `fields` ("endpoint", "allowed_ips", "persistent_keepalive";
        None = all) of an existing one without disturbing its session. An endpoint of None is left alone."""

    @abc.abstractmethod
    def remove_peer(self, public_key: str) -> None:
        """Remove one peer; a peer that is not there is not an error."""

    @abc.abstractmethod
    def status(self) -> DeviceStatus:
        """The device as it is now: its public key, port and peers with endpoints, handshakes and byte counts."""

    @abc.abstractmethod
    def down(self, timeout: float = 5.0) -> None:
        """Remove the interface, within about `timeout` seconds. Idempotent."""

    @abc.abstractmethod
    def is_running(self) -> bool:
        """Whether the interface is up. For wireguard-go, False once the process has exited (the node's path
        keeper polls this every second and then calls `revive`)."""

    def revive(self) -> bool:
        """Bring the interface back after its process died, with the settings of `up` and no peers. Returns
        whether it did (False: it was running, or this backend has no process that can die)."""
        return False

    def set_forwarding(self, on: bool, cidr: str) -> None:
        """Forward packets between this interface's peers (on: a relay), or stop and remove the relay rule (off).
        Only destinations inside `cidr` are forwarded; see the module docstring. Idempotent."""
        _set_forwarding(self.interface, on, cidr)

    def __enter__(self) -> MeshBackend:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.down()


class UserspaceBackend(MeshBackend):
    """wireguard-go as a child process, configured over its UAPI socket; see the module docstring for what
    happens when it exits.

    The child's output goes to a temporary file whose tail is quoted in errors; its log level is "error" unless
    the environment sets GPUSWARM_WG_LOG_LEVEL (wireguard-go knows "verbose", "error" and "silent")."""

    kind = "userspace"

    def __init__(
        self,
        interface: str | None = None,
        *,
        binary: str = "wireguard-go",
        start_timeout: float = 10.0,
        stop_timeout: float = 5.0,
        uapi_timeout: float = 5.0,
        mtu: int | None = None,
        uapi_dir: str | Path = UAPI_DIR,
    ):
        """`uapi_dir` is where wireguard-go puts its socket (fixed at /var/run/wireguard; only tests that stand a
        fake binary in for wireguard-go change it). `stop_timeout` bounds the cleanup after a failed `up`."""
        self.interface = interface or new_interface_name()
        if not INTERFACE_NAME_RE.match(self.interface):
            raise ValueError(f"bad interface name {self.interface!r} (1-15 of A-Z a-z 0-9 _ . -)")
        self.binary = binary
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.mtu = mtu
        self.socket_path = socket_path(self.interface, uapi_dir)
        self.uapi = UAPIClient(self.socket_path, timeout=uapi_timeout)
        self._proc: subprocess.Popen | None = None
        self._output: Any = None  # a temporary file holding wireguard-go's stdout/stderr
        self._lock = threading.RLock()
        self._settings: tuple[str, int, int, str] | None = None  # what `up` set: address, prefix, port, key
        self.restarts = 0

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def _output_tail(self, limit: int = 2000) -> str:
        if self._output is None:
            return ""
        try:
            self._output.flush()
            self._output.seek(0)
            text = self._output.read().decode("utf-8", "replace")
        except (OSError, ValueError):
            return ""
        return text[-limit:].strip()

    def _socket_is_live(self) -> bool:
        try:
            UAPIClient(self.socket_path, timeout=1.0).get()
            return True
        except UAPIError:
            return False

    def _start_process(self) -> None:
        """Spawn wireguard-go and return once its UAPI socket answers; raise BackendError otherwise (_ready)."""
        binary = shutil.which(self.binary)
        if binary is None:
            raise BackendError(f"{self.binary} not found; install it (Debian: apt-get install wireguard-go)")
        if self._socket_is_live():
            raise BackendError(f"{self.socket_path} is served by another wireguard-go: interface name in use")
        self._output = tempfile.TemporaryFile(prefix=f"wireguard-go-{self.interface}-")
        # O_APPEND: the child shares this file's offset, and reading the tail must not make it overwrite output.
        fd = self._output.fileno()
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_APPEND)
        env = dict(os.environ, LOG_LEVEL=os.environ.get("GPUSWARM_WG_LOG_LEVEL", "error"))
        self._proc = subprocess.Popen(
            [binary, "-f", self.interface],
            stdin=subprocess.DEVNULL,
            stdout=self._output,
            stderr=subprocess.STDOUT,
            env=env,
            close_fds=True,
        )
        logger.info("started wireguard-go for %s (pid %d)", self.interface, self._proc.pid)
        deadline = time.monotonic() + self.start_timeout
        while True:
            code = self._proc.poll()
            if code is not None:
                raise BackendError(f"wireguard-go for {self.interface} exited with {code}: {self._output_tail()}")
            if self.socket_path.exists():
                try:
                    self.uapi.get()
                    return
                except UAPIConnectionError:
                    pass
            if time.monotonic() > deadline:
                raise BackendError(
                    f"wireguard-go for {self.interface} did not open {self.socket_path} within "
                    f"{self.start_timeout} s: {self._output_tail()}"
                )
            time.sleep(0.05)

    def up(self, address: str, cidr: str, listen_port: int, private_key: str) -> None:
        address, prefixlen = _interface_address(address, cidr)
        _check_port(listen_port)
        private_key = validate_key(private_key)
        with self._lock:
            if self._proc is not None:
                raise BackendError(f"{self.interface} is already up")
            self._bring_up(address, prefixlen, listen_port, private_key)
        logger.info("mesh interface %s up: %s/%d, port %d", self.interface, address, prefixlen, listen_port)

    def _bring_up(self, address: str, prefixlen: int, listen_port: int, private_key: str) -> None:
        try:
            self._start_process()
            try:
                self.uapi.configure_device(private_key=private_key, listen_port=listen_port)
            except UAPIError as e:
                raise BackendError(f"cannot configure {self.interface} (port {listen_port}): {e}") from None
            _configure_link(self.interface, address, prefixlen, self.mtu)
        except BaseException:
            self._stop(self.stop_timeout)
            raise
        self._settings = (address, prefixlen, listen_port, private_key)

    def revive(self) -> bool:
        with self._lock:
            if self._settings is None or self.is_running():
                return False
            code = self._proc.returncode if self._proc is not None else None
            tail = self._output_tail(500)
            self._stop(self.stop_timeout)  # reaps it, tidies a stale socket, closes its output file
            logger.warning("wireguard-go for %s exited (%s%s); starting it again", self.interface,
                           "a restart failed" if code is None else f"exit {code}", f": {tail}" if tail else "")
            self._bring_up(*self._settings)
            self.restarts += 1
            return True

    def _check_alive(self) -> None:
        if self._proc is None:
            raise BackendError(f"{self.interface} is not up")
        code = self._proc.poll()
        if code is not None:
            raise BackendError(f"wireguard-go for {self.interface} died (exit {code}): {self._output_tail()}")

    def _uapi_call(self, what: str, fn: Callable[[], T]) -> T:
        with self._lock:
            self._check_alive()
            try:
                return fn()
            except UAPIError as e:
                raise BackendError(f"{what} on {self.interface}: {e}") from e

    def add_or_update_peer(self, peer: PeerConfig, fields: Collection[str] | None = None) -> None:
        fields = _check_fields(fields)
        self._uapi_call(
            "set peer",
            lambda: self.uapi.set_peer(
                peer.public_key,
                endpoint=peer.endpoint if "endpoint" in fields else None,
                allowed_ips=sorted(peer.allowed_ips) if "allowed_ips" in fields else None,
                persistent_keepalive=peer.persistent_keepalive if "persistent_keepalive" in fields else None,
            ),
        )

    def remove_peer(self, public_key: str) -> None:
        public_key = validate_key(public_key)
        self._uapi_call("remove peer", lambda: self.uapi.remove_peer(public_key))

    def status(self) -> DeviceStatus:
        return self._uapi_call("get", self.uapi.get)

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def down(self, timeout: float = 5.0) -> None:
        with self._lock:
            self._settings = None  # down on purpose: nothing to revive
            self._stop(timeout)

    def _stop(self, timeout: float) -> None:
        with self._lock:
            proc, self._proc = self._proc, None
            if proc is not None:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)  # wireguard-go removes its socket and TUN device on SIGTERM
                    try:
                        proc.wait(timeout)
                    except subprocess.TimeoutExpired:
                        logger.warning("wireguard-go for %s ignored SIGTERM for %.1f s; killing it",
                                       self.interface, timeout)
                        proc.kill()
                        proc.wait(timeout)
                logger.info("mesh interface %s down (wireguard-go exit %s)", self.interface, proc.returncode)
                # A killed wireguard-go leaves its socket behind; the name is ours, so tidy it unless it is live.
                if self.socket_path.exists() and not self._socket_is_live():
                    self.socket_path.unlink(missing_ok=True)
            if self._output is not None:
                self._output.close()
                self._output = None


def kernel_wireguard_available() -> bool:
    """Whether the wireguard kernel module is loaded (or built in)."""
    return Path("/sys/module/wireguard").is_dir()


class KernelBackend(MeshBackend):
    """In-kernel WireGuard through pyroute2 (rtnetlink for the link, generic netlink for the device).

    Minimal on purpose, and untested here: no machine we develop or test on has the wireguard module, so only
    `choose_backend` ever decides to use it. Peers are changed one at a time through pyroute2's `WireGuard.set`,
    which never sets WGDEVICE_F_REPLACE_PEERS.
    """

    kind = "kernel"

    def __init__(self, interface: str | None = None):
        self.interface = interface or new_interface_name()
        if not INTERFACE_NAME_RE.match(self.interface):
            raise ValueError(f"bad interface name {self.interface!r}")
        self._up = False

    def _wg(self, fn: Callable[[Any], T]) -> T:
        from pyroute2 import WireGuard

        def call() -> T:
            wg = WireGuard()
            try:
                return fn(wg)
            finally:
                wg.close()

        try:
            return _off_loop(call)
        except BackendError:
            raise
        except Exception as e:  # pyroute2 raises NetlinkError and plain OSErrors
            raise BackendError(f"wireguard netlink on {self.interface}: {e}") from e

    def up(self, address: str, cidr: str, listen_port: int, private_key: str) -> None:
        from pyroute2 import IPRoute
        from pyroute2.netlink.exceptions import NetlinkError

        address, prefixlen = _interface_address(address, cidr)
        _check_port(listen_port)
        private_key = validate_key(private_key)
        if self._up:
            raise BackendError(f"{self.interface} is already up")

        def create() -> None:
            with IPRoute() as ipr:
                ipr.link("add", ifname=self.interface, kind="wireguard")

        try:
            _off_loop(create)
        except NetlinkError as e:
            raise BackendError(f"cannot create wireguard link {self.interface}: {e}") from None
        self._up = True
        try:
            self._wg(lambda wg: wg.set(self.interface, private_key=private_key, listen_port=listen_port))
            _configure_link(self.interface, address, prefixlen, None)
        except BaseException:
            self.down()
            raise

    def add_or_update_peer(self, peer: PeerConfig, fields: Collection[str] | None = None) -> None:
        fields = _check_fields(fields)
        spec: dict[str, Any] = {"public_key": peer.public_key}
        if "endpoint" in fields and peer.endpoint is not None:
            host, _, port = peer.endpoint.rpartition(":")
            spec["endpoint_addr"] = host.strip("[]")
            spec["endpoint_port"] = int(port)
        if "persistent_keepalive" in fields:
            spec["persistent_keepalive"] = peer.persistent_keepalive
        if "allowed_ips" in fields:
            spec["replace_allowed_ips"] = True
            spec["allowed_ips"] = sorted(peer.allowed_ips)
        self._wg(lambda wg: wg.set(self.interface, peer=spec))

    def remove_peer(self, public_key: str) -> None:
        spec = {"public_key": validate_key(public_key), "remove": True}
        self._wg(lambda wg: wg.set(self.interface, peer=spec))

    def status(self) -> DeviceStatus:
        messages = self._wg(lambda wg: list(wg.info(self.interface)))
        public_key: str | None = None
        listen_port: int | None = None
        peers: list[PeerStatus] = []
        for msg in messages:  # a large device comes back split over several messages
            public_key = _nl_key(msg.get_attr("WGDEVICE_A_PUBLIC_KEY")) or public_key
            listen_port = msg.get_attr("WGDEVICE_A_LISTEN_PORT") or listen_port
            for peer in msg.get_attr("WGDEVICE_A_PEERS") or ():
                peers.append(_nl_peer(peer))
        return DeviceStatus(public_key=public_key, listen_port=listen_port, peers=tuple(peers))

    def is_running(self) -> bool:
        return self._up

    def down(self, timeout: float = 5.0) -> None:
        from pyroute2 import IPRoute

        if not self._up:
            return
        self._up = False

        def delete() -> None:
            with IPRoute() as ipr:
                found = ipr.link_lookup(ifname=self.interface)
                if found:
                    ipr.link("del", index=found[0])

        _off_loop(delete)


def _nl_key(value: Any) -> str | None:
    if value is None:
        return None
    if hasattr(value, "get"):
        value = value.get("value") or value.get("key")
    if isinstance(value, bytes | bytearray):
        return validate_key(value.decode("ascii")) if len(value) == 44 else base64.b64encode(value).decode("ascii")
    return validate_key(str(value))


def _nl_peer(peer: Any) -> PeerStatus:
    endpoint = None
    ep = peer.get_attr("WGPEER_A_ENDPOINT")
    if ep is not None and ep.get("addr"):
        addr = ipaddress.ip_address(ep["addr"])
        endpoint = f"[{addr}]:{ep['port']}" if addr.version == 6 else f"{addr}:{ep['port']}"
    handshake = peer.get_attr("WGPEER_A_LAST_HANDSHAKE_TIME")
    latest = None
    if handshake is not None and (handshake.get("tv_sec") or handshake.get("tv_nsec")):
        latest = handshake["tv_sec"] + handshake["tv_nsec"] / 1e9
    allowed = tuple(ip["addr"] for ip in peer.get_attr("WGPEER_A_ALLOWEDIPS") or () if ip.get("addr"))
    return PeerStatus(
        public_key=_nl_key(peer.get_attr("WGPEER_A_PUBLIC_KEY")) or "",
        endpoint=endpoint,
        allowed_ips=allowed,
        latest_handshake=latest,
        rx_bytes=peer.get_attr("WGPEER_A_RX_BYTES") or 0,
        tx_bytes=peer.get_attr("WGPEER_A_TX_BYTES") or 0,
        persistent_keepalive=peer.get_attr("WGPEER_A_PERSISTENT_KEEPALIVE_INTERVAL") or 0,
    )


def choose_backend(prefer: str = "auto", interface: str | None = None, **userspace_options: Any) -> MeshBackend:
    """The backend to use: `prefer` is "auto" (kernel where the module is loaded, else wireguard-go),
    "kernel" or "userspace". Logs the choice and why."""
    if prefer not in ("auto", "kernel", "userspace"):
        raise ValueError(f"mesh backend must be auto, kernel or userspace, not {prefer!r}")
    kernel = kernel_wireguard_available()
    if prefer == "kernel" or (prefer == "auto" and kernel):
        if not kernel:
            raise BackendError("the kernel backend was asked for, but the wireguard module is not loaded")
        logger.info("mesh backend: kernel WireGuard (module loaded)")
        return KernelBackend(interface)
    backend = UserspaceBackend(interface, **userspace_options)
    if shutil.which(backend.binary) is None:
        raise BackendError(
            f"no WireGuard available: {backend.binary} is not installed"
            + ("" if kernel else " and the wireguard kernel module is not loaded")
        )
    logger.info("mesh backend: userspace wireguard-go (%s)",
                "asked for" if prefer == "userspace" else "no kernel module")
    return backend


__all__ = [
    "UAPI_DIR",
    "BackendError",
    "KernelBackend",
    "MeshBackend",
    "PeerConfig",
    "UserspaceBackend",
    "choose_backend",
    "kernel_wireguard_available",
    "new_interface_name",
]
