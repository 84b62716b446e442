"""A worker's runs flush their chunk batches on shared ticks (processors/streaming.py
``window_end``), so the group writer commits many runs' batches in one transaction.

The failure it prevents: runs that open their windows at different moments flush at
different moments, and each batch becomes a group (a transaction, a commit, a produce
request) of its own; with hundreds of streaming runs the worker spends its time on
commits. The test starts runs a few milliseconds apart and counts the groups."""

from __future__ import annotations

import asyncio
import math

import pytest

from koda_runtime.lifecycle.handler import CancelToken
from koda_runtime.processors.streaming import window_end
from koda_runtime.schemas.runs.worker import ChunkWrite
from tests.unit.test_executor import World, record
from tests.unit.worker_fakes import ScriptedHandler


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

    def script() -> list[object]:
        steps: list[object] = ["first"]
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
