"""The chaos harness reports its own event loop's lateness (tests/chaos/load.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from tests.chaos.load import USERS_PER_CLIENT, LoopLag, client_count
from tests.support import async_wait_until


def _woke_late(lag: LoopLag) -> Callable[[], Awaitable[bool]]:
    async def late() -> bool:
        return lag.late > 0

    return late


async def test_a_blocked_loop_is_reported_late() -> None:
    lag = LoopLag(every_s=0.05)
    lines: list[str] = []
    watch = asyncio.create_task(lag.watch(lines.append))
    await asyncio.sleep(0.2)  # four of the watch's intervals with the loop free
    assert lag.late == 0
    time.sleep(1.3)  # the harness's loop busy with its own work
    await async_wait_until(_woke_late(lag), timeout=5, what="the watch to wake after the block")
    watch.cancel()
    assert lag.late == 1
    assert 1.0 < lag.longest_s < 2.0
    assert lines and "late" in lines[0]


def test_users_are_spread_over_small_clients() -> None:
    assert client_count(1) == 1
    assert client_count(USERS_PER_CLIENT) == 1
    assert client_count(USERS_PER_CLIENT + 1) == 2
    assert client_count(1000) == -(-1000 // USERS_PER_CLIENT)
