"""End to end, the marketplace with real processes: a node that inflates its claims, and two jobs competing for
four nodes. A real coordinator, real node daemons, real hivemind rounds whose gather carries the signed claims.
"""

from __future__ import annotations

import pytest
from localswarm import LocalSwarm
from test_local_swarm import wait_for_job, wait_for_ledger

pytestmark = pytest.mark.integration
INFLATION = 10  # the lying node multiplies the samples and compute time in its own claims by this


@pytest.fixture
def lab(swarm_lab) -> LocalSwarm:
    swarm = swarm_lab()
    swarm.start_coordinator()
    return swarm


def test_a_node_that_inflates_its_claims_is_credited_only_what_its_peers_support(lab):
    for i in range(3):
        # Test-only fault injection (see gpuswarm.node.attest): node 2 inflates every claim it signs.
        lab.start_node(i, price=0.5, env={"GPUSWARM_FAULT_INFLATE_CLAIMS": str(INFLATION)} if i == 2 else None)
    lab.wait_for_nodes(3)
    # Mode "sync": many short rounds, so the liar's claims meet the cap after its first (unflagged) round.
    job = lab.client.submit_job({"workload": "digits-mlp", "min_nodes": 3, "max_nodes": 3, "budget": 5.0,
                                 "stop": {"target_accuracy": 0.9, "max_epochs": 40}, "training": {"mode": "sync"}})
    done = wait_for_job(lab, job.id)
    assert done.state == "completed", done
    liar, honest = lab.node_id(2), {lab.node_id(0), lab.node_id(1)}
    rows = wait_for_ledger(lab, job.id, honest | {liar})
    for node_id in honest:
        assert rows[node_id].samples > 0 and rows[node_id].flagged == 0, rows[node_id]
        # All attested and under the cap; at most a last solo round (a failed round at the end) goes unpaid.
        assert rows[node_id].samples >= 0.8 * rows[node_id].claimed_samples, rows[node_id]
    lying = rows[liar]
    assert lying.flagged > 0, lying
    # Its first round capped at 3x its peers' median share, every later one flagged and credited that share alone
    # (ledger.throughput_cap): less than it claimed, and about what an honest member was credited.
    assert lying.samples < 0.75 * lying.claimed_samples, lying
    # The share is scaled by the ratio of the nodes' GFLOP/s (the median of their passed challenges; here each
    # has had one), so a liar measured faster than its peers goes that much further.
    nodes = {n.id: n for n in lab.client.nodes()}
    speed = {n: nodes[n].measured_gflops for n in honest | {liar}}
    ratio = max((speed[liar] / speed[n] for n in honest if speed[liar] and speed[n]), default=1.0)
    assert lying.samples <= 2.0 * max(1.0, ratio) * max(rows[n].samples for n in honest), (lying, speed)
    reputation = {n.id: n.reputation for n in nodes.values()}
    assert reputation[liar] < min(reputation[n] for n in honest)


def test_two_jobs_compete_for_four_nodes_and_the_higher_bid_goes_first(lab):
    # A low target keeps the two jobs, which run one after the other, short: the order is what is tested here.
    cheap = lab.client.submit_job({"name": "low-bid", "workload": "digits-mlp", "min_nodes": 2, "max_nodes": 2,
                                   "max_price_per_gpu_hour": 1.0, "budget": 2.0,
                                   "stop": {"target_accuracy": 0.6, "max_epochs": 40}})
    rich_owner = lab.new_owner("rich")
    rich = rich_owner.submit_job({"name": "high-bid", "workload": "digits-mlp", "min_nodes": 2,
                                             "max_nodes": 3, "max_price_per_gpu_hour": 3.0, "budget": 5.0,
                                             "stop": {"target_accuracy": 0.6, "max_epochs": 40}})
    for i, price in enumerate([0.4, 0.5, 0.6, 0.9]):
        lab.start_node(i, price=price)
    lab.wait_for_nodes(4)
    first = wait_for_job(lab, rich.id, client=rich_owner)
    second = wait_for_job(lab, cheap.id)
    assert first.state == second.state == "completed", (first, second)
    # Submitted later, the higher bid started first and took three nodes; the other job waited, holding none.
    assert first.started_at < second.started_at
    assert len(first.assignments) == 3 and len(second.assignments) == 2
    # Never over-committed: no node held two assignments at once.
    spans: dict[str, list[tuple[float, float]]] = {}
    for job in (first, second):
        for a in job.assignments:
            spans.setdefault(a.node_id, []).append((a.created_at, a.ended_at or float("inf")))
    for intervals in spans.values():
        intervals.sort()
        assert all(end <= nxt for (_, end), (nxt, _) in zip(intervals, intervals[1:], strict=False)), spans
    for job, owner, bid in ((first, rich_owner, 3.0), (second, lab.client, 1.0)):
        statement = owner.job_statement(job.id)
        assert 0 < statement.paid <= statement.budget, statement
        prices = {a.price_per_gpu_hour for a in job.assignments}
        assert max(prices) <= bid  # the clearing price is each node's ask, never above the bid
