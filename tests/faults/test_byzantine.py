"""A Byzantine node among four, end to end: real coordinator, node daemons and hivemind rounds on one host.

Node 3 sends the other reducers its gradients sign-flipped and scaled 100 times, or as NaN, in every round, while
its own model stays honest (test-only fault injection, GPUSWARM_FAULT_BYZANTINE, see gpuswarm.node.faults). Every
round reduces robustly (decision 0024), so the job still reaches its target; each honest node's reducer names the
same single peer in its `outliers.jsonl` and in its round reports, so the coordinator bans that node from the job;
no honest node is flagged and those whose rounds were attested are paid; it is not.
Part of the fault suite (about 90 s a case): `scripts/test -m faults -s tests/faults/test_byzantine.py`.
"""

from __future__ import annotations

import json
import time

import pytest
from localswarm import LocalSwarm

pytestmark = pytest.mark.faults


@pytest.fixture
def lab(swarm_lab) -> LocalSwarm:
    swarm = swarm_lab()
    swarm.start_coordinator()
    return swarm


@pytest.mark.parametrize("attack", ["-100", "nan"])
def test_a_byzantine_node_cannot_steer_the_model(lab, attack):
    for i in range(4):
        lab.start_node(i, price=0.5, env={"GPUSWARM_FAULT_BYZANTINE": attack} if i == 3 else None)
    lab.wait_for_nodes(4)
    job = lab.client.submit_job({"workload": "digits-mlp", "min_nodes": 4, "max_nodes": 4, "budget": 5.0,
                                 "stop": {"target_accuracy": 0.9, "max_epochs": 40}, "training": {"mode": "sync"}})
    deadline = time.monotonic() + 420
    while (done := lab.client.job(job.id)).state not in ("completed", "failed", "cancelled"):
        assert time.monotonic() < deadline, f"job still {done.state}: {done.progress}"
        time.sleep(1.0)
    assert done.state == "completed" and done.final_accuracy >= 0.9, done
    named = []
    for i in range(3):  # a reducer names only the senders of the slices it reduces: two of three must have seen it
        lines = [line for log in (lab.root / f"node-{i}" / "jobs").glob("*/outliers.jsonl")
                 for line in log.read_text().splitlines()]
        named.append({json.loads(line)["peer_id"] for line in lines})
    assert sum(1 for peers in named if peers) >= 2, named
    assert len(set.union(*named)) == 1, named  # the same one peer, and no honest one
    bad, honest = lab.node_id(3), {lab.node_id(i) for i in range(3)}
    states = {a.node_id: a.state for a in done.assignments}
    assert states[bad] == "banned", done.assignments
    banned_at = next(a.ended_at for a in done.assignments if a.node_id == bad)
    deadline = time.monotonic() + 60
    while not (statement := lab.client.job_statement(job.id)).settled:
        assert time.monotonic() < deadline, "the job's books were not closed"
        time.sleep(1.0)
    rows = {r.node_id: r for r in statement.nodes}
    assert all(rows[n].flagged == 0 for n in honest if n in rows), rows
    # Unattested work is unpaid (the credit rule). CI once saw one honest node's 4 claims all unattested, likely a
    # node that fell behind the others' one-second rounds on the loaded two-core host (its logs were not kept). It
    # must never be flagged, and the honest nodes whose rounds were attested are paid.
    for i in range(3):  # what the next reader of CI's output needs to see why an honest node went unpaid
        if rows.get(lab.node_id(i)) is None or rows[lab.node_id(i)].paid == 0:
            print(f"honest node {i} unpaid; the tail of its log:\n{lab.log_tail(f'node-{i}', 25)}")
    assert sum(1 for n in honest if n in rows and rows[n].paid > 0) >= 2, rows
    assert all(rows[n].paid > 0 for n in honest if n in rows and rows[n].samples > 0), rows  # credited is paid
    assert bad not in rows or rows[bad].paid == 0, rows[bad]
    started = min(a.created_at for a in done.assignments)
    figures = {"case": f"byzantine node ({attack})", "accuracy": done.final_accuracy,
               "banned_after_s": round(banned_at - started, 1),
               "honest_credited": sorted(f"{rows[n].samples}/{rows[n].claimed_samples}" for n in honest if n in rows)}
    print(f"FAULT {json.dumps(figures)}")
