"""A worker's runs flush their chunk batches on shared ticks (processors/streaming.py
``window_end``), so the group writer commits many runs' batches in one transaction.

The failure it prevents: runs that open their windows at different moments flush at
different moments, and each batch becomes a group (a transaction, a commit, a produce
request) of its own; with hundreds of streaming runs the worker spends its time on
commits. The test starts runs a few milliseconds apart and counts the groups."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from koda_runtime.lifecycle.handler import CancelToken
from koda_runtime.processors.streaming import window_end
from koda_runtime.schemas.runs.worker import ChunkWrite
from tests.support import loop_until
from tests.unit.test_executor import World, record
from tests.unit.worker_fakes import ScriptedHandler, Step


@pytest.mark.parametrize("window_s", [0.02, 0.05, 0.2, 1.0])
def test_a_batch_waits_between_half_a_window_and_a_window_on_the_ticks(
    window_s: float,
) -> None:
    half = window_s / 2
    for i in range(2_000):
        now = 1_000.0 + i * 0.000_731  # many phases of the clock
        end = window_end(now, window_s)
        assert half - 1e-9 <= end - now <= window_s + 1e-9, (now, end)
        ticks = end / half
        assert math.isclose(ticks, round(ticks), abs_tol=1e-6), (now, end)


def test_a_zero_window_flushes_at_once() -> None:
    assert window_end(12.5, 0.0) == 12.5


async def test_runs_started_apart_share_their_flushes() -> None:
    """12 runs, started 7 ms apart, stream a token every 2 ms for about 0.25 s with a
    40 ms window: flushing on ticks, several runs' batches share each group; each run
    opening its own window would give about one batch per group."""

    def script() -> list[Step]:
        steps: list[Step] = ["first"]
        for i in range(120):
            steps += [lambda: asyncio.sleep(0.002), f"t{i} "]
        return steps

    w = World(ScriptedHandler(script()), chunk_batch_ms=40, chunk_batch_size=10_000)
    runs = [f"r{i}" for i in range(12)]
    for i, run_id in enumerate(runs):
        w.store.add(run_id, user_id=f"u{i}")

    async def one(i: int, run_id: str) -> None:
        await asyncio.sleep(i * 0.007)
        await w.executor.process(record(run_id, f"u{i}", offset=i), w.fence, CancelToken())

    try:
        await asyncio.gather(*(one(i, r) for i, r in enumerate(runs)))
    finally:
        await w.executor.writer.close()
        World.made.remove(w)
    # The batches written between a run's first output and its finish.
    batches = [
        [p for p in group if isinstance(p, ChunkWrite) and not p.first_output]
        for group in w.store.groups
    ]
    batches = [b for b in batches if b]
    written = sum(len(b) for b in batches)
    assert written >= 50, f"too few window flushes to judge ({written})"
    per_group = written / len(batches)
    assert per_group >= 3, (
        f"{written} window batches in {len(batches)} groups ({per_group:.1f} per "
        "group): the runs do not flush on shared ticks"
    )


class EarlyTimers(asyncio.SelectorEventLoop):
    """An event loop that runs every timer 3 ms before its time by its own clock, as a
    selector's rounding may. A timer's callback must count as its time having come."""

    def call_at(self, when, callback, *args, context=None):  # type: ignore[override]
        return super().call_at(when - 0.003, callback, *args, context=context)


def _on_early_timers(main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    loop = EarlyTimers()
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()


def test_a_window_whose_timer_runs_early_is_still_flushed() -> None:
    """The handler says two things and then waits: the second must be written when its
    window's timer runs, not when the handler next speaks (here: never, until freed)."""

    async def main() -> None:
        hold = asyncio.Event()
        w = World(
            ScriptedHandler(["first", "second", hold.wait]),
            chunk_batch_ms=40,
            chunk_batch_size=100,
        )
        w.store.add("r1")
        running = asyncio.create_task(w.run("r1"))
        try:
            await loop_until(
                lambda: len(w.store.kinds("r1")) == 2, timeout=3, what="the window's flush"
            )
        finally:
            hold.set()
            await running
            await w.executor.writer.close()
            World.made.remove(w)
        assert w.store.kinds("r1") == ["chunk", "chunk", "done"]

    _on_early_timers(main)


def test_an_attempt_whose_deadline_timer_runs_early_still_ends() -> None:
    async def main() -> None:
        w = World(ScriptedHandler(["a", asyncio.Event().wait]), max_run_s=0.3)
        w.store.add("r1")
        try:
            await asyncio.wait_for(w.run("r1"), 5)
        finally:
            await w.executor.writer.close()
            World.made.remove(w)
        row = w.store.runs["r1"]
        assert row.error is not None and row.error.startswith("deadline:"), row.error

    _on_early_timers(main)
