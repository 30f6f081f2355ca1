"""A client of WireGuard's cross-platform configuration protocol (UAPI), as wireguard-go serves it.

Protocol (https://www.wireguard.com/xplatform/): connect to the unix stream socket /var/run/wireguard/IFACE.sock,
send `get=1\\n\\n` or `set=1\\n` + `key=value` lines + `\\n`. A get is answered by `key=value` lines; every reply
ends with `errno=N\\n\\n`, N = 0 on success (wireguard-go sends negative errno values, e.g. -22 for EINVAL). Keys
travel as lowercase hex. Lines after a `public_key=` line configure that peer.

Owns: the wire format (parsing get replies, formatting set requests) and the socket conversation. Every set is
incremental per peer: one peer is created, updated or removed (`remove=true`) at a time, and `replace_peers` is
never sent (it drops every peer, and so every session, before re-adding them); `format_set` refuses it outright.
Does not start wireguard-go or touch links and addresses (that is the backend's).
"""

from __future__ import annotations

import errno as errno_mod
import ipaddress
import os
import socket
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from gpuswarm.mesh.keys import KeyFormatError, hex_to_key, key_to_hex, public_key_for, validate_key

UAPI_DIR = Path("/var/run/wireguard")
MAX_REPLY_BYTES = 16 * 1024 * 1024  # a get for thousands of peers is well under this; anything bigger is broken
FORBIDDEN_KEYS = frozenset({"replace_peers"})


class UAPIError(RuntimeError):
    """Anything that went wrong talking to a WireGuard UAPI socket."""


class UAPIConnectionError(UAPIError):
    """The socket is missing, refused the connection, or timed out (the device is not running)."""


class UAPIProtocolError(UAPIError):
    """The reply did not follow the protocol."""


class UAPIErrnoError(UAPIError):
    """The device answered with a non-zero errno (`errno` is positive, like Python's OSError.errno)."""

    def __init__(self, errno: int, operation: str):
        self.errno = errno
        name = errno_mod.errorcode.get(errno, "unknown")
        super().__init__(f"UAPI {operation} failed: errno {errno} ({name}: {_strerror(errno)})")


def _strerror(code: int) -> str:
    try:
        return os.strerror(code)
    except (ValueError, OverflowError):
        return "unknown error"


def normalize_endpoint(value: str) -> str:
    """`IP:port` or `[IPv6]:port` in canonical form. Host names are refused: the UAPI takes addresses only."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"an endpoint is 'IP:port', not {value!r}")
    host, sep, port_text = value.rpartition(":")
    if not sep or not port_text.isdigit():
        raise ValueError(f"endpoint {value!r} has no port")
    port = int(port_text)
    if not 1 <= port <= 65535:
        raise ValueError(f"endpoint {value!r} has a port out of range")
    bracketed = host.startswith("[") and host.endswith("]")
    try:
        address = ipaddress.ip_address(host[1:-1] if bracketed else host)
    except ValueError:
        raise ValueError(f"endpoint {value!r} is not an IP address and port") from None
    if address.version == 6:
        if not bracketed:
            raise ValueError(f"IPv6 endpoint {value!r} needs brackets: [addr]:port")
        return f"[{address}]:{port}"
    if bracketed:
        raise ValueError(f"IPv4 endpoint {value!r} must not be bracketed")
    return f"{address}:{port}"


def normalize_allowed_ip(value: str) -> str:
    """A CIDR in canonical form (host bits cleared, as WireGuard stores it). A bare address becomes a /32 or /128."""
    try:
        return str(ipaddress.ip_network(value, strict=False))
    except (ValueError, TypeError):
        raise ValueError(f"not an allowed IP (CIDR): {value!r}") from None


@dataclass(frozen=True)
class PeerStatus:
    public_key: str
    endpoint: str | None
    allowed_ips: tuple[str, ...]
    latest_handshake: float | None  # unix time of the latest handshake; None if there has been none
    rx_bytes: int
    tx_bytes: int
    persistent_keepalive: int  # seconds, 0 = off


@dataclass(frozen=True)
class DeviceStatus:
    public_key: str | None  # None until a private key is set
    listen_port: int | None
    peers: tuple[PeerStatus, ...]

    def peer(self, public_key: str) -> PeerStatus | None:
        return next((p for p in self.peers if p.public_key == public_key), None)


def _int(key: str, value: str) -> int:
    try:
        number = int(value, 10)
    except ValueError:
        raise UAPIProtocolError(f"{key}={value!r} is not an integer") from None
    return number


def _errno_of(line: str, operation: str) -> None:
    code = _int("errno", line.partition("=")[2])
    if code != 0:
        raise UAPIErrnoError(abs(code), operation)


def parse_get(text: str) -> DeviceStatus:
    """Parse a complete get reply (including its final `errno=` line) into a DeviceStatus."""
    lines = text.split("\n")
    while lines and lines[-1] == "":
        lines.pop()
    if not lines or not lines[-1].startswith("errno="):
        raise UAPIProtocolError("get reply does not end with an errno line")
    _errno_of(lines.pop(), "get")

    public_key: str | None = None
    listen_port: int | None = None
    peers: list[PeerStatus] = []
    peer: dict | None = None

    def finish() -> None:
        if peer is not None:
            sec, nsec = peer.pop("_sec"), peer.pop("_nsec")
            peer["latest_handshake"] = None if sec == 0 and nsec == 0 else sec + nsec / 1e9
            peer["allowed_ips"] = tuple(peer["allowed_ips"])
            peers.append(PeerStatus(**peer))

    for line in lines:
        key, sep, value = line.partition("=")
        if not sep:
            raise UAPIProtocolError(f"get reply line without '=': {line!r}")
        try:
            if key == "public_key":
                finish()
                peer = {
                    "public_key": hex_to_key(value),
                    "endpoint": None,
                    "allowed_ips": [],
                    "_sec": 0,
                    "_nsec": 0,
                    "rx_bytes": 0,
                    "tx_bytes": 0,
                    "persistent_keepalive": 0,
                }
            elif peer is None:
                if key == "private_key":
                    public_key = public_key_for(hex_to_key(value))
                elif key == "listen_port":
                    listen_port = _int(key, value)
                # fwmark and future device keys are not needed here
            elif key == "endpoint":
                peer["endpoint"] = value
            elif key == "allowed_ip":
                peer["allowed_ips"].append(value)
            elif key == "last_handshake_time_sec":
                peer["_sec"] = _int(key, value)
            elif key == "last_handshake_time_nsec":
                peer["_nsec"] = _int(key, value)
            elif key == "rx_bytes":
                peer["rx_bytes"] = _int(key, value)
            elif key == "tx_bytes":
                peer["tx_bytes"] = _int(key, value)
            elif key == "persistent_keepalive_interval":
                peer["persistent_keepalive"] = _int(key, value)
            # preshared_key, protocol_version and unknown future keys are ignored on purpose
        except KeyFormatError as e:
            raise UAPIProtocolError(f"bad key in get reply: {e}") from None
    finish()
    return DeviceStatus(public_key=public_key, listen_port=listen_port, peers=tuple(peers))


def format_set(lines: Iterable[tuple[str, str]]) -> bytes:
    """A complete set request. Refuses `replace_peers` and anything that would break the line framing."""
    out = ["set=1"]
    for key, value in lines:
        if key in FORBIDDEN_KEYS:
            raise ValueError(f"{key} is never sent: it drops every peer's session; update peers one by one")
        if not key or any(c in key for c in "=\n") or "\n" in value:
            raise ValueError(f"malformed UAPI line {key!r}={value!r}")
        out.append(f"{key}={value}")
    return ("\n".join(out) + "\n\n").encode("ascii")


def device_lines(*, private_key: str | None = None, listen_port: int | None = None) -> list[tuple[str, str]]:
    lines: list[tuple[str, str]] = []
    if private_key is not None:
        lines.append(("private_key", key_to_hex(private_key)))
    if listen_port is not None:
        if isinstance(listen_port, bool) or not isinstance(listen_port, int) or not 0 <= listen_port <= 65535:
            raise ValueError(f"listen_port must be 0..65535, not {listen_port!r}")
        lines.append(("listen_port", str(listen_port)))
    return lines


def peer_lines(
    public_key: str,
    *,
    endpoint: str | None = None,
    allowed_ips: Sequence[str] | None = None,
    persistent_keepalive: int | None = None,
    remove: bool = False,
) -> list[tuple[str, str]]:
    """The lines that create/update one peer, or remove it.

    `allowed_ips=None` leaves the peer's allowed IPs alone; a sequence replaces this peer's (and only this peer's)
    allowed IPs with it (`replace_allowed_ips=true`), which does not disturb its session.
    """
    lines = [("public_key", key_to_hex(validate_key(public_key)))]
    if remove:
        lines.append(("remove", "true"))
        return lines
    if endpoint is not None:
        lines.append(("endpoint", normalize_endpoint(endpoint)))
    if persistent_keepalive is not None:
        if isinstance(persistent_keepalive, bool) or not isinstance(persistent_keepalive, int) or not (
            0 <= persistent_keepalive <= 65535
        ):
            raise ValueError(f"persistent_keepalive must be 0..65535 seconds, not {persistent_keepalive!r}")
        lines.append(("persistent_keepalive_interval", str(persistent_keepalive)))
    if allowed_ips is not None:
        if isinstance(allowed_ips, str):
            raise ValueError("allowed_ips is a list of CIDRs, not one string")
        lines.append(("replace_allowed_ips", "true"))
        lines.extend(("allowed_ip", normalize_allowed_ip(ip)) for ip in allowed_ips)
    return lines


class UAPIClient:
    """One request per connection to the socket at `path`; safe to share between threads."""

    def __init__(self, path: str | Path, timeout: float = 5.0):
        self.path = Path(path)
        self.timeout = timeout

    @classmethod
    def for_interface(cls, interface: str, uapi_dir: str | Path = UAPI_DIR, timeout: float = 5.0) -> UAPIClient:
        return cls(socket_path(interface, uapi_dir), timeout)

    def _request(self, payload: bytes, operation: str) -> str:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            try:
                sock.connect(str(self.path))
            except OSError as e:
                raise UAPIConnectionError(f"cannot connect to {self.path}: {e.strerror or e}") from None
            sock.sendall(payload)
            data = bytearray()
            while not data.endswith(b"\n\n"):
                chunk = sock.recv(65536)
                if not chunk:
                    raise UAPIProtocolError(f"{self.path} closed the connection mid-reply ({operation})")
                data += chunk
                if len(data) > MAX_REPLY_BYTES:
                    raise UAPIProtocolError(f"{self.path} sent more than {MAX_REPLY_BYTES} bytes ({operation})")
        except TimeoutError:
            raise UAPIConnectionError(f"{self.path} did not answer within {self.timeout} s ({operation})") from None
        except (ConnectionError, BrokenPipeError) as e:
            raise UAPIConnectionError(f"{self.path} dropped the connection ({operation}): {e}") from None
        finally:
            sock.close()
        try:
            return data.decode("ascii")
        except UnicodeDecodeError:
            raise UAPIProtocolError(f"{self.path} sent non-ASCII bytes ({operation})") from None

    def _set(self, lines: list[tuple[str, str]], operation: str) -> None:
        reply = self._request(format_set(lines), operation)
        reply_lines = [line for line in reply.split("\n") if line]
        if len(reply_lines) != 1 or not reply_lines[0].startswith("errno="):
            raise UAPIProtocolError(f"unexpected reply to {operation}: {reply!r}")
        _errno_of(reply_lines[0], operation)

    def get(self) -> DeviceStatus:
        return parse_get(self._request(b"get=1\n\n", "get"))

    def configure_device(self, *, private_key: str | None = None, listen_port: int | None = None) -> None:
        lines = device_lines(private_key=private_key, listen_port=listen_port)
        if lines:
            self._set(lines, "set device")

    def set_peer(
        self,
        public_key: str,
        *,
        endpoint: str | None = None,
        allowed_ips: Sequence[str] | None = None,
        persistent_keepalive: int | None = None,
    ) -> None:
        """Create or update one peer; None fields are left as they are. Other peers are not touched."""
        lines = peer_lines(public_key, endpoint=endpoint, allowed_ips=allowed_ips,
                           persistent_keepalive=persistent_keepalive)
        self._set(lines, "set peer")

    def remove_peer(self, public_key: str) -> None:
        """Remove one peer (`remove=true`). Removing an unknown peer is not an error."""
        self._set(peer_lines(public_key, remove=True), "remove peer")


def socket_path(interface: str, uapi_dir: str | Path = UAPI_DIR) -> Path:
    return Path(uapi_dir) / f"{interface}.sock"
