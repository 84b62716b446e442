"""A PostgreSQL warehouse schema (``--to postgresql://user@host/db?schema=analytics``).

The tables live in their own schema (``schema=`` in the URL, default
``Names.warehouse_schema()``); koda's own schema is refused, so a replay never writes
koda's tables. A batch is copied (``COPY``) into session-local staging tables and
upserted from there, all in one transaction. Two replays may write one schema at the
same time: their set-up takes turns on an advisory lock, and rows are upserted in one
global order (tables.TABLES, then key), so their row locks cannot deadlock; a
serialization failure or deadlock still retries the whole batch a few times.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg import errors
from psycopg import sql as pgsql

from koda_runtime.topics.replay import sql
from koda_runtime.topics.replay import tables as t
from koda_runtime.topics.replay.errors import SinkError
from koda_runtime.topics.replay.rows import RowBatch
from koda_runtime.topics.replay.sinks.base import SqlSink

PG_TYPES = {
    "text": "TEXT",
    "int": "INTEGER",
    "bigint": "BIGINT",
    "bool": "BOOLEAN",
    "timestamp": "TIMESTAMPTZ",
    "date": "DATE",
    "money": "NUMERIC(18,8)",
    "blob": "BYTEA",
    "json": "JSONB",
}
RETRIES = 3
CONNECT_TIMEOUT_S = 10


class PostgresSink(SqlSink):
    """Tables in ``schema`` of the database at ``dsn``."""

    compacted_sql = "SELECT run_id FROM outputs WHERE compacted AND run_id = ANY(%s)"
    chunks_sql = "SELECT run_id, seq, kind, content FROM chunks WHERE run_id = ANY(%s)"

    def __init__(self, dsn: str, schema: str, display: str, *, refuse: str) -> None:
        self.dsn = dsn
        self.schema = schema
        self.display = display
        self.refuse = refuse  # koda's own schema
        self._conn: psycopg.Connection[Any] | None = None

    @property
    def conn(self) -> psycopg.Connection[Any]:
        if self._conn is None:
            raise SinkError(f"{self.display} is not open")
        return self._conn

    def open(self) -> None:
        if self.schema == self.refuse:
            raise SinkError(
                f"{self.display}: schema {self.schema} holds koda's own tables; choose a "
                "warehouse schema with ?schema=NAME"
            )
        try:
            self._conn = psycopg.connect(
                self.dsn, connect_timeout=CONNECT_TIMEOUT_S, autocommit=True
            )
        except psycopg.Error as exc:
            raise SinkError(f"cannot reach {self.display}: {_first_line(exc)}") from None
        try:
            with self.conn.transaction():
                # IF NOT EXISTS is not safe against a concurrent create of the same name
                # (both pass the check, one fails on the catalogue's unique index), so
                # replays setting up one schema take turns; the lock ends with the
                # transaction.
                self.conn.execute(
                    "SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))",
                    [f"koda.replay.setup:{self.schema}"],
                )
                self.conn.execute(
                    pgsql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(
                        pgsql.Identifier(self.schema)
                    )
                )
                self.conn.execute(
                    "SELECT set_config('search_path', %s, false)", [f'"{self.schema}"']
                )
                for table in t.TABLES:
                    self.conn.execute(sql.create_table(table, PG_TYPES))
                    for statement in sql.add_columns(table, PG_TYPES):
                        self.conn.execute(statement)
                    self.conn.execute(sql.stage_table(table, _stage(table)))
        except psycopg.Error as exc:
            self.close()
            raise SinkError(f"cannot set up {self.display}: {_first_line(exc)}") from exc

    def write(self, batch: RowBatch) -> dict[str, int]:
        for attempt in range(1, RETRIES + 1):
            try:
                return super().write(batch)
            except SinkError as exc:
                retry = isinstance(
                    exc.__cause__, errors.DeadlockDetected | errors.SerializationFailure
                )
                if not retry or attempt == RETRIES:
                    raise
                time.sleep(0.05 * attempt)  # back off before the batch is tried again
        raise AssertionError("unreachable")

    @contextmanager
    def transaction(self) -> Iterator[None]:
        try:
            with self.conn.transaction():
                yield
        except psycopg.Error as exc:
            raise SinkError(
                f"writing to {self.display} failed (rolled back): {_first_line(exc)}"
            ) from exc

    def upsert(self, table: t.Table, rows: list[tuple[Any, ...]]) -> None:
        stage = _stage(table)
        with self.conn.cursor() as cur:
            columns = pgsql.SQL(", ").join(pgsql.Identifier(n) for n in table.names)
            copy = pgsql.SQL("COPY {} ({}) FROM STDIN").format(pgsql.Identifier(stage), columns)
            with cur.copy(copy) as out:
                for row in rows:
                    out.write_row(row)
            cur.execute(sql.upsert(table, stage))

    def select(self, query: str, run_ids: list[str]) -> list[tuple[Any, ...]]:
        return list(self.conn.execute(query, [run_ids]).fetchall())

    def count(self, table: str) -> int:
        row = self.conn.execute(sql.count(t.BY_NAME[table])).fetchone()
        return int(row[0]) if row else 0

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def _stage(table: t.Table) -> str:
    return f"stage_{table.name}"


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
