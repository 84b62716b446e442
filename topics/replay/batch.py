"""One batch of rows (a sink transaction), and the record shape the decoder reads."""

from __future__ import annotations

import uuid
from collections import Counter
from datetime import UTC, date, datetime
from typing import Any, Protocol

from koda_runtime.topics.replay import tables as t


class Message(Protocol):
    """The parts of a confluent-kafka ``Message`` the decoder reads."""

    def topic(self) -> str | None: ...
    def partition(self) -> int | None: ...
    def offset(self) -> int | None: ...
    def key(self) -> bytes | None: ...
    def value(self) -> bytes | None: ...
    def headers(self) -> Any: ...
    def timestamp(self) -> tuple[int, int]: ...


class RowBatch:
    """Rows of one sink transaction, merged per natural key as the sinks would merge them."""

    def __init__(self) -> None:
        self.rows: dict[str, dict[tuple[Any, ...], tuple[Any, ...]]] = {
            x.name: {} for x in t.TABLES
        }
        self.chunk_runs: dict[str, date] = {}  # runs whose outputs row is rebuilt from chunks
        self.final_runs: set[str] = set()
        self.records = 0
        self.tombstones = 0
        self.raw: Counter[str] = Counter()

    def add(self, table: t.Table, row: tuple[Any, ...]) -> None:
        rows = self.rows[table.name]
        key = table.key_of(row)
        old = rows.get(key)
        rows[key] = row if old is None else table.merge(old, row)

    def sorted_rows(self, table: t.Table) -> list[tuple[Any, ...]]:
        """The table's rows in key order (the lock order of concurrent replays)."""
        rows = self.rows[table.name]
        return [rows[k] for k in sorted(rows)]

    def rows_of(self, table: t.Table) -> list[tuple[Any, ...]]:
        """The table's rows, one per key, in no particular order."""
        return list(self.rows[table.name].values())

    def __len__(self) -> int:
        return self.records


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
