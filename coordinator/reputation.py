"""Node reputation: a score in [0, 1] from a node's record, and the query that gathers that record.

`score` is pure. Each part is a smoothed success rate (a Laplace prior of one success and one failure), so a new
node starts in the middle at 0.5 and one bad event does not sink an otherwise good record:
- uptime: seconds online / seconds since registration (weight 0.2);
- assignments: completed / (completed + abandoned), where abandoned means the node crashed or went silent
  (weight 0.3);
- challenges: GPU challenges passed / taken (weight 0.3);
- honesty: 1 / (1 + flagged claims), where a flagged claim was over its measured throughput, an equivocation, or
  never attested (weight 0.2).
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuswarm.coordinator.db import AssignmentRow, Contribution, Node, in_chunks
from gpuswarm.proto.models import AssignmentState
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

WEIGHTS = {"uptime": 0.2, "assignments": 0.3, "challenges": 0.3, "honesty": 0.2}


@dataclass(frozen=True)
class Record:
    uptime: float = 0.5  # fraction of time online since registration
    completed: int = 0
    abandoned: int = 0
    challenges_passed: int = 0
    challenges_failed: int = 0
    flagged_claims: int = 0


def _rate(good: int, bad: int) -> float:
    return (good + 1) / (good + bad + 2)


def score(record: Record) -> float:
    parts = {
        "uptime": min(max(record.uptime, 0.0), 1.0),
        "assignments": _rate(record.completed, record.abandoned),
        "challenges": _rate(record.challenges_passed, record.challenges_failed),
        "honesty": 1.0 / (1.0 + record.flagged_claims),
    }
    return round(sum(WEIGHTS[k] * v for k, v in parts.items()), 4)


async def records(session: AsyncSession, nodes: list[Node], now: float) -> dict[str, Record]:
    """The record of each of `nodes`, from the nodes table, assignments and flagged claims (two grouped queries
    per `in_chunks` list of nodes)."""
    ended = {AssignmentState.FINISHED.value: "completed", AssignmentState.FAILED.value: "abandoned",
             AssignmentState.LOST.value: "abandoned"}
    counts: dict[str, dict[str, int]] = {n.id: {"completed": 0, "abandoned": 0} for n in nodes}
    flagged: dict[str, int] = {}
    for ids in in_chunks(counts):  # the matcher's tick asks for every online node
        for node_id, state, n in await session.execute(
                select(AssignmentRow.node_id, AssignmentRow.state, func.count())
                .where(AssignmentRow.node_id.in_(ids), AssignmentRow.state.in_(list(ended)))
                .group_by(AssignmentRow.node_id, AssignmentRow.state)):
            counts[node_id][ended[state]] += n
        flagged.update((await session.execute(
            select(Contribution.node_id, func.count())
            .where(Contribution.node_id.in_(ids), Contribution.flag.is_not(None))
            .group_by(Contribution.node_id))).all())
    return {n.id: Record(uptime=n.online_seconds / max(now - n.registered_at, 1.0), **counts[n.id],
                         challenges_passed=n.challenges_passed or 0,
                         challenges_failed=n.challenges_failed or 0,
                         flagged_claims=flagged.get(n.id, 0)) for n in nodes}
