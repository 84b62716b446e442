"""What every sink does with a batch: one transaction of upserts, then the outputs rows.

A sink writes a :class:`~koda_runtime.topics.replay.rows.RowBatch` in one transaction: every
table's rows (in the fixed table order, by key), then the ``outputs`` rows: a run's
``run.final`` record when the batch has one, else the text rebuilt from the run's
``chunks`` rows as they stand after this batch (the text after the last reset, the
rule SSE and the compactor use). A run whose stored output came from a final record
keeps it: that is the run's whole answer, and its chunks may be gone from the topic.
A failure rolls the whole batch back; nothing is half-written.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from contextlib import AbstractContextManager
from typing import Any

from koda_runtime.lifecycle.chunks import TERMINAL_KINDS, visible_output
from koda_runtime.topics.replay import tables as t
from koda_runtime.topics.replay.rows import RowBatch


class Sink(ABC):
    """A warehouse. ``display`` is its URL without a password, for messages and logs."""

    display: str
    # Takes a batch's chunks rows as Arrow parts (RowBatch.chunk_table) without their
    # becoming tuples: the decoder then decodes chunk polls in DuckDB.
    arrow_chunks = False
    # Rebuilds the outputs rows of a batch marked ``defer_outputs`` later (its runs are
    # kept dirty in the same transaction as its rows): see sinks/duckdb.py.
    defer_outputs = False

    @abstractmethod
    def open(self) -> None:
        """Connect and create missing tables; raise SinkError naming ``display``."""

    @abstractmethod
    def write(self, batch: RowBatch) -> dict[str, int]:
        """Apply ``batch`` in one transaction; return rows upserted per table."""

    @abstractmethod
    def close(self) -> None: ...

    @abstractmethod
    def count(self, table: str) -> int:
        """Rows in ``table`` now."""


class SqlSink(Sink):
    """A sink over a SQL database with ``INSERT ... ON CONFLICT`` (DuckDB, PostgreSQL)."""

    # Upsert each table's rows in key order: the lock order of concurrent writers. A sink
    # with one writer at a time (a DuckDB file) skips the sort.
    key_order = True

    @abstractmethod
    def transaction(self) -> AbstractContextManager[None]:
        """Commit on exit, roll back on an exception."""

    @abstractmethod
    def upsert(self, table: t.Table, rows: list[tuple[Any, ...]]) -> None: ...

    @abstractmethod
    def select(self, sql: str, run_ids: list[str]) -> list[tuple[Any, ...]]:
        """Run ``sql`` whose one parameter is the list ``run_ids``; return its rows."""

    def write(self, batch: RowBatch) -> dict[str, int]:
        written: dict[str, int] = {}
        with self.transaction():
            for table in t.TABLES:
                if table is t.OUTPUTS:
                    continue
                n = self.upsert_batch(table, batch)
                if n:
                    written[table.name] = n
            n = self.write_outputs(batch)
            if n:
                written[t.OUTPUTS.name] = n
        return written

    def write_outputs(self, batch: RowBatch) -> int:
        """Upsert the batch's ``outputs`` rows (inside the transaction, after every other
        table's); return how many."""
        outputs = batch.sorted_rows(t.OUTPUTS) + self._rebuilt_outputs(batch)
        outputs.sort(key=lambda row: row[0])
        if outputs:
            self.upsert(t.OUTPUTS, outputs)
        return len(outputs)

    def upsert_batch(self, table: t.Table, batch: RowBatch) -> int:
        """Upsert the batch's rows of ``table``; return how many (one per key)."""
        rows = batch.sorted_rows(table) if self.key_order else batch.rows_of(table)
        if rows:
            self.upsert(table, rows)
        return len(rows)

    def _rebuilt_outputs(self, batch: RowBatch) -> list[tuple[Any, ...]]:
        wanted = sorted(r for r in batch.chunk_runs if r not in batch.final_runs)
        if not wanted:
            return []
        compacted = {row[0] for row in self.select(self.compacted_sql, wanted)}
        todo = [r for r in wanted if r not in compacted]
        if not todo:
            return []
        return self.rebuild_outputs(todo, batch.chunk_runs)

    def rebuild_outputs(self, run_ids: list[str], days: Mapping[str, Any]) -> list[tuple[Any, ...]]:
        """The outputs rows of ``run_ids`` rebuilt from their stored chunks (see
        :func:`output_row`), in ``run_ids`` order."""
        events: dict[str, list[tuple[int, str, str]]] = {r: [] for r in run_ids}
        for run_id, seq, kind, content in self.select(self.chunks_sql, run_ids):
            events[run_id].append((seq, kind, content))
        return [output_row(r, days[r], events[r]) for r in run_ids]

    # Both dialects spell "this list" differently; subclasses supply the two queries.
    compacted_sql: str
    chunks_sql: str


def output_row(run_id: str, day: Any, events: Iterable[tuple[int, str, str]]) -> tuple[Any, ...]:
    """The outputs row of a run rebuilt from its chunks (``compacted`` false).

    ``end_kind`` stays null until the chunks hold the terminal event and every seq
    before it: a run with a hole has not ended as far as the topic shows (the hole is
    filled later, by the worker that next meets the run or the completeness pass).
    """
    ordered = sorted(events)
    ends = [e for e in ordered if e[1] in TERMINAL_KINDS]
    end = ends[-1] if ends else None
    if end is not None and [e[0] for e in ordered if e[0] <= end[0]] != list(range(end[0] + 1)):
        end = None
    last_seq = ordered[-1][0] if ordered else None
    return (
        run_id,
        day,
        visible_output(ordered),
        None if end is None else end[1],
        None if end is None else end[2],
        last_seq,
        False,
    )
