"""The tick's matching step (`coordinator.matching`) against a real database (both, `database_url`).

The tick reads each pending job's owner balance once and keeps it current as it reserves budgets, writes the new
assignments and their history lines in bulk, and keeps nodes' validated resources from one tick to the next by
their JSON text. These tests hold it to what the ledger and the matcher would decide one job and one node at a time.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from gpuswarm.coordinator import app, jobs, ledger, matching
from gpuswarm.coordinator.config import CoordinatorConfig
from gpuswarm.coordinator.db import AssignmentRow, Job, JobEvent, LedgerEntry, Node, Owner, make_engine, sessionmaker
from gpuswarm.proto.models import Resources
from sqlalchemy import func, insert, select, update

CODE = {"sha256": "ab" * 32, "size": 1024, "format": "tar", "entrypoint": "train:workload"}


@pytest.fixture
async def sessions(tmp_path: Path, database_url: str | None):
    from gpuswarm.coordinator.migrate import upgrade

    engine = make_engine(database_url or f"sqlite+aiosqlite:///{tmp_path / 'coordinator.db'}")
    await upgrade(engine)
    yield sessionmaker(engine)
    await engine.dispose()


@pytest.fixture
def config(tmp_path: Path) -> CoordinatorConfig:
    return CoordinatorConfig(data_dir=tmp_path, node_timeout=60.0)


async def _fill(sessions, now: float, *, credits: float, jobs: list[dict], nodes: int,
                resources: dict | None = None) -> None:
    async with sessions.begin() as session:
        session.add(Owner(id="o-1", name="owner", token_hash="0" * 64, created_at=now))
        ledger.transfer(session, ledger.MINT, ledger.owner_account("o-1"), ledger.micro(credits), "grant", now)
        await session.flush()
        await session.execute(insert(Node), [
            {"id": f"n{k:015d}", "public_key": f"{k:044d}",
             "resources": resources or {"cpu_cores": 4, "ram_gb": 8.0}, "software_version": "test",
             "endpoints": [], "state": "idle", "registered_at": now - 100, "last_seen": now,
             "online_seconds": 50.0} for k in range(nodes)])
        await session.execute(insert(Job), [
            {"id": f"j-{k:012d}", "spec": spec, "state": "pending", "created_at": now + k, "owner_id": "o-1"}
            for k, spec in enumerate(jobs)])


async def _count(sessions, model, *where) -> int:
    async with sessions() as session:
        return await session.scalar(select(func.count()).select_from(model).where(*where))


async def _states(sessions) -> dict[str, str]:
    async with sessions() as session:
        return dict((await session.execute(select(Job.id, Job.state))).all())


async def test_one_owners_jobs_start_only_while_its_balance_covers_them(sessions, config):
    now = time.time()
    # 25 credits: each job alone looks funded, but only the first two fit; each wants two of the eight nodes.
    spec = {"workload": "digits-mlp", "budget": 10.0, "min_nodes": 2, "max_nodes": 2}
    await _fill(sessions, now, credits=25.0, jobs=[spec] * 3, nodes=8)

    await app.tick(sessions, config, now)
    assert await _states(sessions) == {"j-000000000000": "running", "j-000000000001": "running",
                                       "j-000000000002": "pending"}
    async with sessions() as session:
        assert await ledger.balance(session, ledger.owner_account("o-1")) == ledger.micro(5.0)
        for job_id in ("j-000000000000", "j-000000000001"):
            assert await ledger.balance(session, ledger.escrow_account(job_id)) == ledger.micro(10.0)
        assert await ledger.balance(session, ledger.escrow_account("j-000000000002")) == 0
    assert await _count(sessions, AssignmentRow) == 4
    assert await _count(sessions, AssignmentRow, AssignmentRow.job_id == "j-000000000002") == 0
    assert await _count(sessions, JobEvent, JobEvent.message.startswith("assigned node")) == 4
    assert await _count(sessions, JobEvent, JobEvent.message.startswith("running; budget")) == 2

    entries = await _count(sessions, LedgerEntry)
    await app.tick(sessions, config, now + 1)  # the same market a tick later: nothing more to start or reserve
    assert await _count(sessions, LedgerEntry) == entries
    assert await _count(sessions, AssignmentRow) == 4
    assert (await _states(sessions))["j-000000000002"] == "pending"


async def test_a_node_is_matched_by_the_resources_it_registered_last(sessions, config):
    now = time.time()
    federated = {"code": CODE, "local_dataset": "clinic-a", "budget": 1.0}
    await _fill(sessions, now, credits=10.0, jobs=[federated], nodes=1,
                resources={"cpu_cores": 4, "ram_gb": 8.0, "custom_code": True})
    await app.tick(sessions, config, now)  # validated (and kept) without the dataset: no match
    assert await _count(sessions, AssignmentRow) == 0

    with_dataset = Resources(cpu_cores=4, ram_gb=8.0, custom_code=True, datasets=["clinic-a"])
    async with sessions.begin() as session:  # what a re-registration writes
        await session.execute(update(Node).values(resources=with_dataset.model_dump(mode="json")))
    await app.tick(sessions, config, now + 1)
    assert await _states(sessions) == {"j-000000000000": "running"}
    assert await _count(sessions, AssignmentRow, AssignmentRow.node_id == "n000000000000000") == 1


async def test_a_node_whose_rtts_are_json_null_is_matched_like_one_without(sessions, config):
    now = time.time()
    spec = {"workload": "digits-mlp", "budget": 1.0, "min_nodes": 1, "max_nodes": 3}
    await _fill(sessions, now, credits=10.0, jobs=[spec], nodes=3)
    async with sessions.begin() as session:
        # A running job with one member wants two more: the matcher reads every candidate's RTTs to that member.
        await session.execute(update(Job).values(state="running", started_at=now))
        session.add(AssignmentRow(job_id="j-000000000000", node_id="n000000000000000", state="active",
                                  shard_index=0, num_shards=3, created_at=now, gpus=1))
        await session.execute(update(Node).where(Node.id == "n000000000000001").values(peer_rtt_ms=None))  # 'null'
        await session.execute(update(Node).where(Node.id == "n000000000000002")
                              .values(peer_rtt_ms={"n000000000000000": 12.0}))
    await app.tick(sessions, config, now)
    assert await _count(sessions, AssignmentRow, AssignmentRow.state == "active") == 3


def _while_matching(monkeypatch, sessions, change) -> None:
    """Make `change` (a coroutine function taking a session) commit from the event loop while the tick's matcher runs
    in its thread, as a request would. PostgreSQL only: on SQLite the tick holds the one connection throughout."""
    loop = asyncio.get_running_loop()
    views_and_match = matching._views_and_match

    async def commit() -> None:
        async with sessions.begin() as session:
            await change(session)

    def changed_meanwhile(*args):
        asyncio.run_coroutine_threadsafe(commit(), loop).result(timeout=30)
        return views_and_match(*args)

    monkeypatch.setattr(matching, "_views_and_match", changed_meanwhile)


async def test_what_commits_while_the_matcher_runs_is_not_overwritten(tmp_path, postgres_url, config, monkeypatch):
    from gpuswarm.coordinator.migrate import upgrade

    engine = make_engine(postgres_url)
    await upgrade(engine)
    sessions = sessionmaker(engine)
    now = time.time()
    spec = {"workload": "digits-mlp", "budget": 10.0, "min_nodes": 2, "max_nodes": 2}
    await _fill(sessions, now, credits=25.0, jobs=[spec] * 3, nodes=6)

    async def cancel_revoke_and_withdraw(session) -> None:
        cancelled = await session.get(Job, "j-000000000000")
        await jobs.apply(session, cancelled, jobs.Event.CANCEL, now, "cancelled by its owner")
        await session.execute(update(Node).where(Node.id == "n000000000000002").values(revoked=True, online=False))
        ledger.transfer(session, ledger.owner_account("o-1"), ledger.MINT, ledger.micro(12.0), "adjust", now)

    try:
        _while_matching(monkeypatch, sessions, cancel_revoke_and_withdraw)
        await app.tick(sessions, config, now)
        # The matcher saw 25 credits, three jobs and six nodes, and gave each job two. Meanwhile the first job was
        # cancelled, a node one job was given was revoked (that job takes none this tick), and 12 credits went: the
        # 13 left start exactly one of the other jobs.
        states = await _states(sessions)
        assert states["j-000000000000"] == "cancelled"
        assert sorted(states.values()) == ["cancelled", "pending", "running"]
        assert await _count(sessions, AssignmentRow, AssignmentRow.job_id == "j-000000000000") == 0
        assert await _count(sessions, AssignmentRow, AssignmentRow.node_id == "n000000000000002") == 0
        assert await _count(sessions, AssignmentRow) == 2
        async with sessions() as session:
            assert await ledger.balance(session, ledger.owner_account("o-1")) == ledger.micro(3.0)
    finally:
        await engine.dispose()
