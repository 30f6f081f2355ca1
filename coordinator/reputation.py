"""Node reputation: a score in [0, 1] from a node's record, and the queries that gather that record.

`score` and `scores_of` are pure; `history` is the query. Each part is a smoothed success rate (a Laplace prior
of one success and one failure), so a new node starts in the middle at 0.5 and one bad event does not sink an
otherwise good record:
- uptime: seconds online / seconds since registration (weight 0.2);
- assignments: completed / (completed + abandoned), where abandoned means the node crashed or went silent
  (weight 0.3);
- challenges: GPU challenges passed / taken (weight 0.3);
- honesty: 1 / (1 + flagged claims), where a flagged claim was over its measured throughput, an equivocation, or
  never attested (weight 0.2).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from gpuswarm.coordinator.db import AssignmentRow, Contribution, Node
from gpuswarm.proto.models import AssignmentState
from sqlalchemy import Row, func, select
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
    """The weighted sum of the record's parts (WEIGHTS, in that order), rounded to four places."""
    return round(WEIGHTS["uptime"] * min(max(record.uptime, 0.0), 1.0)
                 + WEIGHTS["assignments"] * _rate(record.completed, record.abandoned)
                 + WEIGHTS["challenges"] * _rate(record.challenges_passed, record.challenges_failed)
                 + WEIGHTS["honesty"] * (1.0 / (1.0 + record.flagged_claims)), 4)


async def history(session: AsyncSession) -> dict[str, tuple[int, int, int]]:
    """Completed and abandoned assignments and flagged claims, by node id, of every node that has any.

    Its callers want every node's score, or every online one's (tens of thousands in a large swarm), so the two
    grouped queries count every node's history rather than name the nodes: no IN list of 100,000 ids to compile and
    bind, and only the nodes with an ended assignment or a flagged claim come back."""
    ended = {AssignmentState.FINISHED.value: 0, AssignmentState.FAILED.value: 1, AssignmentState.LOST.value: 1}
    counts: dict[str, list[int]] = {}
    for node_id, state, n in await session.execute(
            select(AssignmentRow.node_id, AssignmentRow.state, func.count())
            .where(AssignmentRow.state.in_(list(ended))).group_by(AssignmentRow.node_id, AssignmentRow.state)):
        counts.setdefault(node_id, [0, 0, 0])[ended[state]] += n
    for node_id, n in await session.execute(
            select(Contribution.node_id, func.count()).where(Contribution.flag.is_not(None))
            .group_by(Contribution.node_id)):
        counts.setdefault(node_id, [0, 0, 0])[2] += n
    return {node_id: (c[0], c[1], c[2]) for node_id, c in counts.items()}


def scores_of(nodes: Iterable[Node | Row], history: dict[str, tuple[int, int, int]], now: float) -> dict[str, float]:
    """The score of each of `nodes` (Node rows, or rows of at least its id, online_seconds, registered_at and
    challenge counts), given `history`."""
    none = (0, 0, 0)
    out = {}
    for n in nodes:
        completed, abandoned, flagged = history.get(n.id, none)
        out[n.id] = score(Record(n.online_seconds / max(now - n.registered_at, 1.0), completed, abandoned,
                                 n.challenges_passed or 0, n.challenges_failed or 0, flagged))
    return out


async def scores(session: AsyncSession, nodes: Iterable[Node | Row], now: float) -> dict[str, float]:
    return scores_of(nodes, await history(session), now)
