"""Schema migrations on real SQLite and PostgreSQL: the models and the revision scripts must describe one schema.

When test_models_match_the_migrations fails, a model in coordinator/db.py changed without a revision: run
scripts/new-migration "what changed", read the script it writes, and commit it.
"""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import pytest
from gpuswarm.coordinator import migrate
from gpuswarm.coordinator.cli import coordinator_app
from gpuswarm.coordinator.db import Base, make_engine
from sqlalchemy import inspect, text
from typer.testing import CliRunner

BEFORE_MIGRATIONS_SQL = Path(__file__).parent / "data" / "schema-before-migrations.sql"


@pytest.fixture
def url(database_url: str | None, tmp_path: Path) -> str:
    """An empty database: PostgreSQL's from the shared fixture, SQLite's a new file."""
    return database_url or f"sqlite+aiosqlite:///{tmp_path / 'coordinator.db'}"


async def table_names(url: str) -> set[str]:
    engine = make_engine(url)
    try:
        async with engine.connect() as conn:
            return set(await conn.run_sync(lambda c: inspect(c).get_table_names()))
    finally:
        await engine.dispose()


def test_the_migrations_form_one_line():
    assert migrate.head(), "no revision scripts in coordinator/migrations/versions"
    assert (migrate.MIGRATIONS_DIR / "script.py.mako").is_file()


async def test_models_match_the_migrations(url: str):
    await migrate.upgrade(url, replay_revisions=True)
    differences = await migrate.schema_differences(url)
    assert not differences, (
        "coordinator/db.py and the migrations disagree; write a revision with\n"
        f"    {migrate.NEW_MIGRATION_COMMAND}\n"
        "then read it and commit it. What autogenerate sees:\n" + "\n".join(f"  {d}" for d in differences))


async def test_empty_database_upgrades_to_head_downgrades_to_base_and_up_again(url: str):
    assert await migrate.current_revision(url) is None
    assert await migrate.upgrade(url, replay_revisions=True) == (None, migrate.head())
    assert set(Base.metadata.tables) <= await table_names(url)
    assert await migrate.upgrade(url) == (migrate.head(), migrate.head())  # already there: nothing to do

    assert await migrate.downgrade(url, "base") == (migrate.head(), None)
    assert await table_names(url) <= {"alembic_version"}

    assert await migrate.upgrade(url, replay_revisions=True) == (None, migrate.head())
    assert await migrate.schema_differences(url) == []


async def test_an_empty_database_is_created_from_the_models_and_stamped_head(url: str):
    """The app's start on a new database: no revision replayed, the same schema, and later revisions apply."""
    assert await migrate.upgrade(url) == (None, migrate.head())
    assert await migrate.schema_differences(url) == []
    revisions = [script.revision for script in migrate.script_directory().walk_revisions()]
    if len(revisions) > 1:  # the newest revision's downgrade and upgrade work on a schema made this way too
        assert await migrate.downgrade(url, revisions[1]) == (revisions[0], revisions[1])
        assert await migrate.upgrade(url) == (revisions[1], revisions[0])


async def test_each_revision_downgrades_one_step_and_upgrades_again(url: str):
    revisions = [script.revision for script in migrate.script_directory().walk_revisions()]  # newest first
    await migrate.upgrade(url, replay_revisions=True)
    for newer, older in zip(revisions, revisions[1:], strict=False):
        assert await migrate.downgrade(url, older) == (newer, older)
    for older, newer in zip(reversed(revisions), list(reversed(revisions))[1:], strict=False):
        assert await migrate.upgrade(url, newer) == (older, newer)
    assert await migrate.schema_differences(url) == []


def database_from_before_migrations(path: Path, rows: bool) -> str:
    """A SQLite file exactly as `create_all` made it before migrations existed, optionally with a few rows."""
    with sqlite3.connect(path) as db:
        db.executescript(BEFORE_MIGRATIONS_SQL.read_text())
        if rows:
            db.execute("INSERT INTO nodes VALUES ('n1', 'pk1', '{}', 'v', 0.5, '[]', 'idle', 1.0, 2.0, 1, 0, "
                       "NULL, NULL, NULL)")
            db.execute("INSERT INTO seen_nonces VALUES ('nonce1', 99.0)")
    return f"sqlite+aiosqlite:///{path}"


async def test_database_from_before_migrations_is_adopted_with_its_rows(tmp_path: Path):
    url = database_from_before_migrations(tmp_path / "old.db", rows=True)
    assert await migrate.upgrade(url, migrate.BASELINE) == (None, migrate.BASELINE)
    with sqlite3.connect(tmp_path / "old.db") as db:
        assert db.execute("SELECT id, public_key, price_per_gpu_hour FROM nodes").fetchall() == [("n1", "pk1", 0.5)]
        assert db.execute("SELECT * FROM seen_nonces").fetchall() == [("nonce1", 99.0)]
        ddl = db.execute("SELECT sql FROM sqlite_master WHERE name = 'nodes'").fetchone()[0]
    assert "CONSTRAINT uq_nodes_public_key UNIQUE" in ddl  # named now, so a later revision can drop it


async def test_database_from_before_migrations_upgrades_to_head(tmp_path: Path):
    url = database_from_before_migrations(tmp_path / "old.db", rows=False)
    assert await migrate.upgrade(url) == (None, migrate.head())
    assert await migrate.schema_differences(url) == []


def test_migrate_command_prints_the_revision_before_and_after(tmp_path: Path, monkeypatch):
    monkeypatch.delenv("DATABASE_URL", raising=False)
    runner = CliRunner()
    first = runner.invoke(coordinator_app, ["migrate", "--data-dir", str(tmp_path / "c")])
    assert first.exit_code == 0, first.output
    assert "revision before: none" in first.output and f"revision after:  {migrate.head()}" in first.output
    again = runner.invoke(coordinator_app, ["migrate", "--data-dir", str(tmp_path / "c")])
    assert again.exit_code == 0, again.output
    assert f"revision before: {migrate.head()}" in again.output and "(unchanged)" in again.output


def test_migrate_command_with_an_unreachable_database_fails_cleanly(tmp_path: Path):
    result = CliRunner().invoke(coordinator_app, ["migrate", "--database-url",
                                                  "postgresql+asyncpg://u:secret@127.0.0.1:1/none"])
    assert result.exit_code == 1
    assert "cannot migrate" in result.output and "secret" not in result.output


async def test_app_start_migrates_a_fresh_database(url: str, tmp_path: Path):
    from aiohttp.test_utils import TestClient, TestServer
    from gpuswarm.coordinator.app import create_app
    from gpuswarm.coordinator.config import CoordinatorConfig

    config = CoordinatorConfig(data_dir=tmp_path / "c", database_url=url, start_dht=False)
    async with TestServer(create_app(config)) as server, TestClient(server) as client:
        assert (await client.get("/v1/health")).status == 200
    assert await migrate.current_revision(url) == migrate.head()
    engine = make_engine(url)
    try:
        async with engine.connect() as conn:
            assert (await conn.execute(text("SELECT count(*) FROM nodes"))).scalar_one() == 0
    finally:
        await engine.dispose()


async def test_two_migrators_at_once_both_end_at_head(url: str):
    """Two coordinators starting together on one new database: one creates the schema, the other finds it."""
    results = await asyncio.gather(migrate.upgrade(url), migrate.upgrade(url))
    assert sorted(results, key=str) == sorted([(None, migrate.head()), (migrate.head(), migrate.head())], key=str)
    assert await migrate.schema_differences(url) == []


async def test_a_connection_waits_for_another_writers_lock_before_switching_to_wal(tmp_path: Path):
    """A new file in rollback mode, write-locked by another connection: the engine's switch to WAL waits for the
    lock (SQLite refuses it at once, whatever busy_timeout says) and the loop stays free meanwhile."""
    path = tmp_path / "locked.db"
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("CREATE TABLE t (x)")
    holder.execute("BEGIN IMMEDIATE")
    holder.execute("INSERT INTO t VALUES (1)")

    async def release_later() -> None:
        await asyncio.sleep(0.5)  # runs only if connecting does not block the event loop
        holder.execute("COMMIT")

    engine = make_engine(f"sqlite+aiosqlite:///{path}")
    try:
        release = asyncio.create_task(release_later())
        async with engine.connect() as conn:
            assert (await conn.exec_driver_sql("PRAGMA journal_mode")).scalar_one() == "wal"
            assert (await conn.exec_driver_sql("SELECT count(*) FROM t")).scalar_one() == 1
        await release
    finally:
        await engine.dispose()
        holder.close()


async def test_database_with_jobs_and_claims_from_before_accounts_upgrades_to_head(tmp_path: Path):
    """Rows from the first release survive: jobs go to a `legacy` owner, old claims become credited, unpaid."""
    url = database_from_before_migrations(tmp_path / "old.db", rows=True)
    with sqlite3.connect(tmp_path / "old.db") as db:
        db.execute("INSERT INTO jobs (id, name, spec, state, created_at, epoch, global_step, samples_per_second, "
                   "peers, failures) VALUES ('j-0123456789ab', 'old', '{}', 'completed', 1.0, 2.0, 9, 0, 2, 0)")
        db.execute("INSERT INTO assignments (job_id, node_id, state, shard_index, num_shards, created_at) "
                   "VALUES ('j-0123456789ab', 'n1', 'finished', 0, 1, 1.0)")
        for seq in (0, 1):
            db.execute("INSERT INTO contributions (job_id, node_id, seq, samples, steps, compute_seconds, "
                       "rounds_joined, window_start, window_end, received_at, envelope) VALUES "
                       f"('j-0123456789ab', 'n1', {seq}, 640, 20, 12.5, 3, 1.0, 2.0, 3.0, '{{}}')")
    assert await migrate.upgrade(url) == (None, migrate.head())
    with sqlite3.connect(tmp_path / "old.db") as db:
        assert db.execute("SELECT owner_id FROM jobs").fetchall() == [("o-000000000000",)]
        assert db.execute("SELECT name FROM owners").fetchall() == [("legacy",)]
        assert db.execute("SELECT gpus, price_per_gpu_hour FROM assignments").fetchall() == [(1, 0.0)]
        assert db.execute("SELECT epoch, status, credited_samples, credited_seconds, paid FROM contributions "
                          "ORDER BY epoch").fetchall() == [(0, "credited", 640, 12.5, 0), (1, "credited", 640, 12.5, 0)]
    assert await migrate.schema_differences(url) == []
