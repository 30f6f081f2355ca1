"""The matcher: a pure function from (jobs, nodes, now) to new assignments.

No I/O and no clock of its own, so it is unit-tested exhaustively and benchmarked alone. The rules:
- a node is a candidate when it heart-beat within `liveness` seconds, has no active assignment, meets the job's
  requirements and asks no more than the job's max price;
- jobs are served first come, first served; a job grows up to max_nodes, cheapest candidates first;
- a pending job starts only when at least min_nodes candidates are free at once; until then it holds no node, so
  a later, smaller job may use the free nodes (backfill);
- a running job that lost nodes takes replacements the same way, keeping shard indexes unique within the job.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from gpuswarm.proto.models import JobSpec, JobState, Requirements, Resources


@dataclass(frozen=True)
class NodeView:
    id: str
    resources: Resources
    price_per_gpu_hour: float
    last_seen: float
    busy: bool


@dataclass(frozen=True)
class JobView:
    id: str
    spec: JobSpec
    state: JobState
    created_at: float
    active_shards: frozenset[int] = field(default_factory=frozenset)


@dataclass(frozen=True)
class Match:
    job_id: str
    node_id: str
    shard_index: int
    num_shards: int


def meets_requirements(resources: Resources, req: Requirements) -> bool:
    if not resources.gpus:
        return req.allow_cpu and req.min_gpu_memory_gb == 0 and not req.gpu_models
    if resources.max_gpu_memory_gb < req.min_gpu_memory_gb:
        return False
    if req.gpu_models:
        allowed = {m.casefold() for m in req.gpu_models}
        return any(g.model.casefold() in allowed for g in resources.gpus)
    return True


def _eligible(node: NodeView, spec: JobSpec) -> bool:
    price_ok = spec.max_price_per_gpu_hour is None or node.price_per_gpu_hour <= spec.max_price_per_gpu_hour
    return price_ok and meets_requirements(node.resources, spec.requirements)


def match(jobs: Iterable[JobView], nodes: Sequence[NodeView], now: float, *, liveness: float) -> list[Match]:
    free = sorted(
        (n for n in nodes if not n.busy and now - n.last_seen <= liveness),
        key=lambda n: (n.price_per_gpu_hour, n.id),
    )
    taken: set[str] = set()
    matches: list[Match] = []
    open_jobs = sorted((j for j in jobs if j.state in (JobState.PENDING, JobState.RUNNING)),
                       key=lambda j: (j.created_at, j.id))
    for job in open_jobs:
        want = job.spec.max_nodes - len(job.active_shards)
        if want <= 0:
            continue
        candidates = [n for n in free if n.id not in taken and _eligible(n, job.spec)][:want]
        if len(job.active_shards) + len(candidates) < job.spec.min_nodes and job.state is JobState.PENDING:
            continue
        spare_shards = (i for i in range(job.spec.max_nodes) if i not in job.active_shards)
        for node, shard in zip(candidates, spare_shards, strict=False):
            taken.add(node.id)
            matches.append(Match(job.id, node.id, shard, job.spec.max_nodes))
    return matches
