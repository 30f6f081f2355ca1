"""What the fault suite checks after each fault: the coordinator's books against the nodes' own records.

`missing_rows`: claims a node delivered (its outbox's `delivered.jsonl`: the coordinator took the report) for
which the coordinator's database holds no contribution row. `uncredited_epochs`: epochs of the job in which some
delivered claim was not credited (work lost to the fault). Read straight from the coordinator's database.
`steps_lost`: how far the swarm's global step fell back, from the node daemons' logs. `report` prints the
`FAULT {json}` line of a case: what docs/reliability.md tabulates.
"""

from __future__ import annotations

import asyncio
import json
import re
from datetime import datetime
from pathlib import Path

from gpuswarm.node.outbox import Outbox


def rows(database_url: str, query: str, **params) -> list[tuple]:
    """`query` (named :params) on the coordinator's database, through the product's own engine."""
    from gpuswarm.coordinator.db import make_engine
    from sqlalchemy import text

    async def run() -> list[tuple]:
        engine = make_engine(database_url)
        try:
            async with engine.connect() as connection:
                return [tuple(r) for r in (await connection.execute(text(query), params)).all()]
        finally:
            await engine.dispose()

    return asyncio.run(run())


def sqlite_url(data_dir: Path) -> str:
    return f"sqlite+aiosqlite:///{data_dir / 'coordinator.db'}"


def missing_rows(db: str, job_id: str, state_dirs: list[Path]) -> int:
    held = {s for (s,) in rows(db, "SELECT signature FROM contributions WHERE job_id = :job", job=job_id)}
    delivered = [d for state in state_dirs for d in Outbox(state / "outbox").delivered() if d["job_id"] == job_id]
    assert delivered, "no node recorded a delivered report"
    return sum(1 for d in delivered if d["signature"] not in held)


def undelivered(state_dirs: list[Path]) -> int:
    """Reports still waiting in the nodes' outboxes."""
    return sum(Outbox(state / "outbox").depth() for state in state_dirs)


def uncredited_epochs(db: str, job_id: str) -> int:
    return len(rows(db, "SELECT DISTINCT epoch FROM contributions WHERE job_id = :job AND status != 'credited'",
                    job=job_id))


def flagged(db: str, job_id: str) -> list[tuple]:
    return rows(db, "SELECT node_id, epoch, flag FROM contributions WHERE job_id = :job AND flag IS NOT NULL",
                job=job_id)


def settlements(db: str, job_id: str) -> int:
    """Refund transfers of the job's escrow (two ledger legs each): exactly one once its books are closed."""
    return len(rows(db, "SELECT id FROM ledger WHERE job_id = :job AND kind = 'refund'", job=job_id)) // 2


PROGRESS = re.compile(r"^(\S+ \S+) gpuswarm\.node\.daemon INFO job \S+ epoch \S+ step (\d+) ")


def steps_lost(logs: list[Path], fault_at: float) -> int:
    """How far the swarm's step went back, from the progress lines of the node daemons' logs: the highest step
    any node logged before the fault, less the lowest any logged after it (0: every node went on from there)."""
    logged = []
    for log in logs:
        for line in log.read_text(errors="replace").splitlines():
            if m := PROGRESS.match(line):
                logged.append((datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f").timestamp(), int(m[2])))
    before = max((s for t, s in logged if t < fault_at), default=0)
    after = min((s for t, s in logged if t > fault_at + 1.0), default=before)
    return max(0, before - after)


def report(case: str, **figures) -> None:
    print("FAULT " + json.dumps({"case": case, **figures}), flush=True)
