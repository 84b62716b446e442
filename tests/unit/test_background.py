"""The one background-task helper: a stopped service leaves no task behind, and a loop
that died never fails its owner's shutdown."""

from __future__ import annotations

import asyncio
import logging

import pytest

from koda_runtime.background import BackgroundTask
from tests.support import async_wait_until


async def test_stop_cancels_the_loop_and_waits_until_it_unwound() -> None:
    waiting, unwound = asyncio.Event(), asyncio.Event()

    async def forever() -> None:
        try:
            waiting.set()
            await asyncio.Event().wait()
        finally:
            unwound.set()

    task = BackgroundTask("unit-forever", forever)
    task.start()
    task.start()  # a no-op while it runs: one loop, not two
    assert sum(t.get_name() == "unit-forever" for t in asyncio.all_tasks()) == 1
    await asyncio.wait_for(waiting.wait(), 5)
    await task.stop()
    assert unwound.is_set()
    assert not task.running
    assert not [t for t in asyncio.all_tasks() if t.get_name() == "unit-forever"]
    await task.stop()  # stopping twice is harmless


async def test_a_loop_that_died_is_logged_at_stop_not_raised(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def broken() -> None:
        raise RuntimeError("boom")

    task = BackgroundTask("unit-broken", broken)
    task.start()

    async def died() -> bool:
        return not task.running

    await async_wait_until(died, timeout=5, what="the loop to die")
    with caplog.at_level(logging.ERROR, logger="koda.background"):
        await task.stop()
    assert "event=background_task_failed task=unit-broken" in caplog.text
    task.start()  # a loop that ended can be started again
    await async_wait_until(died, timeout=5, what="the second loop to die")
    await task.stop()


async def test_a_cancelled_owner_is_not_swallowed() -> None:
    waiting, unwinding = asyncio.Event(), asyncio.Event()

    async def slow_unwind() -> None:
        try:
            waiting.set()
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            unwinding.set()
            await asyncio.sleep(10)  # slow work on the way out: the stop() that waits for it
            raise

    task = BackgroundTask("unit-slow", slow_unwind)
    task.start()
    await asyncio.wait_for(waiting.wait(), 5)
    owner = asyncio.create_task(task.stop())
    await asyncio.wait_for(unwinding.wait(), 5)  # stop() cancelled the loop and now waits
    owner.cancel()
    with pytest.raises(asyncio.CancelledError):
        await owner
