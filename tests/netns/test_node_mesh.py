"""The real product in namespaces: a coordinator and node daemons that build their WireGuard mesh themselves.

Namespace 0 runs `gpuswarm coordinator serve`; namespaces 1-4 run `gpuswarm node start` (mesh on, wireguard-go).
Every check goes through the product's own CLI, the nodes' mesh.json, the WireGuard devices and ICMP over the
mesh. The tests share one swarm and run in file order: join, job, late join, restart, endpoint change, revoke.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import netlab
import pytest
from gpuswarm.mesh.uapi import UAPIClient
from meshswarm import MeshSwarm, wait_for

pytestmark = pytest.mark.keep_processes  # nodes started by one test serve the next; the module fixture stops them
NODES = (1, 2, 3)  # started with the swarm; node 4 joins late


@pytest.fixture(scope="module")
def mesh_swarm(tmp_path_factory):
    root = tmp_path_factory.mktemp("mesh-swarm")
    with netlab.NetLab(5) as lab:
        swarm = MeshSwarm(lab, root)
        try:
            swarm.start_coordinator()
            for i in NODES:
                swarm.start_node(i)
            yield swarm
        finally:
            for i in list(swarm.procs):
                if i != 0:
                    swarm.stop(i)
            if 0 in swarm.procs:
                swarm.stop(0)


def test_mesh_forms_and_every_pair_pings(mesh_swarm):
    s = mesh_swarm
    wait_for(lambda: all(len(s.peers_of(i)) == len(NODES) - 1 for i in NODES), 60, "every node to have its peers")
    addresses = {i: s.mesh_state(i)["address"] for i in NODES}
    assert len(set(addresses.values())) == len(NODES)
    for i in NODES:
        for j in NODES:
            if i != j:
                assert s.pings(i, addresses[j]), f"node {i} cannot reach node {j} at {addresses[j]} over the mesh"


def test_hivemind_trains_over_mesh_addresses(mesh_swarm):
    s = mesh_swarm
    job = s.client.submit_job({"workload": "digits-mlp", "min_nodes": 2, "max_nodes": 3,
                               "stop": {"target_accuracy": 0.9, "max_epochs": 60}})
    done = wait_for(lambda: (j := s.client.job(job["id"]))["state"] in ("completed", "failed") and j,
                    420, "the job to finish", interval=2.0)
    assert done["state"] == "completed", done["events"]
    assert done["final_accuracy"] >= 0.9
    nodes = {n["id"]: n for n in s.cli(0, "nodes")}
    members = {a["node_id"] for a in done["assignments"]}
    for node_id in members:
        advert = nodes[node_id]["advert"]
        assert advert and advert["maddrs"], nodes[node_id]
        mesh_address = nodes[node_id]["mesh_address"]
        # hivemind announces only the mesh address: nothing on the namespaces' own network.
        assert all(m.startswith(f"/ip4/{mesh_address}/") for m in advert["maddrs"]), advert["maddrs"]
    for i in NODES:
        worker_logs = list((s.state_dir(i) / "jobs").glob("*/worker.log"))
        assert worker_logs, f"node {i} ran no training process"


def test_late_joiner_is_reachable_within_two_seconds_of_registering(mesh_swarm):
    s = mesh_swarm
    s.start_node(4)
    own = wait_for(lambda: s.mesh_state(4), 60, "node 4 to register and bring up its interface")
    registered_at = (s.state_dir(4) / "mesh.json").stat().st_mtime
    key = s.wg_key(4)
    wait_for(lambda: all(key in s.peers_of(i) for i in NODES), 10, "every peer to add node 4", interval=0.02)
    applied_at = max((s.state_dir(i) / "mesh.json").stat().st_mtime for i in NODES)
    assert applied_at - registered_at < 2.0, f"peers applied node 4 {applied_at - registered_at:.2f}s after it"
    for i in NODES:
        assert s.pings(i, own["address"]), f"node {i} cannot reach the late joiner"


def test_restarted_node_keeps_its_key_and_address(mesh_swarm):
    s = mesh_swarm
    before, key = s.mesh_state(2)["address"], s.wg_key(2)
    s.stop(2)
    (s.state_dir(2) / "mesh.json").unlink()
    s.start_node(2)
    after = wait_for(lambda: s.mesh_state(2), 60, "node 2 to come back")
    assert (after["address"], s.wg_key(2)) == (before, key)
    wait_for(lambda: all(key in s.peers_of(i) for i in (1, 3, 4)), 30, "peers to take node 2 back")
    assert s.pings(1, before)


def test_endpoint_change_is_picked_up(mesh_swarm):
    s = mesh_swarm
    key, old = s.wg_key(3), s.lab.addresses[3]
    new = old.rsplit(".", 1)[0] + ".200"
    link = next(line.split()[1] for line in s.lab.exec(3, ["ip", "-o", "-4", "addr", "show"]).stdout.splitlines()
                if f" {old}/" in line)
    # Deleting first: removing a subnet's primary address would also take a secondary one in that subnet with it.
    s.lab.exec(3, ["ip", "addr", "del", f"{old}/24", "dev", link])
    s.lab.exec(3, ["ip", "addr", "add", f"{new}/24", "dev", link])
    wait_for(lambda: s.peers_of(1).get(key, {}).get("endpoints", [""])[0].startswith(f"{new}:"), 30,
             "node 1 to learn node 3's new endpoint")
    peer = UAPIClient.for_interface(s.mesh_state(1)["interface"]).get().peer(key)
    assert peer is not None and peer.endpoint == f"{new}:51820"
    assert s.pings(1, s.mesh_state(3)["address"])


def test_a_killed_wireguard_go_is_restarted_and_handshakes_resume_within_five_seconds(mesh_swarm):
    s = mesh_swarm
    state = s.mesh_state(1)
    interface, restarts = state["interface"], state["restarts"]
    pid = int(subprocess.run(["pgrep", "-f", f"wireguard-go -f {interface}$"], capture_output=True, text=True,
                             check=True).stdout.split()[0])
    others = {s.wg_key(i) for i in (2, 3, 4)}
    os.kill(pid, signal.SIGKILL)
    killed = time.time()

    def resumed() -> bool:
        try:
            device = UAPIClient.for_interface(interface).get()
        except Exception:  # the socket is gone until the supervisor brings the interface back
            return False
        fresh = {p.public_key for p in device.peers if p.latest_handshake and p.latest_handshake > killed}
        return others <= fresh

    wait_for(resumed, 5, "handshakes with every peer after the restart", interval=0.1)
    took = time.time() - killed
    assert s.mesh_state(1)["restarts"] == restarts + 1
    assert "restarted" in s.log("node-1")
    for i in (2, 3, 4):
        assert s.pings(1, s.mesh_state(i)["address"]), f"node 1 cannot reach node {i} after the restart"
    print(f"handshakes with all 3 peers resumed {took:.2f}s after kill -9 of wireguard-go")


def test_revoked_node_loses_its_links(mesh_swarm):
    s = mesh_swarm
    address, key = s.mesh_state(4)["address"], s.wg_key(4)
    node_id = next(n["id"] for n in s.cli(0, "nodes") if n["mesh_address"] == address)
    s.cli(0, "nodes", "revoke", node_id, "--data-dir", str(s.root / "coordinator"))
    wait_for(lambda: all(key not in s.peers_of(i) for i in NODES), 10, "every peer to drop the revoked node")
    for i in NODES:
        assert not s.lab.ping(i, address, wait_s=1.0), f"node {i} still reaches the revoked node"
    # The revoked daemon is refused at its next heartbeat, says why, and exits.
    wait_for(lambda: s.procs[4].poll() is not None, 40, "the revoked node to stop")
    assert "revoked" in s.log("node-4")
    listed = next(n for n in s.cli(0, "nodes") if n["id"] == node_id)
    assert listed["revoked"] and not listed["online"]
