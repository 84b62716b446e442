"""The warehouse tables a replay writes, the same for every sink (docs/data-dictionary.md).

Every write is an upsert on the table's natural key. What an upsert does to a column
that already has a value is the column's :class:`Merge` rule, applied in SQL by the
sinks and in Python when two records of one batch share a key (:meth:`Table.merge`).
The rules are chosen so that the result does not depend on how often, in how many
batches or in which order records are applied: replaying twice, or two overlapping
replays, leave identical tables.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from functools import cached_property
from operator import itemgetter
from typing import Any


class Merge(Enum):
    """How an upsert combines the stored value (old) and the incoming one (new)."""

    KEY = "key"  # part of the natural key: never updated
    LAST = "last"  # new; for facts that are the same however often they are read
    FIRST = "first"  # old unless it is null
    MAX = "max"  # the larger, nulls ignored
    MIN = "min"  # the smaller, nulls ignored
    NEWER = "newer"  # new when its ``order`` column is larger (a null order never wins)


@dataclass(frozen=True)
class Column:
    """One column; ``type`` is a logical type the sinks map onto their own.

    Types: text, int (32-bit), bigint, bool, timestamp (UTC), date, money (decimal 18,8,
    US dollars), blob (bytes), json (JSON text).
    """

    name: str
    type: str
    merge: Merge = Merge.LAST
    order: str | None = None


@dataclass(frozen=True)
class Table:
    name: str
    columns: tuple[Column, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns)

    @property
    def key(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns if c.merge is Merge.KEY)

    @cached_property
    def _key_getter(self) -> Callable[[tuple[Any, ...]], tuple[Any, ...]]:
        where = [i for i, c in enumerate(self.columns) if c.merge is Merge.KEY]
        if len(where) == 1:
            only = where[0]
            return lambda row: (row[only],)
        return itemgetter(*where)

    def key_of(self, row: tuple[Any, ...]) -> tuple[Any, ...]:
        return self._key_getter(row)

    def merge(self, old: tuple[Any, ...], new: tuple[Any, ...]) -> tuple[Any, ...]:
        """The row an upsert of ``new`` onto stored ``old`` leaves (same rules as the SQL)."""
        index = {c.name: i for i, c in enumerate(self.columns)}
        out = []
        for i, c in enumerate(self.columns):
            a, b = old[i], new[i]
            if c.merge in (Merge.KEY, Merge.FIRST):
                out.append(a if a is not None else b)
            elif c.merge is Merge.LAST:
                out.append(b)
            elif c.merge is Merge.MAX:
                out.append(b if a is None or (b is not None and b > a) else a)
            elif c.merge is Merge.MIN:
                out.append(b if a is None or (b is not None and b < a) else a)
            else:
                assert c.order is not None
                oa, ob = old[index[c.order]], new[index[c.order]]
                out.append(b if ob is not None and (oa is None or ob > oa) else a)
        return tuple(out)

    def update_sql(self, current: str, incoming: str) -> str:
        """The ``SET`` list of ``ON CONFLICT DO UPDATE`` (PostgreSQL and DuckDB alike)."""
        sets = []
        for c in self.columns:
            old, new = f"{current}.{c.name}", f"{incoming}.{c.name}"
            if c.merge is Merge.KEY:
                continue
            if c.merge is Merge.LAST:
                expr = new
            elif c.merge is Merge.FIRST:
                expr = f"COALESCE({old}, {new})"
            elif c.merge is Merge.MAX:
                expr = f"GREATEST({old}, {new})"
            elif c.merge is Merge.MIN:
                expr = f"LEAST({old}, {new})"
            else:
                o_old, o_new = f"{current}.{c.order}", f"{incoming}.{c.order}"
                expr = (
                    f"CASE WHEN {o_new} IS NOT NULL AND ({o_old} IS NULL OR {o_new} > {o_old})"
                    f" THEN {new} ELSE {old} END"
                )
            sets.append(f"{c.name} = {expr}")
        return ", ".join(sets)


def _key(name: str, type_: str) -> Column:
    return Column(name, type_, Merge.KEY)


_SOURCE = (
    _key("source_topic", "text"),
    _key("source_partition", "int"),
    _key("source_offset", "bigint"),
)

RUNS = Table(
    "runs",
    (
        _key("run_id", "text"),
        Column("day", "date", Merge.FIRST),
        Column("user_id", "text", Merge.FIRST),
        Column("session_id", "text", Merge.FIRST),
        Column("created_at", "timestamp", Merge.FIRST),
        Column("status", "text", Merge.NEWER, "state_order"),
        Column("attempt", "int", Merge.NEWER, "state_order"),
        Column("started_at", "timestamp", Merge.MIN),
        Column("finished_at", "timestamp", Merge.NEWER, "state_order"),
        Column("worker_id", "text", Merge.NEWER, "claim_order"),
        Column("state_order", "bigint", Merge.MAX),
        Column("claim_order", "bigint", Merge.MAX),
        # From run.requested: the schedule and scheduled UTC minute of a scheduled run.
        Column("schedule_id", "text", Merge.FIRST),
        Column("scheduled_for", "timestamp", Merge.FIRST),
    ),
)
RUN_TRANSITIONS = Table(
    "run_transitions",
    (
        *_SOURCE,
        Column("run_id", "text"),
        Column("day", "date"),
        Column("status", "text"),
        Column("attempt", "int"),
        Column("worker_id", "text"),
        Column("event_at", "timestamp"),
        # Why: "merged" on a rerun's running, the cancel reason on cancelled. Added
        # after the first release: the sinks add it to existing tables.
        Column("reason", "text"),
    ),
)
CHUNKS = Table(
    "chunks",
    (
        _key("run_id", "text"),
        _key("seq", "int"),
        Column("day", "date"),
        Column("kind", "text"),
        Column("content", "text"),
        Column("attempt", "int"),
    ),
)
OUTPUTS = Table(
    "outputs",
    (
        _key("run_id", "text"),
        Column("day", "date"),
        Column("output", "text"),
        Column("end_kind", "text"),
        Column("end_content", "text"),
        Column("last_seq", "int"),
        Column("compacted", "bool"),
    ),
)
USAGE = Table(
    "usage",
    (
        _key("run_id", "text"),
        _key("call_index", "int"),
        Column("day", "date"),
        Column("model", "text"),
        Column("prompt_tokens", "int"),
        Column("completion_tokens", "int"),
        Column("cost_usd", "money"),
        Column("cost_source", "text"),
        Column("event_at", "timestamp"),
    ),
)
# Every billable call of every attempt, as koda's Postgres ``ledger`` holds it. ``usage``
# above keeps the calls of the attempt that finished each run (attempt-less records).
LEDGER = Table(
    "ledger",
    (
        _key("run_id", "text"),
        _key("attempt", "int"),
        _key("call_index", "int"),
        Column("day", "date"),
        Column("user_id", "text", Merge.FIRST),
        Column("model", "text"),
        Column("kind", "text"),
        Column("prompt_tokens", "int"),
        Column("completion_tokens", "int"),
        Column("cost_usd", "money"),
        Column("cost_source", "text"),
        Column("price_id", "bigint"),
        Column("outcome", "text"),
        Column("estimated", "bool"),
        Column("event_at", "timestamp"),
    ),
)
DEAD_LETTERS = Table(
    "dead_letters",
    (
        *_SOURCE,
        Column("day", "date"),
        Column("event_at", "timestamp"),
        Column("reason", "text"),
        Column("error", "text"),
        Column("attempts", "int"),
        Column("run_id", "text"),
        Column("original_topic", "text"),
        Column("original_partition", "int"),
        Column("original_offset", "bigint"),
        Column("original_key", "blob"),
        Column("original_value", "blob"),
        Column("original_headers", "json"),
        Column("original_size", "bigint"),
        Column("original_sha256", "text"),
        Column("original_truncated", "bool"),
        # The original's key and header sizes and what of it was cut, part by part
        # (null in letters written before they were recorded).
        Column("original_key_size", "bigint"),
        Column("original_headers_count", "int"),
        Column("original_headers_size", "bigint"),
        Column("key_truncated", "bool"),
        Column("headers_truncated", "bool"),
        Column("value_truncated", "bool"),
    ),
)
RAW_RECORDS = Table(
    "raw_records",
    (
        *_SOURCE,
        Column("day", "date"),
        Column("record_ts", "timestamp"),
        Column("schema_header", "text"),
        Column("reason", "text"),
        Column("detail", "text"),
        Column("record_key", "blob"),
        Column("record_value", "blob"),
        Column("headers", "json"),
    ),
)

# From koda's Postgres, not the topics (export.py): what each run was asked, each message
# merged into a running run, the schedules and the memories (without their vectors).
RUN_INPUTS = Table(
    "run_inputs",
    (
        _key("run_id", "text"),
        Column("day", "date", Merge.FIRST),
        Column("user_id", "text", Merge.FIRST),
        Column("session_id", "text", Merge.FIRST),
        Column("created_at", "timestamp", Merge.FIRST),
        # The input as it stands after ``input_version`` merges: the newer version wins.
        Column("input", "json", Merge.NEWER, "input_version"),
        Column("metadata", "json", Merge.FIRST),
        Column("input_version", "int", Merge.MAX),
    ),
)
RUN_MERGES = Table(
    "run_merges",
    (
        _key("run_id", "text"),
        _key("input_version", "int"),
        Column("day", "date"),
        Column("user_id", "text"),
        Column("input", "json"),
        Column("created_at", "timestamp"),
    ),
)
SCHEDULES = Table(
    "schedules",
    (
        _key("schedule_id", "text"),
        Column("day", "date"),
        Column("user_id", "text"),
        Column("session_id", "text"),
        Column("cron", "text"),
        Column("timezone", "text"),
        Column("input", "json"),
        Column("enabled", "bool"),
        Column("quiet_start", "int"),
        Column("quiet_end", "int"),
        Column("daily_cap", "int"),
        Column("overlap", "text"),
        Column("catchup_s", "int"),
        Column("next_fire_at", "timestamp"),
        Column("last_fire_at", "timestamp"),
        Column("created_at", "timestamp"),
        Column("updated_at", "timestamp"),
    ),
)
MEMORIES = Table(
    "memories",
    (
        _key("memory_id", "text"),
        Column("day", "date"),
        Column("user_id", "text"),
        Column("text", "text"),
        Column("embedder", "text"),
        Column("run_id", "text"),
        Column("created_at", "timestamp"),
    ),
)
EXPORTED: tuple[Table, ...] = (RUN_INPUTS, RUN_MERGES, SCHEDULES, MEMORIES)

# Upserts go table by table in this order (and by key within a table), so concurrent
# replays into one PostgreSQL schema take row locks in one global order: no deadlock.
TABLES: tuple[Table, ...] = (
    RUNS,
    RUN_TRANSITIONS,
    CHUNKS,
    USAGE,
    LEDGER,
    DEAD_LETTERS,
    RAW_RECORDS,
    *EXPORTED,
    OUTPUTS,
)
BY_NAME = {t.name: t for t in TABLES}
