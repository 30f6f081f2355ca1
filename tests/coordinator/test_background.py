"""The coordinator's background work: `tasks.stop` (a task stops even when a cancellation is lost, and stopping
is bounded) and the supervisor's pure helper `app.swarm_epoch`."""

from __future__ import annotations

import asyncio
import contextlib

from gpuswarm.coordinator import app, tasks
from hypothesis import given
from hypothesis import strategies as st


async def test_a_task_that_loses_a_cancellation_is_still_stopped():
    swallowed = 0

    async def loop() -> None:  # like a driver that swallows one CancelledError (asyncpg#873)
        nonlocal swallowed
        while True:
            try:
                await asyncio.sleep(1)
            except asyncio.CancelledError:
                if swallowed:
                    raise
                swallowed += 1

    task = asyncio.create_task(loop())
    await asyncio.sleep(0)
    await tasks.stop(task, timeout=5)
    assert task.cancelled() and swallowed == 1  # one cancel alone would have left it running


async def test_stopping_a_task_that_never_ends_gives_up_after_the_timeout(caplog):
    release = asyncio.Event()

    async def stubborn() -> None:
        while not release.is_set():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(1)

    task = asyncio.create_task(stubborn(), name="stubborn")
    await asyncio.sleep(0)
    await tasks.stop(task, timeout=0.3)
    assert not task.done() and "stubborn did not stop within" in caplog.text
    release.set()
    await task


async def test_a_finished_or_failed_task_stops_at_once(caplog):
    async def fail() -> None:
        raise RuntimeError("boom")

    task = asyncio.create_task(fail(), name="failing")
    await asyncio.sleep(0)
    await tasks.stop(task)
    assert "failing had failed: RuntimeError('boom')" in caplog.text


@given(st.lists(st.integers(0, 10**6), min_size=1, max_size=12), st.integers(0, 2**53))
def test_one_member_cannot_lift_a_runs_epoch(honest, lie):
    """`swarm_epoch` over the members' progress records: adding one record, however large, lifts it at most to the
    highest honest epoch."""
    assert app.swarm_epoch(honest + [lie]) <= max(honest)
    assert app.swarm_epoch(honest) <= max(honest)
