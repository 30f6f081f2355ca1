"""UserspaceBackend's supervision of its child, with a stand-in binary in place of wireguard-go: start-up errors
surface from up(), and a failed up() leaves no process and no socket behind. The real wireguard-go runs in
tests/netns."""

from __future__ import annotations

import socket
import stat
import sys
import textwrap
import time

import pytest
from gpuswarm.mesh import backend as backend_mod
from gpuswarm.mesh.backend import (
    BackendError,
    KernelBackend,
    PeerConfig,
    UserspaceBackend,
    choose_backend,
    new_interface_name,
)
from gpuswarm.mesh.keys import KeyPair

FAKE = textwrap.dedent(
    f"""\
    #!{sys.executable}
    import os, signal, socket, sys, time
    mode = os.environ["FAKE_MODE"]
    if mode == "exit":
        print("boom: cannot create TUN", flush=True)
        sys.exit(3)
    if os.environ.get("FAKE_IGNORE_TERM"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if mode == "silent":
        time.sleep(60)
        sys.exit(0)
    path = os.path.join(os.environ["FAKE_UAPI_DIR"], sys.argv[2] + ".sock")
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen(4)
    while True:
        conn, _ = server.accept()
        data = b""
        while not data.endswith(b"\\n\\n"):
            data += conn.recv(4096)
        conn.sendall(b"errno=0\\n\\n")
        conn.close()
    """
)


@pytest.fixture
def fake_wg(tmp_path, monkeypatch):
    binary = tmp_path / "fake-wireguard-go"
    binary.write_text(FAKE)
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    uapi_dir = tmp_path / "run"
    uapi_dir.mkdir()
    monkeypatch.setenv("FAKE_UAPI_DIR", str(uapi_dir))

    def make(mode: str, ignore_term: bool = False, **kwargs) -> UserspaceBackend:
        monkeypatch.setenv("FAKE_MODE", mode)
        if ignore_term:
            monkeypatch.setenv("FAKE_IGNORE_TERM", "1")
        return UserspaceBackend(binary=str(binary), uapi_dir=uapi_dir, **kwargs)

    return make


def up_args():
    return ("10.77.0.5", "10.77.0.0/16", 0, KeyPair.generate().private_key)


def test_interface_names_are_short_and_unique():
    names = {new_interface_name() for _ in range(100)}
    assert len(names) == 100
    assert all(len(n) == 8 and n.startswith("gs") for n in names)
    with pytest.raises(ValueError):
        UserspaceBackend("a-name-that-is-far-too-long")


def test_missing_binary_is_a_clear_error():
    backend = UserspaceBackend(binary="no-such-wireguard-go-binary")
    with pytest.raises(BackendError, match="not found"):
        backend.up(*up_args())
    assert not backend.is_running()


def test_child_that_exits_at_start_is_reported_with_its_output(fake_wg):
    backend = fake_wg("exit")
    with pytest.raises(BackendError, match=r"exited with 3: boom: cannot create TUN"):
        backend.up(*up_args())
    assert not backend.is_running() and backend.pid is None


def test_child_that_never_opens_its_socket_times_out_and_is_killed(fake_wg):
    backend = fake_wg("silent", ignore_term=True, start_timeout=0.5, stop_timeout=0.5)
    started = time.monotonic()
    with pytest.raises(BackendError, match="did not open"):
        backend.up(*up_args())
    assert time.monotonic() - started < 5  # bounded: SIGTERM ignored, so SIGKILL after stop_timeout
    assert not backend.is_running()


def test_failure_after_start_stops_the_child_and_removes_its_socket(fake_wg):
    # The stand-in serves the UAPI but creates no interface, so the netlink step fails after the child is up.
    backend = fake_wg("serve", ignore_term=True, stop_timeout=0.5)
    with pytest.raises(BackendError, match="does not exist"):
        backend.up(*up_args())
    assert not backend.is_running()
    assert not backend.socket_path.exists()


def test_up_validates_its_arguments_before_starting_anything(fake_wg):
    backend = fake_wg("serve")
    key = KeyPair.generate().private_key
    with pytest.raises(ValueError, match="not a host address"):
        backend.up("10.78.0.5", "10.77.0.0/16", 0, key)
    with pytest.raises(ValueError, match="not a host address"):
        backend.up("10.77.255.255", "10.77.0.0/16", 0, key)
    with pytest.raises(ValueError, match="listen_port"):
        backend.up("10.77.0.5", "10.77.0.0/16", 70000, key)
    with pytest.raises(ValueError):
        backend.up("10.77.0.5", "10.77.0.0/16", 0, "not-a-key")
    assert backend.pid is None


def test_calls_on_a_backend_that_is_not_up_fail_clearly():
    backend = UserspaceBackend()
    with pytest.raises(BackendError, match="not up"):
        backend.status()
    with pytest.raises(BackendError, match="not up"):
        backend.add_or_update_peer(PeerConfig(KeyPair.generate().public_key, ["10.77.0.2"]))
    with pytest.raises(ValueError, match="unknown peer fields"):
        backend.add_or_update_peer(PeerConfig(KeyPair.generate().public_key, ["10.77.0.2"]), fields=["mtu"])
    backend.down()  # idempotent


def test_peer_config_validates_and_normalises():
    key = KeyPair.generate().public_key
    p = PeerConfig(key, ["10.77.0.2", "10.88.1.0/24"], "10.250.0.2:51820", 25)
    assert p.allowed_ips == frozenset({"10.77.0.2/32", "10.88.1.0/24"})
    with pytest.raises(ValueError):
        PeerConfig(key, "10.77.0.2/32")
    with pytest.raises(ValueError):
        PeerConfig(key, [], "nowhere:1")
    with pytest.raises(ValueError):
        PeerConfig(key, [], None, -1)
    with pytest.raises(ValueError):
        PeerConfig("bad", [])


def test_choose_backend(monkeypatch):
    monkeypatch.setattr(backend_mod, "kernel_wireguard_available", lambda: False)
    with pytest.raises(BackendError, match="not loaded"):
        choose_backend("kernel")
    with pytest.raises(ValueError):
        choose_backend("fastest")
    if backend_mod.shutil.which("wireguard-go"):
        assert choose_backend().kind == "userspace"
    with pytest.raises(BackendError, match="no WireGuard"):
        choose_backend("auto", binary="no-such-wireguard-go-binary")
    monkeypatch.setattr(backend_mod, "kernel_wireguard_available", lambda: True)
    assert choose_backend().kind == "kernel"
    assert choose_backend("userspace", binary=sys.executable).kind == "userspace"


def _netlink_reply(device: KeyPair, peer: KeyPair):
    """A device dump as the kernel would send it, built with pyroute2's own encoder (no module needed)."""
    from pyroute2.netlink.generic.wireguard import wgmsg

    msg = wgmsg()
    msg["cmd"], msg["version"] = 0, 1
    msg["attrs"] = [
        ["WGDEVICE_A_IFNAME", "gs123456"],
        ["WGDEVICE_A_PUBLIC_KEY", {"value": device.public_key}],
        ["WGDEVICE_A_LISTEN_PORT", 51820],
        ["WGDEVICE_A_PEERS", [{"attrs": [
            ["WGPEER_A_PUBLIC_KEY", {"value": peer.public_key}],
            ["WGPEER_A_ENDPOINT", {"family": socket.AF_INET, "addr": "10.250.0.2", "port": 51821}],
            ["WGPEER_A_LAST_HANDSHAKE_TIME", {"tv_sec": 1700000000, "tv_nsec": 0}],
            ["WGPEER_A_RX_BYTES", 10],
            ["WGPEER_A_TX_BYTES", 20],
            ["WGPEER_A_PERSISTENT_KEEPALIVE_INTERVAL", 25],
            ["WGPEER_A_ALLOWEDIPS", [{"attrs": [
                ["WGALLOWEDIP_A_FAMILY", socket.AF_INET],
                ["WGALLOWEDIP_A_IPADDR", socket.inet_pton(socket.AF_INET, "10.77.0.2")],
                ["WGALLOWEDIP_A_CIDR_MASK", 32],
            ]}]],
        ]}]],
    ]
    msg.encode()
    decoded = wgmsg(msg.data)
    decoded.decode()
    return decoded


def test_kernel_backend_reads_status_and_sets_peers_one_at_a_time(monkeypatch):
    # The kernel module is absent here, so only the translation to and from pyroute2 is tested.
    device, peer = KeyPair.generate(), KeyPair.generate()
    calls = []

    class FakeWireGuard:
        def info(self, interface):
            return [_netlink_reply(device, peer)]

        def set(self, interface, **kwargs):
            calls.append(kwargs)

    backend = KernelBackend("gs123456")
    monkeypatch.setattr(backend, "_wg", lambda fn: fn(FakeWireGuard()))
    status = backend.status()
    assert status.public_key == device.public_key and status.listen_port == 51820
    (p,) = status.peers
    assert (p.public_key, p.endpoint, p.allowed_ips) == (peer.public_key, "10.250.0.2:51821", ("10.77.0.2/32",))
    assert (p.latest_handshake, p.rx_bytes, p.tx_bytes, p.persistent_keepalive) == (1700000000, 10, 20, 25)

    backend.add_or_update_peer(PeerConfig(peer.public_key, ["10.77.0.2"], "[fd00::2]:51821"), fields=["endpoint"])
    backend.remove_peer(peer.public_key)
    assert calls == [
        {"peer": {"public_key": peer.public_key, "endpoint_addr": "fd00::2", "endpoint_port": 51821}},
        {"peer": {"public_key": peer.public_key, "remove": True}},
    ]
