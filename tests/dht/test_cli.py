"""`gpuswarm dht ...` against a real hivemind DHT: a bootstrap peer holding a real signed advert (stored the way
node/advertiser.py stores it) and real progress records published by a running hivemind ProgressTracker, each with
the proof every record needs (certs from the real coordinator's authority key). The CLI runs as a subprocess,
exactly as an operator runs it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from localswarm import LocalSwarm

pytestmark = pytest.mark.keep_processes  # the module-scoped swarm below outlives single tests; its teardown stops it

ROOT = Path(__file__).resolve().parents[2]
JOB_ID = "j-0123456789ab"


def gpuswarm(*args: str, timeout: float = 40) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpuswarm.cli", "dht", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env=dict(os.environ, COLUMNS="200"))


def authority_key(lab: LocalSwarm):
    """The coordinator's authority key, read from its database: it stands in for registration and an assignment,
    which is how a node gets its certs."""
    import base64
    import sqlite3

    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    with contextlib.closing(sqlite3.connect(lab.root / "coordinator" / "coordinator.db")) as db:
        (raw,) = db.execute("SELECT private_key FROM authority_keys").fetchone()
    return Ed25519PrivateKey.from_private_bytes(base64.b64decode(raw))


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    import hivemind
    from gpuswarm.dht.validators import validators
    from gpuswarm.node.identity import load_or_create
    from gpuswarm.proto.dht import ADVERT_KIND, NODE_SCOPE, NODES_KEY, job_run_id
    from gpuswarm.proto.models import GPUInfo, NodeAdvert, NodeState, Resources
    from gpuswarm.proto.signing import public_key_b64
    from hivemind.dht.crypto import RSASignatureValidator
    from hivemind.optim.progress_tracker import ProgressTracker
    from hivemind.utils import get_dht_time
    from test_record_proofs import writer

    # A real coordinator process: its DHT peer is the bootstrap peer, and `--coordinator` reads it from /v1/dht.
    lab = LocalSwarm(tmp_path_factory.mktemp("lab"))
    lab.start_coordinator()
    key = authority_key(lab)
    authority = public_key_b64(key.public_key())
    assert lab.client.request("GET", "/v1/dht")["authority"] == authority
    identity = load_or_create(tmp_path_factory.mktemp("node"))
    bootstrap = lab.client.request("GET", "/v1/dht")["initial_peers"]
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=bootstrap,
                       record_validators=validators(authority, writer(identity, NODE_SCOPE, [identity.node_id],
                                                                      authority=key)))
    # The training process's peer: a proof for the run, under its hivemind RSA key.
    trainer = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=bootstrap,
                           record_validators=validators(authority, writer(
                               identity, job_run_id(JOB_ID), [RSASignatureValidator().local_public_key],
                               authority=key)))
    tracker = None
    try:
        maddrs = [str(m) for m in dht.get_visible_maddrs()]
        expires = get_dht_time() + 120
        advert = NodeAdvert(node_id=identity.node_id, state=NodeState.IDLE, software_version="test",
                            resources=Resources(gpus=[GPUInfo(model="H100", memory_gb=80, count=2)], cpu_cores=16,
                                                ram_gb=128),
                            price_per_gpu_hour=1.25, maddrs=maddrs, expires_at=expires)
        envelope = identity.sign(ADVERT_KIND, advert.model_dump(mode="json")).model_dump(mode="json")
        assert dht.store(NODES_KEY, subkey=identity.node_id, value=envelope, expiration_time=expires)
        # What a training process's hivemind.Optimizer runs: it signs and publishes this peer's progress.
        tracker = ProgressTracker(trainer, prefix=job_run_id(JOB_ID), target_batch_size=1000, start=True,
                                  min_refresh_period=0.2, max_refresh_period=0.5)
        tracker.report_local_progress(local_epoch=0, samples_accumulated=96)
        deadline = time.monotonic() + 20
        while dht.get(f"{job_run_id(JOB_ID)}_progress", latest=True) is None:
            if time.monotonic() > deadline:
                raise TimeoutError("the progress tracker published nothing")
            time.sleep(0.2)
        yield {"maddrs": maddrs, "node_id": identity.node_id, "peer_id": str(dht.peer_id), "url": lab.url,
               "trainer_peer_id": str(trainer.peer_id)}
    finally:
        if tracker is not None:
            tracker.shutdown(timeout=5)
        trainer.shutdown()
        dht.shutdown()
        lab.stop()


def run_json(swarm, *args: str):
    peers = [x for m in swarm["maddrs"] for x in ("--initial-peer", m)]
    result = gpuswarm(*args, *peers, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_nodes_shows_the_verified_advert(swarm):
    rows = run_json(swarm, "nodes")
    assert len(rows) == 1
    (row,) = rows
    assert row["node_id"] == swarm["node_id"] and row["state"] == "idle"
    assert row["signature"] == "ed25519-verified"
    assert row["registered"] is None  # without --coordinator, the CLI has no key to check the proof against
    assert row["resources"]["gpus"] == [{"model": "H100", "memory_gb": 80.0, "count": 2}]
    assert row["price_per_gpu_hour"] == 1.25 and row["maddrs"] == swarm["maddrs"]
    assert row["dht_expiration"] > time.time() + 60


def test_progress_decodes_the_trackers_signed_record(swarm):
    out = run_json(swarm, "progress", JOB_ID)
    assert out["key"] == "gpuswarm_j_0123456789ab_progress"
    (peer,) = out["peers"]
    assert peer["peer_id"] == swarm["trainer_peer_id"]
    assert peer["epoch"] == 0 and peer["samples_accumulated"] == 96 and peer["client_mode"] is False
    assert peer["signature"] == "rsa-verified" and peer["owner"].startswith("rsa-owner:")


def test_get_and_ls(swarm):
    record = run_json(swarm, "get", "gpuswarm.nodes")
    assert record["found"] and record["records"][0]["subkey"] == swarm["node_id"]
    assert record["records"][0]["value"]["kind"] == "advert"

    # Through the real coordinator: its /v1/dht names the bootstrap peer (no node runs the job, so name it).
    result = gpuswarm("ls", "gpuswarm", "--job", JOB_ID, "--coordinator", swarm["url"], "--json")
    assert result.returncode == 0, result.stderr
    listing = json.loads(result.stdout)
    assert "gpuswarm_j_0123456789ab.members" in listing["looked_up"]  # looked up, but nobody stored it
    assert {k["key"] for k in listing["keys"]} == {"gpuswarm.nodes", "gpuswarm_j_0123456789ab_progress"}
    assert listing["unnamed_local_records"] == []


@pytest.mark.timeout(120)
def test_nodes_marks_an_advert_from_an_unregistered_key(swarm):
    """A plain hivemind client stores a self-signed advert of a node the coordinator never registered, a year
    ahead. Its own peer keeps it; `dht nodes --coordinator` finds it there and says it is not registered."""
    import hivemind
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from gpuswarm.node.identity import Identity
    from gpuswarm.proto.dht import ADVERT_KIND, NODES_KEY
    from gpuswarm.proto.models import NodeAdvert, NodeState, Resources
    from hivemind.utils import get_dht_time

    stranger = Identity(Ed25519PrivateKey.generate())
    far = get_dht_time() + 365 * 86400
    advert = NodeAdvert(node_id=stranger.node_id, state=NodeState.IDLE, software_version="evil",
                        resources=Resources(cpu_cores=1, ram_gb=1), expires_at=far)
    attacker = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=swarm["maddrs"])
    try:
        attacker.store(NODES_KEY, subkey=stranger.node_id, expiration_time=far,
                       value=stranger.sign(ADVERT_KIND, advert.model_dump(mode="json")).model_dump(mode="json"))
        peers = [x for m in [str(m) for m in attacker.get_visible_maddrs()] for x in ("--initial-peer", m)]
        result = gpuswarm("nodes", *peers, "--coordinator", swarm["url"], "--json")
        assert result.returncode == 0, result.stderr
        rows = {r["node_id"]: r for r in json.loads(result.stdout)}
        assert rows[swarm["node_id"]]["registered"] is True
        forged = rows[stranger.node_id]
        assert forged["signature"] == "ed25519-verified" and forged["registered"] is False
        assert "no proof from a registered node" in forged["writer"]
        table = gpuswarm("nodes", *peers, "--coordinator", swarm["url"])
        assert "NO" in table.stdout and "yes" in table.stdout, table.stdout
    finally:
        attacker.shutdown()


def test_key_names_ls_can_know():
    from gpuswarm.dht.inspect import candidate_keys, run_id_of

    run = "gpuswarm_j_0123456789ab"
    assert run_id_of(JOB_ID) == run_id_of(run) == run_id_of(run + "_grad_averager.0b") == run
    assert run_id_of("gpuswarm.nodes") is None
    assert candidate_keys("gpuswarm.", [JOB_ID]) == ["gpuswarm.nodes"]
    assert candidate_keys(JOB_ID, []) == [run + "_progress", run + ".members", run + "_grad_averager.0b",
                                          run + "_state_averager.0b", run + "_grad_averager.all_averagers",
                                          run + "_state_averager.all_averagers"]
    grad_keys = [run + "_grad_averager.0b", run + "_grad_averager.all_averagers"]
    assert candidate_keys(JOB_ID + "_grad", []) == candidate_keys(run + "_grad", []) == grad_keys
    assert len(candidate_keys("gpuswarm", [JOB_ID, "j-ffffffffffff"])) == 13


def test_watch_diff():
    from gpuswarm.dht.cli import diff

    a = {"value": 1, "signature": "unsigned", "expiration": 10.0}
    assert diff({}, {("k", "s"): a}) == [{"change": "added", "key": "k", "subkey": "s", "signature": "unsigned",
                                          "value": 1, "expiration": 10.0}]
    assert diff({("k", "s"): a}, {("k", "s"): dict(a, expiration=20.0)}) == []  # re-declared, same value
    assert [c["change"] for c in diff({("k", "s"): a}, {("k", "s"): dict(a, value=2)})] == ["changed"]
    assert diff({("k", "s"): a}, {}) == [{"change": "gone", "key": "k", "subkey": "s"}]


def test_peers_and_tables(swarm):
    peers = run_json(swarm, "peers")
    assert peers["self"] != swarm["peer_id"]
    (bootstrap,) = [p for p in peers["peers"] if p["peer_id"] == swarm["peer_id"]]
    assert bootstrap["routing"] and bootstrap["latency_ms"] is not None and bootstrap["addrs"]

    table = gpuswarm("nodes", "--initial-peer", swarm["maddrs"][0])
    assert table.returncode == 0, table.stderr
    assert swarm["node_id"] in table.stdout and "2x H100 80G" in table.stdout and "ed25519-verified" in table.stdout


def test_watch_prints_records_and_ends_on_ctrl_c(swarm):
    proc = subprocess.Popen([sys.executable, "-m", "gpuswarm.cli", "dht", "watch", "gpuswarm", "--job", JOB_ID,
                             "--interval", "1", "--initial-peer", swarm["maddrs"][0], "--json"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        changes = [json.loads(proc.stdout.readline()) for _ in range(2)]
        assert {c["change"] for c in changes} == {"added"}
        assert {c["key"] for c in changes} == {"gpuswarm.nodes", "gpuswarm_j_0123456789ab_progress"}
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0  # a lookup in flight (bounded by --timeout) and the DHT's shutdown
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_unreachable_dht_fails_clearly_within_the_timeout():
    bogus = "/ip4/127.0.0.1/tcp/9/p2p/QmTRV6i8uCMYWGxWqpXdKs4XQXqPjbqE2uPJzCaUBTtSak"
    started = time.monotonic()
    result = gpuswarm("nodes", "--initial-peer", bogus, "--timeout", "5", "--json", timeout=30)
    assert result.returncode == 1
    assert "cannot reach the DHT" in result.stderr and bogus in result.stderr
    assert time.monotonic() - started < 20
    assert result.stdout == ""


def test_the_command_group_loads_no_hivemind_and_names_the_missing_extra():
    code = "import sys, gpuswarm.dht.cli; print('hivemind' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["False", "False"]

    # An install without the node extra: importing hivemind fails, and the command says what to install.
    code = ("import sys; sys.modules['hivemind'] = None; from gpuswarm.cli import main; "
            "sys.argv = ['gpuswarm', 'dht', 'nodes', '--initial-peer', '/ip4/127.0.0.1/tcp/9']; main()")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                            env=dict(os.environ, COLUMNS="200"))
    assert result.returncode == 1 and result.stdout == ""
    assert "needs hivemind" in result.stderr and "pip install 'gpuswarm[node]'" in result.stderr
