"""Owns the bounded stop of the coordinator's background tasks (supervisor, heartbeat batcher, challenge sweep).

One `task.cancel()` is not always enough: a cancellation can be lost inside the database driver (asyncpg with
SQLAlchemy, MagicStack/asyncpg#873) or in Python 3.11's `asyncio.wait_for` (CPython gh-86296), and the loop then
runs on, once seen in CI as a coordinator test whose teardown waited 5 s and failed. `stop` cancels again until
the task ends, and gives up, saying so, after `timeout` seconds.
"""

from __future__ import annotations

import asyncio
import logging
import time

logger = logging.getLogger(__name__)
RECANCEL_INTERVAL = 0.1


async def stop(task: asyncio.Task, timeout: float = 5.0) -> None:
    """Cancel `task` and wait for it to end, at most `timeout` seconds. Never raises."""
    deadline = time.monotonic() + timeout
    while not task.done() and time.monotonic() < deadline:
        task.cancel()
        await asyncio.wait({task}, timeout=min(RECANCEL_INTERVAL, max(0.0, deadline - time.monotonic())))
    if not task.done():
        logger.warning("background task %s did not stop within %.0fs", task.get_name(), timeout)
    elif not task.cancelled() and task.exception() is not None:
        logger.warning("background task %s had failed: %r", task.get_name(), task.exception())
