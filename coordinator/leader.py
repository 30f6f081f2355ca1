"""Which coordinator process runs the background work when several serve one PostgreSQL database.

Owns leadership. Every coordinator serves the whole API; only the leader runs the supervisor's tick (losing silent
nodes, matching, settlement, DHT progress), the blob retention pass and the challenge sweep, so none of them runs
twice at once. On PostgreSQL the leader holds a session-level advisory lock (`pg_try_advisory_lock`) on a
connection of its own: when its process dies, PostgreSQL ends the session and frees the lock, and another
coordinator takes it at its next try (every `loop_interval`). A leader that loses that connection stops leading
at once. On SQLite there is one coordinator per database (one writer; the data directory is one process's), and it
always leads.

`since` is when this process began to lead: the tick gives nodes a full node timeout from then (a new leader,
like a restarted coordinator, has not heard from anyone yet).
"""

from __future__ import annotations

import logging
import time

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

logger = logging.getLogger(__name__)
LOCK_KEY = 0x6770736C  # "gpsl": the advisory lock every coordinator of one database competes for (migrations
# take another, migrate.MIGRATION_LOCK "gpsw", while they run)


class Leadership:
    def __init__(self, engine: AsyncEngine):
        self.engine = engine
        self.since: float | None = None
        self._connection: AsyncConnection | None = None

    @property
    def leader(self) -> bool:
        return self.since is not None

    async def check(self) -> bool:
        """Are we the leader now? Keeps the lock if we hold it (and its connection still answers), else tries to
        take it. Never raises: a database that cannot be reached means "not the leader"."""
        if self.engine.dialect.name != "postgresql":
            self.since = self.since or time.time()
            return True
        if self._connection is not None:
            try:
                await self._connection.execute(text("SELECT 1"))
                await self._connection.commit()
                return True
            except Exception as e:  # noqa: BLE001 - the session and the lock with it are gone
                logger.warning("lost the database session that held leadership (%s); no longer leading", e)
                await self._drop()
        try:
            connection = await self.engine.connect()
        except Exception as e:  # noqa: BLE001
            logger.warning("cannot reach the database to compete for leadership: %s", e)
            return False
        try:
            taken = (await connection.execute(text("SELECT pg_try_advisory_lock(:key)"), {"key": LOCK_KEY})).scalar()
            await connection.commit()  # the lock is the session's: it outlives the transaction, which must not idle
        except Exception as e:  # noqa: BLE001
            logger.warning("competing for leadership failed: %s", e)
            await connection.invalidate()
            await connection.close()
            return False
        if not taken:
            await connection.close()
            return False
        self._connection, self.since = connection, time.time()
        logger.info("this coordinator now leads (matching, timeouts, settlement)")
        return True

    async def _drop(self) -> None:
        connection, self._connection, self.since = self._connection, None, None
        if connection is not None:
            # Never back into the pool while it may still hold the lock: closed for real.
            await connection.invalidate()
            await connection.close()

    async def close(self) -> None:
        """Give leadership up (the lock goes with the session)."""
        await self._drop()
