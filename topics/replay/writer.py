"""Batches written one behind the reader, on a thread of their own.

A sink spends its time inside DuckDB or PostgreSQL (upserts, the outputs query, the
commit), which release the GIL; the reader spends its own in librdkafka and the
decoder. :class:`BatchWriter` lets the two overlap: while batch N is written, batch
N+1 is read and decoded. At most one batch is in flight, so the order of the replay's
guarantees stays what engine.py says:

* batch N's rows are committed by the sink before batch N+1 is handed to it (batches
  are written in order, one at a time);
* batch N's offsets (the reader's positions when the batch was cut) are committed only
  after its rows are, by the caller's thread, when it hands over the next batch or
  finishes;
* a following replay also commits them as soon as the write is over
  (:meth:`settle_written`), so an idle one does not hold its last batch's offsets back;
* a write that fails raises in the caller at the next hand-over (or at :meth:`finish`):
  nothing after it is written and its offsets are never committed, so a restarted job
  reads it again (the upserts make that harmless).

Failure mode: a failed write followed by more writes or by its offsets being committed.
tests/unit/test_replay_writer.py provokes it.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from types import TracebackType

from koda_runtime.topics.kafka.bounded import TP
from koda_runtime.topics.replay.rows import RowBatch

Written = dict[str, int]


class BatchWriter:
    """``write(batch)`` on a thread, one batch at a time; then, on the caller's thread,
    ``done(batch, written)`` and ``commit(positions)`` in that order."""

    def __init__(
        self,
        write: Callable[[RowBatch], Written],
        commit: Callable[[dict[TP, int]], None],
        done: Callable[[RowBatch, Written], None],
    ) -> None:
        self._write, self._commit, self._done = write, commit, done
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="koda-replay-sink")
        self._pending: tuple[Future[Written], RowBatch, dict[TP, int]] | None = None

    def submit(self, batch: RowBatch, positions: dict[TP, int]) -> None:
        """Settle the batch in flight (raising its error), then start writing ``batch``,
        whose offsets are ``positions``. An empty batch is not written (unless it
        flushes the deferred outputs); its positions are committed at once (after the
        one before it)."""
        self.settle()
        if not len(batch) and not batch.flush_outputs:
            self._commit(dict(positions))
            return
        batch.positions = dict(positions)
        self._pending = (self._pool.submit(self._write, batch), batch, dict(positions))

    def settle(self) -> None:
        """Wait for the batch in flight; on success report it and commit its offsets."""
        if self._pending is None:
            return
        future, batch, positions = self._pending
        self._pending = None
        written = future.result()  # the sink's error, if any, is raised here
        self._done(batch, written)
        self._commit(positions)

    def settle_written(self) -> None:
        """:meth:`settle` if the batch in flight is already written (or failed), else
        nothing: a following replay that reads nothing new commits its last batch's
        offsets now instead of at its next batch, which may be long in coming."""
        if self._pending is not None and self._pending[0].done():
            self.settle()

    def finish(self) -> None:
        """Settle the last batch and stop the thread."""
        try:
            self.settle()
        finally:
            self._pool.shutdown(wait=True)

    def __enter__(self) -> BatchWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # Leaving on an error: let a write in flight end (the sink is closed next), but
        # commit nothing more.
        self._pending = None
        self._pool.shutdown(wait=True)
