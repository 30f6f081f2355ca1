"""Schema migrations: Alembic, run from the installed package (coordinator/migrations), with no alembic.ini.

Owns moving a database between revisions, reading its revision, comparing the models with a migrated schema, and
autogenerating a new revision script. It never touches rows itself: a data change belongs in a revision script.

Every entry point takes a URL or the app's own AsyncEngine and runs Alembic (which is synchronous) on one of its
connections through `run_sync`, so it is safe inside a running event loop.
"""

from __future__ import annotations

import contextlib
import functools
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.operations import Operations
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from gpuswarm.coordinator.db import NAMING_CONVENTION, Base, make_engine
from sqlalchemy import inspect
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncEngine

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"
# The first revision: the schema that `Base.metadata.create_all` made before migrations existed. A database with
# the coordinator's tables but no alembic_version table is such a database; it is stamped with this, then upgraded.
BASELINE = "9c1f0e4d2a01"
NEW_MIGRATION_COMMAND = 'scripts/new-migration "what changed"'
MIGRATION_LOCK = 0x67707377  # PostgreSQL advisory lock key ("gpsw")

T = TypeVar("T")


def alembic_config(connection: Connection | None = None, **attributes: Any) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    # Dated file names keep `ls versions/` in order; the revision ids stay Alembic's random ones.
    config.set_main_option("file_template", "%%(year)d%%(month).2d%%(day).2d_%%(rev)s_%%(slug)s")
    config.set_main_option("truncate_slug_length", "60")
    config.attributes["connection"] = connection
    config.attributes.update(attributes)
    return config


@functools.cache
def script_directory() -> ScriptDirectory:
    return ScriptDirectory.from_config(alembic_config())


def head() -> str:
    """The newest revision. More than one head (two branches nobody merged) is an error, not a choice."""
    heads = script_directory().get_heads()
    if len(heads) != 1:
        raise RuntimeError(f"the migrations have {len(heads)} heads ({', '.join(heads)}); make one revision's "
                           "down_revision the other so that they form one line")
    return heads[0]


def _revision_of(connection: Connection) -> str | None:
    return MigrationContext.configure(connection).get_current_revision()


def _adopt_database_from_before_migrations(connection: Connection) -> None:
    """Take over a database that `create_all` made before migrations existed: name its constraints as the models
    do, then record it as BASELINE. Only SQLite needs the renaming (it keeps no constraint names, and PostgreSQL
    could not be used then: its driver was no dependency); each table is copied once, rows included."""
    if connection.dialect.name == "sqlite":
        operations = Operations(MigrationContext.configure(connection))
        for table in inspect(connection).get_table_names():
            if table in Base.metadata.tables:
                with operations.batch_alter_table(table, recreate="always", naming_convention=NAMING_CONVENTION):
                    pass
    command.stamp(alembic_config(connection), BASELINE)


def _upgrade(connection: Connection, revision: str, replay_revisions: bool) -> tuple[str | None, str | None]:
    before = _revision_of(connection)
    ours = set(Base.metadata.tables) & set(inspect(connection).get_table_names())
    if before is None and ours:
        _adopt_database_from_before_migrations(connection)
    elif before is None and revision == "head" and not replay_revisions:
        # An empty database gets the head schema from the models at once, and is stamped head: Alembic's recipe
        # for a new database, 5-10 times faster than replaying every revision (SQLite's batch steps reflect each
        # table). test_migrations keeps the models equal to the replayed revisions.
        Base.metadata.create_all(connection)
        MigrationContext.configure(connection).stamp(script_directory(), "head")
        return before, _revision_of(connection)
    if revision == "head" and before is not None and before == head():
        return before, before  # the usual start: nothing to do, and no revision scripts to load
    command.upgrade(alembic_config(connection), revision)
    return before, _revision_of(connection)


def _downgrade(connection: Connection, revision: str) -> tuple[str | None, str | None]:
    before = _revision_of(connection)
    command.downgrade(alembic_config(connection), revision)
    return before, _revision_of(connection)


def _differences(connection: Connection) -> list[Any]:
    context = MigrationContext.configure(connection, opts={"compare_type": True})
    return compare_metadata(context, Base.metadata)


async def _on_connection(target: str | AsyncEngine, fn: Callable[[Connection], T], *, migrating: bool) -> T:
    """Run `fn` on one connection of `target` and commit. A URL gets its own engine, disposed afterwards."""
    engine = make_engine(target) if isinstance(target, str) else target
    sqlite = engine.dialect.name == "sqlite"
    try:
        async with engine.connect() as conn:
            if sqlite and migrating:
                # Batch migrations copy and drop SQLite tables; with foreign keys enforced, dropping a referenced
                # table fails. The pragma only works outside a transaction, and is restored for the pool.
                await conn.exec_driver_sql("PRAGMA foreign_keys=OFF")
                await conn.commit()
            try:
                # One migrator at a time (two coordinators starting together): each lock ends with the
                # transaction, and the second migrator then finds the schema at head.
                if migrating and engine.dialect.name == "postgresql":
                    await conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({MIGRATION_LOCK})")
                elif migrating and sqlite:
                    await conn.exec_driver_sql("BEGIN IMMEDIATE")  # SQLite's write lock, before the first read
                result = await conn.run_sync(fn)
                await conn.commit()
            finally:
                if sqlite and migrating:
                    await conn.rollback()
                    await conn.exec_driver_sql("PRAGMA foreign_keys=ON")
                    await conn.commit()
        return result
    finally:
        if isinstance(target, str):
            await engine.dispose()


async def upgrade(target: str | AsyncEngine, revision: str = "head", *,
                  replay_revisions: bool = False) -> tuple[str | None, str | None]:
    """Migrate a database (URL or engine) up to `revision`. Returns its revision before and after.

    An empty database is created from the models unless `replay_revisions` (the tests of the revisions)."""
    return await _on_connection(target, lambda c: _upgrade(c, revision, replay_revisions), migrating=True)


async def downgrade(target: str | AsyncEngine, revision: str = "base") -> tuple[str | None, str | None]:
    """Migrate a database down to `revision` ("base": no tables of ours left). Returns before and after."""
    return await _on_connection(target, lambda c: _downgrade(c, revision), migrating=True)


async def current_revision(target: str | AsyncEngine) -> str | None:
    return await _on_connection(target, _revision_of, migrating=False)


async def schema_differences(target: str | AsyncEngine) -> list[Any]:
    """What autogenerate would write for this database: empty when the models and its schema agree."""
    return await _on_connection(target, _differences, migrating=False)


def new_revision(message: str) -> list[Path]:
    """Autogenerate a revision script from the difference between the models and the migrations' head.

    Compares against a throwaway SQLite database migrated to head, so no server is needed; batch mode keeps the
    script runnable on SQLite as well as PostgreSQL. Returns the files written (none when nothing changed)."""
    import asyncio

    with tempfile.TemporaryDirectory(prefix="gpuswarm-migration-") as tmp:
        url = f"sqlite+aiosqlite:///{Path(tmp) / 'head.db'}"
        asyncio.run(upgrade(url, replay_revisions=True))
        written: list[Path] = []

        def autogenerate(connection: Connection) -> None:
            scripts = command.revision(alembic_config(connection, autogenerate=True), message, autogenerate=True)
            for script in scripts if isinstance(scripts, list) else [scripts]:
                if script is not None:
                    written.append(Path(script.path))

        asyncio.run(_on_connection(url, autogenerate, migrating=False))
    script_directory.cache_clear()
    with contextlib.suppress(OSError):  # ruff sorts the imports Alembic rendered, where ruff is installed
        subprocess.run([sys.executable, "-m", "ruff", "check", "--fix", "--quiet", *map(str, written)],
                       capture_output=True, check=False)
    return written


def main(argv: list[str] | None = None) -> int:
    """`python -m gpuswarm.coordinator.migrate new "message"`: what scripts/new-migration runs."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] != "new" or not args[1].strip():
        print(f"usage: {NEW_MIGRATION_COMMAND}", file=sys.stderr)
        return 2
    with contextlib.suppress(BrokenPipeError):
        written = new_revision(args[1].strip())
        if not written:
            print("the models match the migrations: no revision written")
        for path in written:
            print(f"wrote {path}; read it, adjust it if needed (renames come out as drop + add), and commit it")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
