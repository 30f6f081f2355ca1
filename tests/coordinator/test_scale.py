"""The coordinator's queries over every online node or open job, on a market larger than one query can name.

asyncpg refuses a query with more than 32,767 arguments: before `db.in_chunks`, a tick over 40,000 online nodes
failed at its first `IN` list on PostgreSQL (the reputation query), every tick, so nothing was matched or settled
and silent nodes were never taken offline. Each test runs on both databases (`database_url`), with more nodes and
jobs than that limit.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from gpuswarm.coordinator import app, ledger, reputation
from gpuswarm.coordinator.db import AssignmentRow, Job, Node, Owner, in_chunks, make_engine, sessionmaker
from gpuswarm.coordinator.migrate import upgrade
from hypothesis import given
from hypothesis import strategies as st
from sqlalchemy import insert, select

MANY = 33_000  # past asyncpg's 32,767 arguments a query


@given(st.lists(st.integers()), st.integers(1, 10))
def test_in_chunks_keeps_every_value_once_in_order_within_the_size(values, size):
    chunks = list(in_chunks(values, size))
    assert [v for chunk in chunks for v in chunk] == values
    assert all(0 < len(chunk) <= size for chunk in chunks)


@pytest.fixture
async def sessions(tmp_path: Path, database_url: str | None):
    engine = make_engine(database_url or f"sqlite+aiosqlite:///{tmp_path / 'coordinator.db'}")
    await upgrade(engine)
    now = time.time()
    async with engine.begin() as connection:
        await connection.execute(insert(Owner.__table__), [
            {"id": "o-1", "name": "owner", "token_hash": "0" * 64, "created_at": now}])
        await connection.execute(insert(Node.__table__), [
            {"id": f"n{k:015d}", "public_key": f"{k:044d}", "resources": {"cpu_cores": 4, "ram_gb": 8.0},
             "software_version": "test", "endpoints": [], "state": "idle", "registered_at": now - 100,
             "last_seen": now, "online_seconds": 50.0} for k in range(MANY)])
        await connection.execute(insert(Job.__table__), [
            {"id": "j-1", "spec": {"workload": "digits-mlp"}, "state": "completed", "created_at": now,
             "owner_id": "o-1"}])
        await connection.execute(insert(AssignmentRow.__table__), [  # the last node: one finished, two lost
            {"job_id": "j-1", "node_id": f"n{MANY - 1:015d}", "state": state, "shard_index": 0, "num_shards": 1,
             "created_at": now} for state in ("finished", "lost", "lost")])
    yield sessionmaker(engine)
    await engine.dispose()


async def test_every_online_nodes_score_in_one_call(sessions):
    async with sessions() as session:
        nodes = (await session.scalars(select(Node))).all()
        scores = await reputation.scores(session, nodes, nodes[0].registered_at + 100)
    assert len(scores) == MANY
    uptime = 0.2 * 0.5  # online 50 s of the 100 since registration; no challenges, no flagged claims
    assert scores["n000000000000000"] == round(uptime + 0.3 * 0.5 + 0.3 * 0.5 + 0.2, 4)
    assert scores[f"n{MANY - 1:015d}"] == round(uptime + 0.3 * (1 + 1) / (3 + 2) + 0.3 * 0.5 + 0.2, 4)


async def test_bans_of_every_open_job_in_one_call(sessions):
    async with sessions() as session:
        assert await ledger.banned(session, [f"j-{k}" for k in range(MANY)]) == {}


async def test_dht_bootstrap_peers_from_every_live_advert(sessions):
    adverts = {"gone": {"state": "idle", "maddrs": ["/ip4/10.0.0.2/tcp/1"]}}  # not registered here: left out
    adverts |= {f"n{k:015d}": {"state": "idle", "maddrs": [f"/ip4/10.0.0.1/tcp/{k}"]} for k in range(MANY)}
    peers = await app.node_peers(sessions, adverts)
    assert peers and all(p.startswith("/ip4/10.0.0.1/") for p in peers)
