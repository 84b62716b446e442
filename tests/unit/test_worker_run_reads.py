"""The worker store's run reads (schemas/runs/worker.py): the runs asked for while a read
is in flight are read together, once each, by the next read; a failed read fails every
request of its batch and the next batch is read again."""

from __future__ import annotations

import asyncio

import pytest

from koda_runtime.batching import CoalescedReads
from koda_runtime.lifecycle.states import RunStatus
from koda_runtime.schemas.runs.worker import RunRow


def row(run_id: str) -> RunRow:
    return RunRow(run_id, "u", "s", RunStatus.PENDING, {}, 0, 0)


class Runs:
    """A read of run rows whose answer the test releases: the ids of each read, in order."""

    def __init__(self, *ids: str) -> None:
        self.rows = {i: row(i) for i in ids}
        self.reads: list[list[str]] = []
        self.release = asyncio.Event()
        self.fail: Exception | None = None

    async def read(self, ids: list[str]) -> dict[str, RunRow]:
        self.reads.append(ids)
        await self.release.wait()
        if self.fail is not None:
            failure, self.fail = self.fail, None
            raise failure
        return {i: self.rows[i] for i in ids if i in self.rows}


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_runs_asked_during_a_read_share_the_next_one_once_each() -> None:
    runs = Runs("a", "b", "c")
    loads = CoalescedReads(runs.read)
    first = asyncio.create_task(loads.get("a"))
    await settle()
    assert runs.reads == [["a"]]  # a lone read waits for no company
    rest = [asyncio.create_task(loads.get(i)) for i in ("c", "b", "gone", "b")]
    await settle()
    runs.release.set()
    assert await first == row("a")
    assert [await t for t in rest] == [row("c"), row("b"), None, row("b")]
    assert runs.reads == [["a"], ["b", "c", "gone"]]
    assert loads.reads == 2


async def test_a_failed_read_fails_each_request_of_its_batch_only() -> None:
    runs = Runs("a", "b")
    loads = CoalescedReads(runs.read)
    runs.fail = ConnectionError("postgres went away")
    first = [asyncio.create_task(loads.get(i)) for i in ("a", "b")]
    await settle()
    later = asyncio.create_task(loads.get("b"))
    await settle()
    runs.release.set()
    for task in first:
        with pytest.raises(ConnectionError, match="postgres went away"):
            await task
    assert await later == row("b")
    assert runs.reads == [["a", "b"], ["b"]]
