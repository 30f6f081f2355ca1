"""The SQLite driver under SQLAlchemy: a query cancelled twice (the query, then the close that SQLAlchemy's terminate
starts when the connection is invalidated) leaves an event loop that still ends.

aiosqlite 0.22 hangs here: SQLAlchemy's forced close stops aiosqlite's worker thread, and the graceful close it had
started then waits in its `finally` on a second stop that no thread will ever answer, so `asyncio.run` (and
pytest-asyncio's teardown, which is where the suite met it) waits forever. pyproject pins aiosqlite below 0.22
(decision 0045). The scenario runs in a child process, bounded, so a hang is a failure here, not a stuck suite.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

CHILD = textwrap.dedent("""
    import asyncio, sys
    from sqlalchemy import text
    from gpuswarm.coordinator.db import make_engine

    # About 5 s of work in SQLite's thread: long enough to be cancelled twice.
    SLOW = ("WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 30000000) "
            "SELECT count(*) FROM c")

    async def main():
        engine = make_engine(f"sqlite+aiosqlite:///{sys.argv[1]}")

        async def query():
            async with engine.connect() as conn:
                await conn.execute(text(SLOW))

        task = asyncio.create_task(query())
        await asyncio.sleep(0.3)
        task.cancel()  # the query: SQLAlchemy invalidates the connection and closes it gracefully
        await asyncio.sleep(0.1)
        task.cancel()  # the graceful close: SQLAlchemy forces the close (aiosqlite's stop())
        try:
            await task
        except asyncio.CancelledError:
            pass

    asyncio.run(main())
    print("the loop ended")
""")
BOUND = 60.0  # seconds: the query's own ~5 s on two loaded cores, with room; a hang never ends


def test_a_query_cancelled_twice_leaves_a_loop_that_ends(tmp_path: Path):
    try:
        done = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "c.db")], capture_output=True, text=True,
                              timeout=BOUND)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the event loop did not end within {BOUND:.0f} s: aiosqlite 0.22's close hang") from None
    assert done.returncode == 0 and "the loop ended" in done.stdout, (done.returncode, done.stderr[-2000:])
