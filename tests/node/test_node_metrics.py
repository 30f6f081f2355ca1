"""The node daemon's Prometheus metrics (gpuswarm.node.metrics): the exposition built from a snapshot and from the
training process's events, GPU metrics through NVML (absent without it), a failed averaging round reaching the
metrics through the attestor, and, end to end, real node daemons serving `/metrics` while they register, heartbeat
and train a job with hivemind, and with the real WireGuard mesh in network namespaces (root and wireguard-go, else
skipped); a taken --metrics-port stops the daemon at start with a clear error.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from types import SimpleNamespace

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from gpuswarm.node.metrics import (
    GpuReader,
    MeshPeerStats,
    MetricsServer,
    MetricsUnavailable,
    NodeMetrics,
    NodeSnapshot,
)
from gpuswarm.proto.models import NodeState, Progress
from localswarm import LocalSwarm, free_port
from prometheus_client.parser import text_string_to_metric_families

from gpuswarm import __version__

NODE = "n-0123456789abcdef"
JOB = "j-0123456789ab"
Samples = dict[tuple[str, frozenset], float]


@pytest.fixture(scope="module", autouse=True)
def hivemind_backend():
    """hivemind's MPFuture backend (and torch's shared-memory manager, a child process) started before any test, as
    in tests/node/test_attest.py: the autouse guard in conftest would otherwise kill a manager a test started."""
    from hivemind.utils.mpfuture import MPFuture

    MPFuture()
    yield


def parse(text: str) -> Samples:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def names(samples: Samples) -> set[str]:
    return {name for name, _ in samples}


def snapshot(**changes) -> NodeSnapshot:
    fields = dict(node_id=NODE, state=NodeState.IDLE, coordinator_reachable=True, outbox_reports=0,
                  pending_uploads=0, training_jobs=0) | changes
    return NodeSnapshot(**fields)


class Holder:
    """The daemon's side of a scrape: whatever snapshot it holds now."""

    def __init__(self, current: NodeSnapshot):
        self.current = current

    def __call__(self) -> NodeSnapshot:
        return self.current


def scraped(metrics: NodeMetrics) -> Samples:
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain")
    return parse(body.decode())


# --------------------------------------------------------------------------------------------------- unit


def test_state_progress_and_round_events_become_metrics_and_a_stopped_job_leaves_no_series():
    # The worker's own "progress" event, as the runner turns it into the job's Progress.
    event = {"event": "progress", "job_id": JOB, "epoch": 1.5, "global_step": 3, "samples": 640, "loss": 0.42,
             "accuracy": 0.875, "samples_per_second": 123.4, "peers": 2}
    holder = Holder(snapshot(state=NodeState.TRAINING, training_jobs=1, outbox_reports=2,
                             progress=(Progress.model_validate(event),)))
    metrics = NodeMetrics(holder, version="9.9.9")
    for e in ({"event": "round", "solo": False}, {"event": "round", "solo": False}, {"event": "round", "solo": True},
              {"event": "round_failed", "epoch": 4}, event, {"event": "finished"}):
        metrics.observe(e)
    metrics.heartbeat(ok=True)
    metrics.heartbeat(ok=False)

    s = scraped(metrics)
    assert value(s, "gpuswarm_node_info", node_id=NODE, version="9.9.9") == 1
    assert {state.value: value(s, "gpuswarm_node_state", state=state.value) for state in NodeState} == \
        {state.value: 1.0 if state is NodeState.TRAINING else 0.0 for state in NodeState}
    job = {"job_id": JOB}
    assert value(s, "gpuswarm_node_samples_per_second", **job) == 123.4
    assert value(s, "gpuswarm_node_epoch", **job) == 1.5
    assert value(s, "gpuswarm_node_global_step", **job) == 3
    assert value(s, "gpuswarm_node_loss", **job) == 0.42
    assert value(s, "gpuswarm_node_accuracy", **job) == 0.875
    assert value(s, "gpuswarm_node_job_peers", **job) == 2
    assert value(s, "gpuswarm_node_training_samples_total", **job) == 640
    assert [value(s, "gpuswarm_node_averaging_rounds_total", result=r) for r in ("ok", "failed", "solo")] == \
        [2, 1, 1]
    assert value(s, "gpuswarm_node_heartbeats_sent_total") == 2
    assert value(s, "gpuswarm_node_heartbeats_failed_total") == 1
    assert value(s, "gpuswarm_node_outbox_reports") == 2
    assert value(s, "gpuswarm_node_training_jobs") == 1
    assert value(s, "gpuswarm_node_coordinator_reachable") == 1
    assert "process_cpu_seconds_total" in names(s)
    assert not any(n.startswith("gpuswarm_node_mesh_") for n in names(s))  # no mesh: no mesh series

    holder.current = snapshot(state=NodeState.DISCONNECTED, coordinator_reachable=False)  # the job stopped
    s = scraped(metrics)
    assert not [key for key in s if ("job_id", JOB) in key[1]]
    assert value(s, "gpuswarm_node_state", state="disconnected") == 1
    assert value(s, "gpuswarm_node_coordinator_reachable") == 0
    assert value(s, "gpuswarm_node_averaging_rounds_total", result="ok") == 2  # counters stay


def test_a_progress_event_without_evaluation_has_no_loss_or_accuracy():
    progress = Progress(job_id=JOB, epoch=0.25, global_step=1, samples=64, samples_per_second=10.0)
    s = scraped(NodeMetrics(Holder(snapshot(progress=(progress,), training_jobs=1))))
    assert value(s, "gpuswarm_node_samples_per_second", job_id=JOB) == 10.0
    assert value(s, "gpuswarm_node_loss", job_id=JOB) is None
    assert value(s, "gpuswarm_node_accuracy", job_id=JOB) is None


def test_mesh_peers_give_bytes_handshake_age_and_rtt():
    now = time.time()
    peers = (MeshPeerStats("n-aaaa", received_bytes=1000, sent_bytes=2000, latest_handshake=now - 30, rtt_ms=2.5),
             MeshPeerStats("n-bbbb", received_bytes=0, sent_bytes=148, latest_handshake=None, rtt_ms=None))
    s = scraped(NodeMetrics(Holder(snapshot(mesh_peers=peers))))
    assert value(s, "gpuswarm_node_mesh_peers") == 2
    assert value(s, "gpuswarm_node_mesh_peer_received_bytes_total", peer="n-aaaa") == 1000
    assert value(s, "gpuswarm_node_mesh_peer_sent_bytes_total", peer="n-aaaa") == 2000
    assert value(s, "gpuswarm_node_mesh_peer_sent_bytes_total", peer="n-bbbb") == 148
    assert 30 <= value(s, "gpuswarm_node_mesh_peer_handshake_age_seconds", peer="n-aaaa") < 3600
    assert value(s, "gpuswarm_node_mesh_peer_rtt_seconds", peer="n-aaaa") == 0.0025
    # No handshake yet, no RTT yet: no made-up numbers.
    assert value(s, "gpuswarm_node_mesh_peer_handshake_age_seconds", peer="n-bbbb") is None
    assert value(s, "gpuswarm_node_mesh_peer_rtt_seconds", peer="n-bbbb") is None


@pytest.mark.skipif(importlib.util.find_spec("pynvml") is not None, reason="nvidia-ml-py is installed here")
def test_gpu_metrics_are_absent_without_nvidia_ml_py():
    reader = GpuReader(enabled=True)
    assert reader.read() == [] and reader.read() == []  # tried once, logged once, never raises
    s = scraped(NodeMetrics(Holder(snapshot()), reader))
    assert not any(n.startswith("gpuswarm_node_gpu_") for n in names(s))


class StandInNVML:
    """A stand-in for the pynvml module (this machine has no GPU): two GPUs, the second one failing to read."""

    NVMLError = RuntimeError

    def __init__(self, fail_init: bool = False):
        self.fail_init, self.inits, self.shutdowns = fail_init, 0, 0

    def nvmlInit(self):
        self.inits += 1
        if self.fail_init:
            raise self.NVMLError("NVML Shared Library Not Found")

    def nvmlShutdown(self):
        self.shutdowns += 1

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, index):
        return index

    def nvmlDeviceGetMemoryInfo(self, handle):
        if handle == 1:
            raise self.NVMLError("GPU is lost")
        return SimpleNamespace(used=3 * 2**30, total=80 * 2**30, free=77 * 2**30)

    def nvmlDeviceGetUtilizationRates(self, handle):
        return SimpleNamespace(gpu=87, memory=40)


def test_gpu_metrics_read_through_nvml_at_scrape_time_and_a_failing_gpu_is_left_out():
    nvml = StandInNVML()
    metrics = NodeMetrics(Holder(snapshot()), GpuReader(enabled=True, nvml=nvml))
    for _ in range(2):
        s = scraped(metrics)
        assert value(s, "gpuswarm_node_gpu_utilization_ratio", gpu="0") == 0.87
        assert value(s, "gpuswarm_node_gpu_memory_used_bytes", gpu="0") == 3 * 2**30
        assert value(s, "gpuswarm_node_gpu_memory_total_bytes", gpu="0") == 80 * 2**30
        assert not [key for key in s if ("gpu", "1") in key[1]]
    assert nvml.inits == 1
    metrics.close()
    assert nvml.shutdowns == 1

    broken = StandInNVML(fail_init=True)
    s = scraped(NodeMetrics(Holder(snapshot()), GpuReader(enabled=True, nvml=broken)))
    assert not any(n.startswith("gpuswarm_node_gpu_") for n in names(s))
    offered_none = StandInNVML()  # a node that offers no GPU (--cpu) never touches NVML
    s = scraped(NodeMetrics(Holder(snapshot()), GpuReader(enabled=False, nvml=offered_none)))
    assert offered_none.inits == 0 and not any(n.startswith("gpuswarm_node_gpu_") for n in names(s))


def test_only_a_failed_round_reaches_on_failed_not_a_cancelled_or_successful_one():
    from gpuswarm.node.attest import ClaimAttestor, key_signer
    from hivemind.averaging.control import StepControl
    from hivemind.utils import get_dht_time
    from hivemind.utils.mpfuture import MPFuture

    def control() -> StepControl:
        trigger, cancel = MPFuture(), MPFuture()  # plain MPFutures first (see tests/node/test_attest.py)
        step = StepControl(scheduled_time=get_dht_time() + 1, deadline=get_dht_time() + 60, allow_retries=False,
                           weight=1.0, data_for_gather=b"")
        step.attach(trigger, cancel)
        step.allow_allreduce()
        return step

    failed, rounds = [], []
    att = ClaimAttestor(*key_signer(Ed25519PrivateKey.generate()), JOB, "QmSelf", rounds.append,
                        on_failed=lambda epoch, error: failed.append((epoch, type(error).__name__)))
    att.attach(lambda: 0)
    att.meter.record(5, 0.1)
    claim = att.claim_for_round()
    steps = [control() for _ in range(3)]
    for step in steps:
        att.track(step, claim)
    steps[0].cancel()  # hivemind skipped the round (no other peer): not a failure
    steps[1].set_exception(TimeoutError("could not find a group"))
    att.poll()
    assert failed == [(0, "TimeoutError")] and rounds == []
    steps[2].set_result({"QmSelf": claim.wire})
    att.poll()
    assert failed == [(0, "TimeoutError")] and [(r.epoch, r.solo) for r in rounds] == [(0, False)]


async def test_a_taken_port_is_a_clear_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = MetricsServer(NodeMetrics(Holder(snapshot())), "127.0.0.1", port)
        with pytest.raises(MetricsUnavailable, match=f"on 127.0.0.1:{port}: Address already in use"):
            await server.start()
    await server.stop()  # nothing to stop: harmless


# --------------------------------------------------------------------------------------------------- real daemons


def test_the_node_daemon_refuses_to_start_on_a_taken_metrics_port(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "gpuswarm.cli", "node", "start", "--coordinator", f"http://127.0.0.1:{free_port()}",
             "--state-dir", str(tmp_path / "node"), "--cpu", "--no-mesh", "--metrics-port", str(port)],
            capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert done.returncode == 1, done.stderr
    assert f"cannot serve metrics on 127.0.0.1:{port}: Address already in use" in done.stderr, done.stderr
    assert "registered" not in done.stderr  # it stopped before talking to the coordinator


def scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return parse(response.read().decode())


@pytest.fixture
def lab(swarm_lab) -> LocalSwarm:
    swarm = swarm_lab()
    swarm.start_coordinator()
    return swarm


@pytest.mark.integration
def test_real_nodes_serve_state_heartbeats_training_and_rounds(lab):
    ports = [free_port(), free_port()]
    for i, port in enumerate(ports):
        lab.start_node(i, 0.5, "--metrics-port", str(port))
    lab.wait_for_nodes(2)

    def node(i: int) -> Samples:
        return scrape(ports[i])

    lab.wait(lambda: value(node(0), "gpuswarm_node_state", state="idle") == 1, 60, "node 0 idle")
    s = node(0)
    assert value(s, "gpuswarm_node_info", node_id=lab.node_id(0), version=__version__) == 1
    assert value(s, "gpuswarm_node_coordinator_reachable") == 1
    assert value(s, "gpuswarm_node_heartbeats_failed_total") == 0
    assert value(s, "gpuswarm_node_outbox_reports") == 0 and value(s, "gpuswarm_node_training_jobs") == 0
    assert not any(n.startswith(("gpuswarm_node_mesh_", "gpuswarm_node_gpu_")) for n in names(s))  # --no-mesh, --cpu
    sent = value(s, "gpuswarm_node_heartbeats_sent_total")
    lab.wait(lambda: value(node(0), "gpuswarm_node_heartbeats_sent_total") > sent, 60, "another heartbeat")
    assert value(node(1), "gpuswarm_node_info", node_id=lab.node_id(1), version=__version__) == 1

    # A real two-node job: hivemind rounds between the nodes' training processes. It trains until it is cancelled:
    # rounds of local updates take digits-mlp through tens of epochs a second, so an epoch limit (200 until now)
    # could end it between two scrapes.
    job = lab.client.submit_job({"name": "metrics", "workload": "digits-mlp", "min_nodes": 2, "max_nodes": 2,
                                 "budget": 5.0, "stop": {"max_epochs": None, "max_seconds": 3600}})
    job_id = job.id

    def training() -> bool:
        s = node(0)
        return (value(s, "gpuswarm_node_state", state="training") == 1
                and (value(s, "gpuswarm_node_samples_per_second", job_id=job_id) or 0) > 0
                and value(s, "gpuswarm_node_averaging_rounds_total", result="ok") > 0)

    lab.wait(training, 240, "node 0 to report training with an averaged round", lab.nodes[0])
    s = node(0)
    assert value(s, "gpuswarm_node_global_step", job_id=job_id) >= 1
    assert value(s, "gpuswarm_node_training_jobs") == 1

    lab.client.cancel_job(job_id)  # the node stops its training process: the job's series go with it
    lab.wait(lambda: not [k for k in node(0) if ("job_id", job_id) in k[1]]
             and value(node(0), "gpuswarm_node_training_jobs") == 0, 90, "the job's series to leave")
    assert value(node(0), "gpuswarm_node_averaging_rounds_total", result="ok") > 0


def mesh_unavailable_reason() -> str | None:
    import netlab

    reason = netlab.unavailable_reason()
    if reason is None and shutil.which("wireguard-go") is None:
        reason = "wireguard-go is not installed (apt-get install wireguard-go)"
    if reason is None and not os.path.exists("/dev/net/tun"):
        reason = "/dev/net/tun is missing"
    return reason


def scrape_in(lab, i: int, port: int) -> Samples:
    """/metrics of the node in namespace i (the host's namespace has no route into the lab, and lo is per namespace)."""
    code = (f"import sys, urllib.request; sys.stdout.write(urllib.request.urlopen("
            f"'http://127.0.0.1:{port}/metrics', timeout=10).read().decode())")
    result = lab.exec(i, [sys.executable, "-c", code], check=False, timeout=30)
    return parse(result.stdout) if result.returncode == 0 else {}


@pytest.mark.integration
@pytest.mark.skipif(mesh_unavailable_reason() is not None, reason=f"netns: {mesh_unavailable_reason()}")
def test_mesh_nodes_serve_per_peer_bytes_handshake_age_and_rtt(tmp_path):
    """Two real node daemons with the WireGuard mesh (wireguard-go) in network namespaces, each on the customary
    port 9465 of its own loopback. Their per-peer byte counters agree with the device's own."""
    import netlab
    from gpuswarm.mesh.uapi import UAPIClient
    from gpuswarm.node.identity import load_or_create
    from meshswarm import MeshSwarm, wait_for

    port = 9465
    with netlab.NetLab(3) as nl:
        swarm = MeshSwarm(nl, tmp_path)
        try:
            swarm.start_coordinator()
            for i in (1, 2):
                with open(tmp_path / f"node-{i}.log", "ab") as log:
                    swarm.procs[i] = nl.popen(
                        i, [sys.executable, "-m", "gpuswarm.cli", "node", "start", "-c", swarm.url, "--state-dir",
                            str(swarm.state_dir(i)), "--cpu", "--listen-port", "51820", "--metrics-port", str(port)],
                        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                        env=os.environ | {"PYTHONUNBUFFERED": "1"})
            swarm.wait_for_nodes(2)
            wait_for(lambda: all(len(swarm.peers_of(i)) == 1 for i in (1, 2)), 60, "each node to have its peer")
            assert swarm.pings(1, swarm.mesh_state(2)["address"]), "node 1 cannot reach node 2 over the mesh"
            peer = load_or_create(swarm.state_dir(2)).node_id

            def peer_metrics() -> Samples | None:
                s = scrape_in(nl, 1, port)
                wanted = ("gpuswarm_node_mesh_peer_sent_bytes_total", "gpuswarm_node_mesh_peer_received_bytes_total",
                          "gpuswarm_node_mesh_peer_handshake_age_seconds", "gpuswarm_node_mesh_peer_rtt_seconds")
                return s if all((value(s, name, peer=peer) or 0) > 0 for name in wanted[:2]) and \
                    all(value(s, name, peer=peer) is not None for name in wanted[2:]) else None

            s = wait_for(peer_metrics, 60, "node 1's metrics of its peer", interval=1.0)
            assert value(s, "gpuswarm_node_mesh_peers") == 1
            assert value(s, "gpuswarm_node_state", state="idle") == 1
            assert 0 <= value(s, "gpuswarm_node_mesh_peer_handshake_age_seconds", peer=peer) < 3600
            # RTTs come from echoes the path keeper waits for at most 1 s (probe_wait_s).
            assert 0 < value(s, "gpuswarm_node_mesh_peer_rtt_seconds", peer=peer) <= 1.0
            device = UAPIClient.for_interface(swarm.mesh_state(1)["interface"]).get().peer(swarm.wg_key(2))
            # The metrics are the device's own counters (as of the path keeper's last read): never more than now.
            assert value(s, "gpuswarm_node_mesh_peer_sent_bytes_total", peer=peer) <= device.tx_bytes
            assert value(s, "gpuswarm_node_mesh_peer_received_bytes_total", peer=peer) <= device.rx_bytes
        finally:
            swarm.stop_all()
