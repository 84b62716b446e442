"""Batches written one behind the reader (topics/replay/writer.py): in order, one at a
time, offsets only after their rows, and nothing more after a failed write."""

from __future__ import annotations

import threading

import pytest

from koda_runtime.topics.replay import tables as t
from koda_runtime.topics.replay.rows import RowBatch
from koda_runtime.topics.replay.writer import BatchWriter
from tests.support import wait_until

TP = ("dev.koda.run-chunks", 0)


def batch(n: int) -> RowBatch:
    b = RowBatch()
    for i in range(n):
        b.add(t.CHUNKS, (f"r{n}", i, None, "chunk", "x", 1))
    b.records = n
    return b


class Log:
    def __init__(self, fail_on: int | None = None) -> None:
        self.events: list[tuple[str, int]] = []
        self.fail_on = fail_on
        self.writing = threading.Event()
        self.release = threading.Event()
        self.release.set()

    def write(self, b: RowBatch) -> dict[str, int]:
        self.writing.set()
        assert self.release.wait(10)
        if len(b) == self.fail_on:
            self.events.append(("failed", len(b)))
            raise RuntimeError(f"writing to duckdb:///w.duckdb failed (rolled back): {len(b)}")
        self.events.append(("wrote", len(b)))
        return {"chunks": len(b)}

    def commit(self, positions: dict[tuple[str, int], int]) -> None:
        self.events.append(("committed", positions[TP]))

    def done(self, b: RowBatch, written: dict[str, int]) -> None:
        self.events.append(("done", written["chunks"]))


def test_batches_are_written_in_order_and_each_commits_after_its_rows() -> None:
    log = Log()
    with BatchWriter(log.write, log.commit, log.done) as w:
        w.submit(batch(1), {TP: 10})
        w.submit(batch(2), {TP: 20})
        w.submit(RowBatch(), {TP: 25})  # nothing to write: its offsets follow the last
        w.submit(batch(3), {TP: 30})
        w.finish()
    assert log.events == [
        ("wrote", 1), ("done", 1), ("committed", 10),
        ("wrote", 2), ("done", 2), ("committed", 20),
        ("committed", 25),
        ("wrote", 3), ("done", 3), ("committed", 30),
    ]  # fmt: skip


def test_the_next_batch_is_read_while_one_is_written_but_not_handed_over() -> None:
    log = Log()
    log.release.clear()
    with BatchWriter(log.write, log.commit, log.done) as w:
        w.submit(batch(1), {TP: 10})
        assert log.writing.wait(10)
        # The caller goes on reading; the positions it moves are not the batch's.
        assert log.events == []
        log.release.set()
        w.submit(batch(2), {TP: 20})
        assert log.events[:3] == [("wrote", 1), ("done", 1), ("committed", 10)]
        w.finish()


def test_a_failed_write_raises_writes_nothing_more_and_commits_nothing() -> None:
    log = Log(fail_on=2)
    with pytest.raises(RuntimeError, match="rolled back"):
        with BatchWriter(log.write, log.commit, log.done) as w:
            w.submit(batch(1), {TP: 10})
            w.submit(batch(2), {TP: 20})
            w.submit(batch(3), {TP: 30})  # raises batch 2's error; batch 3 is not written
    assert log.events == [("wrote", 1), ("done", 1), ("committed", 10), ("failed", 2)]


def test_a_failed_last_write_raises_at_finish_and_commits_nothing() -> None:
    log = Log(fail_on=1)
    with pytest.raises(RuntimeError, match="rolled back"):
        with BatchWriter(log.write, log.commit, log.done) as w:
            w.submit(batch(1), {TP: 10})
            w.finish()
    assert log.events == [("failed", 1)]


def test_leaving_on_an_error_lets_the_write_end_and_commits_nothing() -> None:
    log = Log()
    with pytest.raises(KeyboardInterrupt):
        with BatchWriter(log.write, log.commit, log.done) as w:
            w.submit(batch(1), {TP: 10})
            raise KeyboardInterrupt
    assert log.events == [("wrote", 1)]


def settled(w: BatchWriter, log: Log, event: tuple[str, int]) -> bool:
    w.settle_written()
    return event in log.events


def test_a_written_batch_commits_its_offsets_without_waiting_for_the_next() -> None:
    log = Log()
    log.release.clear()
    with BatchWriter(log.write, log.commit, log.done) as w:
        w.submit(batch(1), {TP: 10})
        assert log.writing.wait(10)
        w.settle_written()  # still being written: nothing is committed
        assert log.events == []
        log.release.set()
        wait_until(lambda: settled(w, log, ("committed", 10)), what="the early commit")
        assert log.events == [("wrote", 1), ("done", 1), ("committed", 10)]
        w.settle_written()  # nothing in flight: nothing more
        w.finish()
    assert log.events == [("wrote", 1), ("done", 1), ("committed", 10)]


def test_a_failed_write_raises_when_settled_early_and_commits_nothing() -> None:
    log = Log(fail_on=1)
    with pytest.raises(RuntimeError, match="rolled back"):
        with BatchWriter(log.write, log.commit, log.done) as w:
            w.submit(batch(1), {TP: 10})
            wait_until(lambda: settled(w, log, ("never", 0)), timeout=10, what="the failure")
    assert log.events == [("failed", 1)]
