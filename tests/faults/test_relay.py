"""Two nodes with no direct path train together through a third: the product's relays, in namespaces.

Namespace 0 runs the coordinator; nodes 1-3 run `gpuswarm node start` with wireguard-go. The lab's bridge
isolates the ports of nodes 1 and 2 (`NetLab.separate`), so no packet passes between them, while both reach
node 3 and the coordinator. The tests share one swarm and run in file order: the relay forms, a three-node job
trains through it, and the relay goes when the direct path comes back. Part of the fault suite (about 2 minutes):
.ci/run runs it in that step, `scripts/test -m faults -s tests/faults/test_relay.py` alone.
"""

from __future__ import annotations

import json
import sys
import time

import netlab
import pytest
from meshswarm import MeshSwarm, wait_for

pytestmark = [pytest.mark.faults, pytest.mark.keep_processes,
              pytest.mark.skipif(netlab.unavailable_reason(wireguard=True) is not None,
                                 reason=f"{netlab.unavailable_reason(wireguard=True)}")]
NODES = (1, 2, 3)


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    root = tmp_path_factory.mktemp("relay-swarm")
    with netlab.NetLab(4) as lab:
        lab.separate([1, 2])
        swarm = MeshSwarm(lab, root)
        try:
            swarm.start_coordinator()
            swarm.started = time.time()
            for i in NODES:
                swarm.start_node(i)
            yield swarm
        finally:
            swarm.stop_all()


def node_id(s: MeshSwarm, i: int) -> str:
    """Node i's id, as its peers know it."""
    key = s.wg_key(i)
    return next(p["node_id"] for j in NODES if j != i for k, p in s.peers_of(j).items() if k == key)


def path(s: MeshSwarm, i: int, j: int) -> dict:
    return (s.peers_of(i).get(s.wg_key(j)) or {}).get("path") or {}


def mesh_status(s: MeshSwarm, i: int) -> dict:
    result = s.lab.exec(i, [sys.executable, "-m", "gpuswarm.cli", "mesh", "status", "--state-dir",
                            str(s.state_dir(i)), "--json"], timeout=60)
    return json.loads(result.stdout)


def test_nodes_without_a_direct_path_reach_each_other_through_a_relay(swarm):
    s = swarm
    wait_for(lambda: all(len(s.peers_of(i)) == 2 for i in NODES), 90, "every node to have its peers")
    relay = node_id(s, 3)
    wait_for(lambda: path(s, 1, 2).get("via") == relay and path(s, 2, 1).get("via") == relay, 90,
             "nodes 1 and 2 to route through node 3", interval=0.5)
    print(f"relayed {time.time() - s.started:.1f}s after the coordinator started")
    assert not s.lab.ping(1, s.lab.addresses[2], wait_s=1.0), "the lab left a direct underlay path"
    assert s.pings(1, s.mesh_state(2)["address"]) and s.pings(2, s.mesh_state(1)["address"])
    # What an operator sees on each end, and on the relay.
    status = mesh_status(s, 1)
    peer = next(p for p in status["peers"] if p["public_key"] == s.wg_key(2))
    assert peer["path"]["via"] == relay and peer["rtt_ms"] is not None and not status["relaying"]
    assert mesh_status(s, 3)["relaying"]
    # The relay forwards back into the mesh only: a rule sends what arrives on its interface to a table that
    # holds the mesh route and an unreachable default.
    interface = s.mesh_state(3)["interface"]
    assert f"iif {interface}" in s.lab.exec(3, ["ip", "rule"]).stdout
    assert all(p["path"]["via"] is None for p in mesh_status(s, 3)["peers"])
    table = s.lab.exec(1, ["env", "COLUMNS=200", sys.executable, "-m", "gpuswarm.cli", "mesh", "status", "--state-dir",
                           str(s.state_dir(1))], timeout=60).stdout
    assert f"relayed via {relay}" in table, table


def test_training_goes_on_through_the_relay(swarm):
    s = swarm
    job = s.client.submit_job({"workload": "digits-mlp", "min_nodes": 3, "max_nodes": 3,
                               "stop": {"target_accuracy": 0.9, "max_epochs": 60}})
    done = wait_for(lambda: (j := s.client.job(job["id"]))["state"] in ("completed", "failed") and j,
                    420, "the job to finish", interval=2.0)
    assert done["state"] == "completed", done["events"]
    assert done["final_accuracy"] >= 0.9
    assert len({a["node_id"] for a in done["assignments"]}) == 3
    assert path(s, 1, 2).get("via") == node_id(s, 3), "the relay went away during the job"


def test_the_relay_goes_when_the_direct_path_comes_back(swarm):
    s = swarm
    s.lab.separate([1, 2], apart=False)
    joined = time.time()
    wait_for(lambda: not path(s, 1, 2).get("via") and path(s, 1, 2).get("state") == "settled"
             and not path(s, 2, 1).get("via") and path(s, 2, 1).get("state") == "settled", 90,
             "nodes 1 and 2 to go direct again", interval=0.5)
    direct = time.time()
    print(f"direct again {direct - joined:.1f}s after the link came back")
    # Both ends settled on the direct path. CI once saw five one-second echoes fail right after the relay went
    # (cause not found; the ends' settled states were not both checked then): allow 20 s and print what it took.
    wait_for(lambda: s.pings(1, s.mesh_state(2)["address"], attempts=1), 20, "an echo from node 1 to node 2 directly")
    print(f"echoes direct {time.time() - direct:.1f}s after both ends settled")
    wait_for(lambda: not mesh_status(s, 3)["relaying"], 30, "node 3 to stop relaying", interval=1.0)
    assert "iif gs" not in s.lab.exec(3, ["ip", "rule"]).stdout
