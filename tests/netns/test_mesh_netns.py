"""Real wireguard-go in network namespaces: three nodes, each configured by the reconciler through its UAPI socket.

The tests share one mesh (module fixture) and run in file order; the one that removes a peer restores it.
"""

from __future__ import annotations

import itertools

import pytest
from gpuswarm.mesh import ipam
from gpuswarm.mesh.keys import KeyPair

pytestmark = pytest.mark.timeout(60)


def test_every_pair_pings_over_mesh_addresses(mesh):
    failures = [(i, j) for i, j in itertools.permutations(range(len(mesh.nodes)), 2) if not mesh.wait_ping(i, j)]
    assert failures == [], f"no mesh ping between (from, to): {failures}"


def test_status_reads_back_device_and_peers(mesh):
    for node in mesh.nodes:
        status = node.ok("status")["status"]
        assert status["public_key"] == node.keys.public_key
        assert status["listen_port"] == node.port
        peers = {p["public_key"]: p for p in status["peers"]}
        others = [n for n in mesh.nodes if n is not node]
        assert set(peers) == {n.keys.public_key for n in others}
        for other in others:
            peer = peers[other.keys.public_key]
            assert peer["endpoint"] == other.endpoint
            assert peer["allowed_ips"] == [f"{other.address}/32"]
            assert peer["latest_handshake"] is not None  # the pings above shook hands with everyone
            assert peer["rx_bytes"] > 0 and peer["tx_bytes"] > 0


def test_reconcile_again_changes_nothing(mesh):
    for node in mesh.nodes:
        assert node.ok("reconcile", peers=mesh.desired_for(node.index))["changes"] == []


def test_endpoint_update_keeps_the_session(mesh):
    a, b = mesh.nodes[0], mesh.nodes[1]
    assert mesh.wait_ping(0, 1)
    before = a.ok("status")["status"]
    peer_before = next(p for p in before["peers"] if p["public_key"] == b.keys.public_key)

    # Give b a second underlay address and point a at it: a new endpoint for the same peer.
    second = "10.250.0.201"
    mesh.lab.exec(1, ["ip", "addr", "add", f"{second}/24", "dev", "eth0"])
    new_endpoint = f"{second}:{b.port}"
    a.ok("peer", **b.peer_spec(endpoint=new_endpoint), fields=["endpoint"])

    after_set = a.ok("status")["status"]
    peer_after = next(p for p in after_set["peers"] if p["public_key"] == b.keys.public_key)
    assert peer_after["endpoint"] == new_endpoint
    # Same session: no new handshake, and the byte counters were not reset (replace_peers would do both).
    assert peer_after["latest_handshake"] == peer_before["latest_handshake"]
    assert peer_after["tx_bytes"] >= peer_before["tx_bytes"]
    # Every other peer of a is untouched.
    others_before = {p["public_key"]: p for p in before["peers"] if p["public_key"] != b.keys.public_key}
    others_after = {p["public_key"]: p for p in after_set["peers"] if p["public_key"] != b.keys.public_key}
    assert {k: p["latest_handshake"] for k, p in others_after.items()} == {
        k: p["latest_handshake"] for k, p in others_before.items()
    }

    assert mesh.wait_ping(0, 1)
    after_ping = a.ok("status")["status"]
    peer_used = next(p for p in after_ping["peers"] if p["public_key"] == b.keys.public_key)
    assert peer_used["latest_handshake"] == peer_before["latest_handshake"]
    assert peer_used["tx_bytes"] > peer_before["tx_bytes"]

    # Back to the configured endpoint, as the reconciler sees it.
    changes = a.ok("reconcile", peers=mesh.desired_for(0))["changes"]
    assert changes == [{"kind": "update", "public_key": b.keys.public_key, "fields": ["endpoint"]}]


def test_removing_a_peer_stops_traffic_and_reconcile_restores_it(mesh):
    a, c = mesh.nodes[0], mesh.nodes[2]
    assert mesh.wait_ping(0, 2)
    a.ok("remove", public_key=c.keys.public_key)
    status = a.ok("status")["status"]
    assert c.keys.public_key not in {p["public_key"] for p in status["peers"]}
    assert not mesh.lab.ping(0, c.address, wait_s=1.0)
    assert mesh.wait_ping(0, 1), "removing one peer must not disturb the others"

    changes = a.ok("reconcile", peers=mesh.desired_for(0))["changes"]
    assert changes == [{"kind": "add", "public_key": c.keys.public_key, "fields": []}]
    assert mesh.wait_ping(0, 2)


def test_failed_up_cleans_up_and_reports(mesh):
    # A second interface on a port the main one already holds: wireguard-go refuses the port.
    a = mesh.nodes[0]
    reply = a.call("up", slot="extra", address="10.77.255.254", cidr=ipam.DEFAULT_CIDR, listen_port=a.port,
                   private_key=KeyPair.generate().private_key)
    assert reply["ok"] is False
    assert f"port {a.port}" in reply["error"] and "EADDRINUSE" in reply["error"], reply["error"]
    assert reply["running"] is False and reply["socket_left"] is False
    assert mesh.wait_ping(0, 1)
