"""The UAPI client against a scripted unix-socket server standing in for wireguard-go at the protocol boundary."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable

import pytest
from gpuswarm.mesh.keys import KeyPair, key_to_hex
from gpuswarm.mesh.uapi import (
    UAPIClient,
    UAPIConnectionError,
    UAPIErrnoError,
    UAPIProtocolError,
    format_set,
    normalize_allowed_ip,
    normalize_endpoint,
    parse_get,
    peer_lines,
)

DEVICE = KeyPair.generate()
PEER_A = KeyPair.generate()
PEER_B = KeyPair.generate()

GET_REPLY = (
    f"private_key={key_to_hex(DEVICE.private_key)}\n"
    "listen_port=51820\n"
    "fwmark=0\n"
    f"public_key={key_to_hex(PEER_A.public_key)}\n"
    f"preshared_key={'0' * 64}\n"
    "protocol_version=1\n"
    "endpoint=10.250.0.2:51821\n"
    "last_handshake_time_sec=1700000000\n"
    "last_handshake_time_nsec=500000000\n"
    "tx_bytes=1184\n"
    "rx_bytes=2368\n"
    "persistent_keepalive_interval=25\n"
    "allowed_ip=10.77.0.2/32\n"
    "allowed_ip=fd00::2/128\n"
    f"public_key={key_to_hex(PEER_B.public_key)}\n"
    f"preshared_key={'0' * 64}\n"
    "protocol_version=1\n"
    "last_handshake_time_sec=0\n"
    "last_handshake_time_nsec=0\n"
    "tx_bytes=0\n"
    "rx_bytes=0\n"
    "persistent_keepalive_interval=0\n"
    "some_future_key=whatever\n"
    "errno=0\n\n"
)


class FakeWireguardGo:
    """Accepts connections on a unix socket; `respond(request_bytes) -> reply bytes or None (hang up)`."""

    def __init__(self, path, respond: Callable[[bytes], bytes | None]):
        self.path = path
        self.respond = respond
        self.requests: list[bytes] = []
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(8)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                data = b""
                # A request ends with a blank line: "get=1\n\n" or "set=1\n...\n\n".
                while not data.endswith(b"\n\n"):
                    chunk = conn.recv(4096)
                    if not chunk:
                        break
                    data += chunk
                self.requests.append(data)
                reply = self.respond(data)
                if reply is not None:
                    conn.sendall(reply)

    def close(self):
        self.sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept(); close() alone would not
        self.sock.close()
        self.thread.join(2)


@pytest.fixture
def server(tmp_path):
    servers = []

    def start(respond):
        fake = FakeWireguardGo(tmp_path / f"gs{len(servers):06x}.sock", respond)
        servers.append(fake)
        return fake

    yield start
    for fake in servers:
        fake.close()
    for fake in servers:
        assert not any(b"replace_peers" in r for r in fake.requests), "replace_peers must never be sent"


def ok_server(server):
    return server(lambda req: GET_REPLY.encode() if req == b"get=1\n\n" else b"errno=0\n\n")


def test_parse_get_reads_device_and_peers():
    status = parse_get(GET_REPLY)
    assert status.public_key == DEVICE.public_key
    assert status.listen_port == 51820
    a = status.peer(PEER_A.public_key)
    assert a.endpoint == "10.250.0.2:51821"
    assert a.allowed_ips == ("10.77.0.2/32", "fd00::2/128")
    assert a.latest_handshake == pytest.approx(1700000000.5)
    assert (a.rx_bytes, a.tx_bytes, a.persistent_keepalive) == (2368, 1184, 25)
    b = status.peer(PEER_B.public_key)
    assert b.endpoint is None and b.allowed_ips == () and b.latest_handshake is None
    assert status.peer(KeyPair.generate().public_key) is None


def test_parse_get_of_a_fresh_device():
    status = parse_get("errno=0\n\n")
    assert status.public_key is None and status.listen_port is None and status.peers == ()


@pytest.mark.parametrize(
    "reply, error",
    [
        ("listen_port=1\n\n", UAPIProtocolError),  # no errno line
        ("listen_port\nerrno=0\n\n", UAPIProtocolError),
        ("listen_port=x\nerrno=0\n\n", UAPIProtocolError),
        ("public_key=abc\nerrno=0\n\n", UAPIProtocolError),
        ("errno=-22\n\n", UAPIErrnoError),
    ],
)
def test_parse_get_rejects_bad_replies(reply, error):
    with pytest.raises(error):
        parse_get(reply)


def test_errno_reply_becomes_exception_with_positive_errno():
    with pytest.raises(UAPIErrnoError) as info:
        parse_get("errno=-98\n\n")
    assert info.value.errno == 98 and "EADDRINUSE" in str(info.value)


def test_format_set_refuses_replace_peers_and_line_injection():
    with pytest.raises(ValueError, match="replace_peers"):
        format_set([("replace_peers", "true")])
    with pytest.raises(ValueError):
        format_set([("endpoint", "1.2.3.4:5\nreplace_peers=true")])
    with pytest.raises(ValueError):
        format_set([("a=b", "c")])
    assert format_set([("listen_port", "1")]) == b"set=1\nlisten_port=1\n\n"


def test_peer_lines_are_incremental():
    key_hex = key_to_hex(PEER_A.public_key)
    assert peer_lines(PEER_A.public_key) == [("public_key", key_hex)]
    assert peer_lines(PEER_A.public_key, endpoint="10.0.0.1:5") == [
        ("public_key", key_hex), ("endpoint", "10.0.0.1:5")
    ]
    assert peer_lines(PEER_A.public_key, allowed_ips=["10.77.0.9", "10.1.2.3/8"], persistent_keepalive=0) == [
        ("public_key", key_hex),
        ("persistent_keepalive_interval", "0"),
        ("replace_allowed_ips", "true"),  # this peer's allowed IPs only
        ("allowed_ip", "10.77.0.9/32"),
        ("allowed_ip", "10.0.0.0/8"),
    ]
    assert peer_lines(PEER_A.public_key, remove=True) == [("public_key", key_hex), ("remove", "true")]
    with pytest.raises(ValueError):
        peer_lines(PEER_A.public_key, allowed_ips="10.0.0.1/32")
    with pytest.raises(ValueError):
        peer_lines(PEER_A.public_key, persistent_keepalive=70000)


@pytest.mark.parametrize(
    "value, expected",
    [("10.0.0.1:51820", "10.0.0.1:51820"), ("[fd00::0001]:1", "[fd00::1]:1")],
)
def test_normalize_endpoint(value, expected):
    assert normalize_endpoint(value) == expected


@pytest.mark.parametrize(
    "value", ["10.0.0.1", "host:51820", "10.0.0.1:0", "10.0.0.1:70000", "fd00::1:5", "[1.2.3.4]:5"]
)
def test_normalize_endpoint_refuses(value):
    with pytest.raises(ValueError):
        normalize_endpoint(value)


def test_normalize_allowed_ip():
    assert normalize_allowed_ip("10.77.3.4") == "10.77.3.4/32"
    assert normalize_allowed_ip("10.77.3.4/16") == "10.77.0.0/16"
    with pytest.raises(ValueError):
        normalize_allowed_ip("nope")


def test_client_get_and_sets_speak_the_protocol(server):
    fake = ok_server(server)
    client = UAPIClient(fake.path, timeout=2)
    assert client.get().public_key == DEVICE.public_key
    client.configure_device(private_key=DEVICE.private_key, listen_port=51820)
    client.set_peer(PEER_A.public_key, endpoint="10.250.0.2:51821", allowed_ips=["10.77.0.2/32"])
    client.set_peer(PEER_A.public_key, endpoint="10.250.0.9:51821")  # endpoint only: allowed IPs untouched
    client.remove_peer(PEER_B.public_key)
    a, b = key_to_hex(PEER_A.public_key), key_to_hex(PEER_B.public_key)
    assert fake.requests == [
        b"get=1\n\n",
        f"set=1\nprivate_key={key_to_hex(DEVICE.private_key)}\nlisten_port=51820\n\n".encode(),
        f"set=1\npublic_key={a}\nendpoint=10.250.0.2:51821\nreplace_allowed_ips=true\nallowed_ip=10.77.0.2/32\n\n"
        .encode(),
        f"set=1\npublic_key={a}\nendpoint=10.250.0.9:51821\n\n".encode(),
        f"set=1\npublic_key={b}\nremove=true\n\n".encode(),
    ]


def test_client_raises_on_errno(server):
    fake = server(lambda req: b"errno=-22\n\n")
    with pytest.raises(UAPIErrnoError) as info:
        UAPIClient(fake.path, timeout=2).set_peer(PEER_A.public_key, endpoint="10.0.0.1:1")
    assert info.value.errno == 22


def test_client_raises_when_the_device_hangs_up_or_babbles(server):
    with pytest.raises(UAPIProtocolError, match="closed"):
        UAPIClient(server(lambda req: None).path, timeout=2).get()
    with pytest.raises(UAPIProtocolError, match="unexpected reply"):
        UAPIClient(server(lambda req: b"listen_port=1\nerrno=0\n\n").path, timeout=2).remove_peer(PEER_A.public_key)


def test_client_raises_connection_error_when_missing_or_silent(tmp_path, server):
    with pytest.raises(UAPIConnectionError, match="cannot connect"):
        UAPIClient(tmp_path / "absent.sock", timeout=1).get()
    hold = threading.Event()

    def silent(req):
        hold.wait(5)
        return None

    fake = server(silent)
    try:
        with pytest.raises(UAPIConnectionError, match="did not answer"):
            UAPIClient(fake.path, timeout=0.3).get()
    finally:
        hold.set()
