"""Coalesced reads (koda/batching.py): requests made while a read is in flight share
the next read; a failed read fails its own batch only; cancellations are honoured."""

from __future__ import annotations

import asyncio

import pytest

from koda_runtime.batching import CoalescedReads


class Table:
    """A read whose answer the test releases: the keys of each read, in order."""

    def __init__(self, rows: dict[str, int]) -> None:
        self.rows = rows
        self.reads: list[list[str]] = []
        self.release = asyncio.Event()
        self.fail: Exception | None = None

    async def read(self, keys: list[str]) -> dict[str, int]:
        self.reads.append(keys)
        await self.release.wait()
        if self.fail is not None:
            failure, self.fail = self.fail, None
            raise failure
        return {k: self.rows[k] for k in keys if k in self.rows}


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_lone_request_is_read_at_once_and_the_next_ones_together() -> None:
    table = Table({"a": 1, "b": 2, "c": 3})
    reads = CoalescedReads(table.read)
    first = asyncio.create_task(reads.get("a"))
    await settle()
    assert table.reads == [["a"]]  # sent without waiting for company
    rest = [asyncio.create_task(reads.get(k)) for k in ("c", "b", "zz", "b")]
    await settle()
    assert table.reads == [["a"]]  # queued behind the read in flight
    table.release.set()
    assert await first == 1
    assert [await t for t in rest] == [3, 2, None, 2]
    assert table.reads == [["a"], ["b", "c", "zz"]]
    assert reads.reads == 2


async def test_a_failed_read_fails_its_batch_and_the_next_batch_is_read_again() -> None:
    table = Table({"a": 1, "b": 2})
    reads = CoalescedReads(table.read)
    table.fail = ConnectionError("postgres went away")
    first = asyncio.create_task(reads.get("a"))
    await settle()
    second = asyncio.create_task(reads.get("b"))
    await settle()
    table.release.set()
    with pytest.raises(ConnectionError, match="went away"):
        await first
    assert await second == 2
    assert table.reads == [["a"], ["b"]]


async def test_batches_hold_at_most_max_batch_keys() -> None:
    table = Table({str(i): i for i in range(7)})
    reads = CoalescedReads(table.read, max_batch=3)
    blocker = asyncio.create_task(reads.get("0"))
    await settle()
    waiting = [asyncio.create_task(reads.get(str(i))) for i in range(1, 7)]
    table.release.set()
    assert await blocker == 0
    assert [await t for t in waiting] == list(range(1, 7))
    assert [len(r) for r in table.reads] == [1, 3, 3]


async def test_a_cancelled_request_is_skipped_and_the_others_answered() -> None:
    table = Table({"a": 1, "b": 2})
    reads = CoalescedReads(table.read)
    first = asyncio.create_task(reads.get("a"))
    second = asyncio.create_task(reads.get("b"))
    await settle()
    first.cancel()
    table.release.set()
    assert await second == 2
    with pytest.raises(asyncio.CancelledError):
        await first


async def test_a_cancelled_reader_cancels_every_request_still_waiting() -> None:
    table = Table({"a": 1})
    reads = CoalescedReads(table.read)
    first = asyncio.create_task(reads.get("a"))
    await settle()
    queued = asyncio.create_task(reads.get("b"))
    await settle()
    assert reads._reader is not None
    reads._reader.cancel()
    await reads.close()
    for task in (first, queued):
        with pytest.raises(asyncio.CancelledError):
            await task
