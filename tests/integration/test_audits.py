"""End to end, refereed re-execution: a colluding pair that trains nothing is caught by third nodes re-computing
its rounds, banned, and made to give back its pay; the job goes on with honest nodes and reaches its target, and
their rounds pass the same audit. Real coordinator (every credited round audited), real node daemons; the
referees fetch the evidence and re-compute it in their sandboxed workers.
"""

from __future__ import annotations

import pytest
from localswarm import LocalSwarm
from test_local_swarm import wait_for_job

pytestmark = pytest.mark.integration
LAZY, HONEST, REFEREE = (0, 1), (2, 3), 4
TARGET = 0.9


@pytest.fixture
def lab(swarm_lab) -> LocalSwarm:
    swarm = swarm_lab()
    swarm.start_coordinator("--audit-rate", "1")
    # The pair asks least, so the job takes it first. Test-only fault injection (gpuswarm.node.worker): their
    # workers claim every batch without computing it, and attest each other's claims in their rounds.
    for i in LAZY:
        swarm.start_node(i, price=0.1, env={"GPUSWARM_FAULT_LAZY": "1"})
    for i in HONEST:
        swarm.start_node(i, price=0.5)
    swarm.start_node(REFEREE, price=5.0)  # too dear for the job: a referee only
    swarm.wait_for_nodes(5)
    return swarm


def test_a_lazy_colluding_pair_is_caught_banned_and_repaid_and_honest_rounds_pass(lab):
    # The pair's job first (only the pair asks little enough for it), then an honest one on nodes 2 and 3.
    spec = {"workload": "digits-mlp", "min_nodes": 2, "max_nodes": 2, "budget": 5.0,
            "stop": {"target_accuracy": TARGET, "max_epochs": 200}, "training": {"inner_steps": 50}}
    # The pair computes nothing, so its rounds take only their all-reduce (about 2 s here) and count 2.2 epochs of
    # samples each: at 200 epochs its job ended in 2 minutes, before the referees (a minute per re-computation on
    # this machine) had convicted either, and its assignments ended completed, not banned.
    lazy_job = lab.client.submit_job({**spec, "name": "lazy", "max_price_per_gpu_hour": 0.2,
                                      "stop": {"target_accuracy": TARGET, "max_epochs": 5000}})
    lab.wait(lambda: len(lab.client.job(lazy_job.id).assignments) == 2, 60, "the pair to take its job")
    honest_job = lab.client.submit_job({**spec, "name": "honest", "max_price_per_gpu_hour": 1.0})
    lazy, honest = {lab.node_id(i) for i in LAZY}, {lab.node_id(i) for i in HONEST}

    def audits_where(job_id: str, state: str) -> list:
        return [a for a in lab.client.job_audits(job_id).audits if a.state == state]

    # Each of the pair is convicted by two referees (on one of its audits or two), none of them the pair, and
    # banned. The second failing verdict bans it and fails that audit; its other audit with a failing verdict is
    # failed at the next tick, or when the referee re-computing it for a second opinion answers.
    lab.wait(lambda: {a.node_id: a.state for a in lab.client.job(lazy_job.id).assignments} == dict.fromkeys(
        lazy, "banned"), 420, "the pair to be banned from its job")

    def convicting(n: str) -> set[str]:
        return {r for a in audits_where(lazy_job.id, "failed") if a.node_id == n for r in a.referees}

    lab.wait(lambda: all(len(convicting(n)) >= 2 for n in lazy), 120, "two referees' failed audits of each")
    failed = audits_where(lazy_job.id, "failed")
    assert not {r for a in failed for r in a.referees} & lazy, failed
    assert all(a.reason for a in failed), failed
    lab.client.cancel_job(lazy_job.id)
    statement = {r.node_id: r for r in lab.client.job_statement(lazy_job.id).nodes}
    for n in lazy:
        assert statement[n].paid == 0 and statement[n].flagged > 0, statement[n]

    # The honest job trains to its target, its rounds pass the same audits, and its nodes keep their pay.
    done = wait_for_job(lab, honest_job.id, timeout=300)
    assert done.state == "completed" and done.final_accuracy >= TARGET, done
    assert {a.node_id for a in done.assignments} == honest
    lab.wait(lambda: audits_where(honest_job.id, "passed"), 240, "an honest round to pass its audit")
    assert not audits_where(honest_job.id, "failed")
    for a in audits_where(honest_job.id, "passed"):
        assert a.distance is not None and a.distance <= 0.05 and not set(a.referees) & honest, a
    statement = {r.node_id: r for r in lab.client.job_statement(honest_job.id).nodes}
    for n in honest:
        assert statement[n].paid > 0 and statement[n].flagged == 0, statement[n]
