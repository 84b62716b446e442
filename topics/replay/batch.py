"""One batch of rows (a sink transaction), and the record shape the decoder reads."""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Iterable
from datetime import UTC, date, datetime
from operator import methodcaller
from typing import Any, Protocol

import pyarrow as pa

from koda_runtime.topics.replay import tables as t
from koda_runtime.topics.replay.arrow import arrow_schema


class Message(Protocol):
    """The parts of a confluent-kafka ``Message`` the decoder reads."""

    def topic(self) -> str | None: ...
    def partition(self) -> int | None: ...
    def offset(self) -> int | None: ...
    def key(self) -> bytes | None: ...
    def value(self) -> bytes | None: ...
    def headers(self) -> Any: ...
    def timestamp(self) -> tuple[int, int]: ...


def read_all(msgs: Iterable[Message], part: str) -> list[Any]:
    """``m.<part>()`` of every message, read by map(): no Python frame per record (a
    poll is up to 20,000 of them)."""
    return list(map(methodcaller(part), msgs))


class RowBatch:
    """Rows of one sink transaction, merged per natural key as the sinks would merge them."""

    def __init__(self) -> None:
        self.rows: dict[str, dict[tuple[Any, ...], tuple[Any, ...]]] = {
            x.name: {} for x in t.TABLES
        }
        # chunks rows decoded by DuckDB (topics/replay/chunk_polls.py), one table per poll,
        # in arrival order; the chunks rows in ``rows`` came after the last of them.
        self.chunk_parts: list[pa.Table] = []
        self.chunk_runs: dict[str, date] = {}  # runs whose outputs row is rebuilt from chunks
        self.final_runs: set[str] = set()
        self.records = 0
        self.tombstones = 0
        self.raw: Counter[str] = Counter()
        # The reader's next offset per (topic, partition) when the batch was cut: what a
        # sink that records offsets beside its rows stores (set by BatchWriter.submit).
        self.positions: dict[tuple[str, int], int] = {}
        # True: a sink that defers the outputs rebuild (Sink.defer_outputs) only marks the
        # batch's runs dirty; False (the default): every dirty run is rebuilt with it.
        self.defer_outputs = False
        # Written even when empty: it rebuilds the dirty runs (set by the engine).
        self.flush_outputs = False

    def add(self, table: t.Table, row: tuple[Any, ...]) -> None:
        rows = self.rows[table.name]
        key = table.key_of(row)
        old = rows.get(key)
        rows[key] = row if old is None else table.merge(old, row)

    def add_chunk_part(self, part: pa.Table, runs: dict[str, date], records: int) -> None:
        """A poll's ``chunks`` rows as an Arrow table (with ``pos``, the order within
        it), from ``records`` records, with the runs they touch and their days."""
        rows = self.rows[t.CHUNKS.name]
        if rows:  # earlier rows stay earlier: they become the part before this one
            self.chunk_parts.append(chunk_rows_part(list(rows.values())))
            rows.clear()
        self.chunk_parts.append(part)
        self.chunk_runs.update(runs)
        self.records += records

    def chunk_table(self) -> pa.Table:
        """Every ``chunks`` row of the batch as one Arrow table, with ``part`` and
        ``pos`` saying which came last for a key (the highest pair wins)."""
        parts = list(self.chunk_parts)
        rows = self.rows[t.CHUNKS.name]
        if rows:
            parts.append(chunk_rows_part(list(rows.values())))
        return pa.concat_tables(
            p.append_column("part", pa.array([i] * p.num_rows, pa.int32()))
            for i, p in enumerate(parts)
        )

    def _fold_parts(self, table: t.Table) -> None:
        """The Arrow parts merged into ``rows`` (for a sink that takes tuples)."""
        if table is not t.CHUNKS or not self.chunk_parts:
            return
        merged: dict[tuple[Any, ...], tuple[Any, ...]] = {}
        names = t.CHUNKS.names
        for part in self.chunk_parts:
            columns = [part[n].to_pylist() for n in names]
            merged.update(((r[0], r[1]), r) for r in zip(*columns, strict=True))
        merged.update(self.rows[table.name])
        self.rows[table.name] = merged
        self.chunk_parts = []

    def sorted_rows(self, table: t.Table) -> list[tuple[Any, ...]]:
        """The table's rows in key order (the lock order of concurrent replays)."""
        self._fold_parts(table)
        rows = self.rows[table.name]
        return [rows[k] for k in sorted(rows)]

    def rows_of(self, table: t.Table) -> list[tuple[Any, ...]]:
        """The table's rows, one per key, in no particular order."""
        self._fold_parts(table)
        return list(self.rows[table.name].values())

    def __len__(self) -> int:
        return self.records


def chunk_rows_part(rows: list[tuple[Any, ...]]) -> pa.Table:
    """``chunks`` rows (tuples, one per key) as a part: the table's columns and ``pos``."""
    columns = list(zip(*rows, strict=True))
    schema = arrow_schema(t.CHUNKS)
    arrays = [pa.array(col, type=f.type) for col, f in zip(columns, schema, strict=True)]
    arrays.append(pa.array(range(len(rows)), pa.int32()))
    return pa.Table.from_arrays(arrays, schema=schema.append(pa.field("pos", pa.int32())))


def run_day(run_id: str, fallback: date) -> date:
    """The day a run belongs to: its UUIDv7's timestamp, else ``fallback``."""
    return uuid7_day(run_id) or fallback


def uuid7_day(run_id: str) -> date | None:
    try:
        u = uuid.UUID(run_id)
    except ValueError:
        return None
    if u.version != 7:
        return None
    return datetime.fromtimestamp((u.int >> 80) / 1000, UTC).date()


def instant(ts_ms: int) -> datetime:
    """A record timestamp (ms) as an aware datetime."""
    return datetime.fromtimestamp(max(ts_ms, 0) / 1000, UTC)
