"""Owns the bounded stop of the coordinator's background tasks (supervisor, heartbeat batcher, challenge sweep), and
`Batches`, the one task that serves many handlers' calls in batches (the heartbeat batcher, the signature checker).

One `task.cancel()` is not always enough: a cancellation can be lost inside the database driver (asyncpg with
SQLAlchemy, MagicStack/asyncpg#873) or in Python 3.11's `asyncio.wait_for` (CPython gh-86296), and the loop then
runs on, once seen in CI as a coordinator test whose teardown waited 5 s and failed. `stop` cancels again until
the task ends, and gives up, saying so, after `timeout` seconds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

logger = logging.getLogger(__name__)
RECANCEL_INTERVAL = 0.1
T = TypeVar("T")
R = TypeVar("R")


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


class Batches(Generic[T, R]):
    """Many handlers' calls served by one task: `submit(item)` queues the item and waits for its result, and the
    task hands everything that queued up meanwhile (at most `size` at once) to `serve`, which returns one result per
    item, a value or an exception that item's caller gets. If `serve` raises, every caller of the batch gets that."""

    def __init__(self, serve: Callable[[list[T]], Awaitable[list[R | Exception]]], size: int, name: str):
        self._serve, self._size, self._name = serve, size, name
        self._queue: list[tuple[T, asyncio.Future]] = []
        self._queued = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=self._name)

    async def submit(self, item: T) -> R:
        if self._task is None or self._task.done():
            raise RuntimeError(f"{self._name} is not running")
        future = asyncio.get_running_loop().create_future()
        self._queue.append((item, future))
        self._queued.set()
        return await future

    async def stop(self) -> None:
        if self._task is not None:
            await stop(self._task)
        for _, future in self._queue:
            future.cancel()

    async def _run(self) -> None:
        while True:
            await self._queued.wait()
            self._queued.clear()
            while self._queue:
                batch, self._queue = self._queue[:self._size], self._queue[self._size:]
                try:
                    results = await self._serve([item for item, _ in batch])
                except asyncio.CancelledError:
                    for _, future in batch:
                        future.cancel()
                    raise
                except Exception as e:
                    results = [e] * len(batch)
                for (_, future), result in zip(batch, results, strict=True):
                    if future.done():
                        continue
                    if isinstance(result, Exception):
                        future.set_exception(result)
                    else:
                        future.set_result(result)
