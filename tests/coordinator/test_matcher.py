import pytest
from gpuswarm.coordinator.matcher import JobView, Match, NodeView, match, meets_requirements
from gpuswarm.proto.models import GPUInfo, JobSpec, JobState, Requirements, Resources

NOW = 10_000.0
LIVE = 30.0
CPU = Resources(cpu_cores=4, ram_gb=8)


def gpu(model="RTX4090", memory_gb=24.0, count=1) -> Resources:
    return Resources(cpu_cores=8, ram_gb=32, gpus=[GPUInfo(model=model, memory_gb=memory_gb, count=count)])


def node(nid, resources=CPU, price=0.0, last_seen=NOW, busy=False) -> NodeView:
    return NodeView(id=nid, resources=resources, price_per_gpu_hour=price, last_seen=last_seen, busy=busy)


def job(jid, created_at=0.0, state=JobState.PENDING, active=(), **spec) -> JobView:
    return JobView(id=jid, spec=JobSpec.model_validate({"workload": "digits-mlp"} | spec), state=state,
                   created_at=created_at, active_shards=frozenset(active))


def run(jobs, nodes, now=NOW):
    return match(jobs, nodes, now, liveness=LIVE)


def by_job(matches):
    out = {}
    for m in matches:
        out.setdefault(m.job_id, []).append(m.node_id)
    return out


@pytest.mark.parametrize("resources, req, ok", [
    (CPU, Requirements(), True),
    (CPU, Requirements(allow_cpu=False), False),
    (CPU, Requirements(min_gpu_memory_gb=1), False),
    (CPU, Requirements(gpu_models=["A100"]), False),
    (gpu(memory_gb=24), Requirements(min_gpu_memory_gb=24), True),
    (gpu(memory_gb=24), Requirements(min_gpu_memory_gb=40), False),
    (gpu(model="NVIDIA A100"), Requirements(gpu_models=["nvidia a100", "H100"]), True),
    (gpu(model="RTX4090"), Requirements(gpu_models=["A100"]), False),
    (gpu(), Requirements(allow_cpu=False), True),
])
def test_meets_requirements(resources, req, ok):
    assert meets_requirements(resources, req) is ok


def test_requirements_filter_nodes_in_match():
    nodes = [node("cpu"), node("small", gpu(model="GTX1080", memory_gb=8)),
             node("big", gpu(memory_gb=80, model="A100"))]
    j = job("j1", max_nodes=3, requirements={"min_gpu_memory_gb": 16, "allow_cpu": False})
    assert run([j], nodes) == [Match("j1", "big", 0, 3)]
    j = job("j1", max_nodes=3, requirements={"gpu_models": ["rtx4090"]})
    assert run([j], nodes + [node("rtx", gpu())]) == [Match("j1", "rtx", 0, 3)]


def test_price_cap():
    nodes = [node("cheap", price=1.0), node("exact", price=2.0), node("pricey", price=2.01)]
    assert sorted(by_job(run([job("j1", max_nodes=3, max_price_per_gpu_hour=2.0)], nodes))["j1"]) == ["cheap", "exact"]
    assert by_job(run([job("j1", max_nodes=3)], nodes))["j1"] == ["cheap", "exact", "pricey"]


def test_cheapest_nodes_first():
    nodes = [node("c", price=3.0), node("a", price=1.0), node("d", price=0.5), node("b", price=2.0)]
    assert run([job("j1", max_nodes=2)], nodes) == [Match("j1", "d", 0, 2), Match("j1", "a", 1, 2)]


def test_no_node_assigned_twice_across_jobs():
    nodes = [node(f"n{i}") for i in range(5)]
    jobs = [job(f"j{i}", created_at=i, max_nodes=2) for i in range(4)]
    matches = run(jobs, nodes)
    assert len(matches) == 5
    assert len({m.node_id for m in matches}) == 5


def test_busy_and_stale_nodes_are_not_matched():
    nodes = [node("busy", busy=True), node("stale", last_seen=NOW - LIVE - 0.1), node("edge", last_seen=NOW - LIVE),
             node("future", last_seen=NOW + 5)]
    assert sorted(by_job(run([job("j1", max_nodes=4)], nodes))["j1"]) == ["edge", "future"]


def test_fifo_by_created_at():
    nodes = [node("n1"), node("n2")]
    jobs = [job("late", created_at=5.0, max_nodes=2), job("early", created_at=1.0, max_nodes=2)]
    assert by_job(run(jobs, nodes)) == {"early": ["n1", "n2"]}


def test_only_pending_and_running_jobs_are_served():
    nodes = [node("n1")]
    for state in (JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED):
        assert run([job("j1", state=state)], nodes) == []


def test_pending_job_waits_for_min_nodes_without_holding_nodes():
    nodes = [node("n1"), node("n2")]
    big = job("big", created_at=1.0, min_nodes=3, max_nodes=3)
    small = job("small", created_at=2.0, min_nodes=1, max_nodes=1)
    assert run([big], nodes) == []
    assert run([big, small], nodes) == [Match("small", "n1", 0, 1)]  # backfill


def test_pending_job_starts_when_min_nodes_are_free():
    nodes = [node("n1"), node("n2"), node("n3")]
    matches = run([job("j1", min_nodes=2, max_nodes=5)], nodes)
    assert [m.shard_index for m in matches] == [0, 1, 2]
    assert {m.num_shards for m in matches} == {5}


def test_running_job_grows_to_max_nodes_with_fresh_shards():
    nodes = [node(f"n{i}") for i in range(5)]
    j = job("j1", state=JobState.RUNNING, active={0, 2}, min_nodes=3, max_nodes=4)
    matches = run([j], nodes)
    assert len(matches) == 2  # only up to max_nodes
    assert sorted(m.shard_index for m in matches) == [1, 3]
    assert all(m.num_shards == 4 for m in matches)


def test_running_job_takes_replacements_below_min_nodes():
    j = job("j1", state=JobState.RUNNING, active={1}, min_nodes=3, max_nodes=3)
    assert run([j], [node("n1")]) == [Match("j1", "n1", 0, 3)]


def test_full_running_job_takes_nothing_and_leaves_nodes_to_others():
    full = job("full", created_at=0.0, state=JobState.RUNNING, active={0, 1}, max_nodes=2)
    other = job("other", created_at=1.0)
    assert run([full, other], [node("n1")]) == [Match("other", "n1", 0, 1)]


def test_no_free_nodes_no_matches():
    assert run([job("j1")], []) == []
    assert run([], [node("n1")]) == []
