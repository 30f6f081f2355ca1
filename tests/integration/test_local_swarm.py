"""End to end: a real coordinator process and real node daemons (three; one for a lone member) train digits-mlp
with hivemind.

These are the slowest tests (a few minutes each on 2 cores): every part is real, from signed registration to
hivemind all-reduce rounds between the nodes' training processes, to the final model in the artifact store.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch
from gpuswarm.node.workloads.digits import digits_split
from gpuswarm.node.workloads.saved import evaluate_builtin, read_model_file
from gpuswarm.proto.api import ContributionSummary, JobDetail
from gpuswarm.proto.models import JobSpec
from localswarm import LocalSwarm

pytestmark = pytest.mark.integration
TARGET = 0.95
SPEC = {"name": "it-digits", "workload": "digits-mlp", "min_nodes": 2, "max_nodes": 3, "budget": 5.0,
        "stop": {"target_accuracy": TARGET, "max_epochs": 60}}
PRICES = [0.5, 0.6, 0.7]  # the nodes' asks, per GPU-hour


@pytest.fixture
def swarm(swarm_lab) -> LocalSwarm:
    lab = swarm_lab()
    lab.start_coordinator()
    for i in range(3):
        lab.start_node(i, price=PRICES[i])
    lab.wait_for_nodes(3)
    return lab


def wait_for_job(lab: LocalSwarm, job_id: str, timeout: float = 420.0, client=None) -> JobDetail:
    """The job once it has ended, read as its owner (`client`, default the lab's owner)."""
    client = client or lab.client
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = client.job(job_id)
        if job.state in ("completed", "failed", "cancelled"):
            return job
        time.sleep(1.0)
    raise AssertionError(f"job {job_id} still {job.state} after {timeout:.0f}s: {job.progress}\n"
                         + "\n".join(lab.log_tail(f"node-{i}", 15) for i in range(3)))


def wait_for_ledger(lab: LocalSwarm, job_id: str, node_ids: set[str],
                    timeout: float = 60.0) -> dict[str, ContributionSummary]:
    """The job's books once they are closed (nodes send their last round reports a heartbeat or two after the end;
    the coordinator settles after its grace period), by node."""
    deadline = time.monotonic() + timeout
    while True:
        statement = lab.client.job_statement(job_id)
        rows = {r.node_id: r for r in statement.nodes}
        if (statement.settled and node_ids <= rows.keys()) or time.monotonic() > deadline:
            return rows
        time.sleep(1.0)


def test_three_nodes_train_to_target_and_share_the_credit(swarm, tmp_path):
    job = swarm.client.submit_job(SPEC)
    done = wait_for_job(swarm, job.id)
    assert done.state == "completed", done
    assert done.final_accuracy >= TARGET

    node_ids = {swarm.node_id(i) for i in range(3)}
    assert {a.node_id for a in done.assignments} == node_ids
    ledger = wait_for_ledger(swarm, job.id, node_ids)
    # The coordinator read hivemind's own progress records from the DHT (the ledger cross-checks epochs with them),
    # up to the job's last rounds: it reads them until the books close.
    settled = swarm.client.job(job.id)
    assert settled.dht_epoch is not None and settled.dht_epoch >= max(1, done.progress.global_step - 1), settled
    assert ledger.keys() == node_ids
    for row in ledger.values():  # every node's work was attested by its round's peers and paid
        assert row.samples > 0 and row.steps > 0 and row.compute_seconds > 0 and row.paid > 0, row
        assert row.flagged == 0, row
    # The data passes the job reports (what max_epochs counts) are the swarm's samples: the claims of the rounds
    # averaged. A member that loaded a peer's state once counted the round it missed at its own inner steps, ten
    # times the others', and stopped a demo job on max_epochs short of its target.
    passes = sum(row.claimed_samples for row in ledger.values()) / len(digits_split()[0])
    assert 0.5 * passes <= done.progress.epoch <= 1.5 * passes, (done.progress, passes)

    model = tmp_path / "model.pt"
    swarm.client.download_artifact(job.id, "model.pt", model)
    assert evaluate_builtin(read_model_file(model))["accuracy"] == pytest.approx(done.final_accuracy, abs=1e-6)


def test_local_updates_go_on_without_a_member_killed_mid_round(swarm):
    """Mode "diloco" (the default): each member schedules a round once its share is done, and the round begins when
    its group is full. With a member killed the group cannot fill: the others drop the round they scheduled once the
    member's record has expired (membership.MEMBER_TTL), match afresh, and go on training without it."""
    # An accuracy digits-mlp never reaches, in rounds of 20 inner steps: the job trains until it is cancelled.
    job = swarm.client.submit_job({**SPEC, "stop": {"target_accuracy": 0.999, "max_epochs": 1000},
                                   "training": {"inner_steps": 20}})
    swarm.wait(lambda: (j := swarm.client.job(job.id)).progress.global_step >= 2 and j.progress.peers >= 3, 180,
               "three members to average rounds together")
    swarm.kill_node(2)
    killed_at = swarm.client.job(job.id).progress.global_step
    swarm.wait(lambda: swarm.client.job(job.id).progress.global_step >= killed_at + 3, 240,
               "three more rounds after the kill")
    # (One survivor may instead join the group the other matched afresh, with nothing of its own to drop.)
    dropped = [i for i in (0, 1) if "a member left during the round" in swarm.worker_log(i, job.id)]
    assert dropped, [swarm.worker_log(i, job.id)[-3000:] for i in (0, 1)]
    swarm.client.cancel_job(job.id)


def test_job_survives_a_node_killed_mid_training(swarm):
    # Mode "sync": one global step per 3 s round, so the kill lands well before the target (with local updates
    # digits reaches it in a round or two).
    job = swarm.client.submit_job({**SPEC, "training": {"mode": "sync"}})
    # Mid-training: all three are in and the run has made a few averaged steps, but is far from the target.
    swarm.wait(lambda: (j := swarm.client.job(job.id)).progress.global_step >= 3
               and j.progress.peers >= 3, 180, "three peers to train together")
    victim = swarm.node_id(2)
    swarm.kill_node(2)

    done = wait_for_job(swarm, job.id)
    assert done.state == "completed", done
    assert done.final_accuracy >= TARGET
    lost = [a for a in done.assignments if a.node_id == victim]
    assert lost and lost[0].state == "lost", lost
    survivors = {a.node_id for a in done.assignments if a.node_id != victim}
    assert len(survivors) == 2


# The plain loop a lone member is compared with: the workload's own optimizer over its own batch stream (shard 0 of
# 1, the job's seed), one thread and subnormals flushed as in the node's trainer, for a given number of steps; run
# in a process of its own, so that this test's torch settings stay as they were. Writes the parameters.
PLAIN_LOOP = """
import sys, tempfile, torch
from pathlib import Path
from gpuswarm.node.trainer import ShardStream, build_workload, configure_torch, optimizer_spec
from gpuswarm.proto.models import JobSpec
spec, steps, out = JobSpec.model_validate_json(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
configure_torch(1)
workload, _ = build_workload(spec, None, None, torch.device("cpu"), Path(tempfile.mkdtemp()))
model = workload.build_model()
optimizer = optimizer_spec(workload).build([p for p in model.parameters() if p.requires_grad])
stream = ShardStream(workload, workload.ctx.seed)
stream.reshard(0, 1, 0)
for _ in range(steps):
    workload.loss(model, stream.next()).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
torch.save(model.state_dict(), out)
"""


def test_a_lone_member_trains_exactly_as_one_process_does(swarm_lab, tmp_path):
    """A job's only member (mode "diloco", outer SGD at rate 1: the default) averages nothing: after each round the
    anchor is its inner parameters bit for bit (LocalUpdates.land_on_inner), so its final model is the plain loop's
    after as many steps, to the last bit. Before, the outer step's float rounding reached the trainer every round,
    and at tinylm's target the two runs' parameters differed by up to 0.5."""
    lab = swarm_lab()
    lab.start_coordinator()
    lab.start_node(0)
    lab.wait_for_nodes(1)
    spec = {"name": "it-lone", "workload": "digits-mlp", "min_nodes": 1, "max_nodes": 1, "budget": 5.0,
            "stop": {"max_steps": 3, "max_epochs": 1000}, "training": {"inner_steps": 12}}
    job = lab.client.submit_job(spec)
    done = wait_for_job(lab, job.id, timeout=240.0)
    assert done.state == "completed", done
    node = lab.node_id(0)
    steps = wait_for_ledger(lab, job.id, {node})[node].steps
    assert steps == 3 * 12, steps  # three rounds of twelve inner steps

    model = tmp_path / "model.pt"
    lab.client.download_artifact(job.id, "model.pt", model)
    plain = tmp_path / "plain.pt"
    subprocess.run([sys.executable, "-c", PLAIN_LOOP, JobSpec.model_validate(spec).model_dump_json(), str(steps),
                    str(plain)], check=True, timeout=120)
    lone, reference = read_model_file(model).state_dict, torch.load(plain, weights_only=True)
    assert lone.keys() == reference.keys()
    different = [name for name in reference if not torch.equal(lone[name], reference[name])]
    assert not different, different
