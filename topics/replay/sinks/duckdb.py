"""The default sink: one DuckDB file (``--to duckdb:///warehouse.duckdb``).

A batch arrives as an Arrow table registered on the connection and is upserted with
``INSERT ... SELECT ... ON CONFLICT DO UPDATE`` per table, inside one transaction.
DuckDB lets one process write a file at a time; a second writer gets a clear error.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import duckdb

from koda_runtime.topics.replay import sql
from koda_runtime.topics.replay import tables as t
from koda_runtime.topics.replay.errors import SinkError
from koda_runtime.topics.replay.sinks.arrow import to_arrow
from koda_runtime.topics.replay.sinks.base import SqlSink

DUCKDB_TYPES = {
    "text": "VARCHAR",
    "int": "INTEGER",
    "bigint": "BIGINT",
    "bool": "BOOLEAN",
    "timestamp": "TIMESTAMPTZ",
    "date": "DATE",
    "money": "DECIMAL(18,8)",
    "blob": "BLOB",
    "json": "VARCHAR",
}
INCOMING = "koda_incoming"


class DuckDBSink(SqlSink):
    """Tables in one DuckDB database file at ``path``."""

    compacted_sql = (
        "SELECT run_id FROM outputs WHERE compacted AND run_id IN (SELECT unnest(?::VARCHAR[]))"
    )
    chunks_sql = (
        "SELECT run_id, seq, kind, content FROM chunks"
        " WHERE run_id IN (SELECT unnest(?::VARCHAR[]))"
    )

    def __init__(self, path: Path, display: str) -> None:
        self.path = path
        self.display = display
        self._conn: duckdb.DuckDBPyConnection | None = None

    @property
    def conn(self) -> duckdb.DuckDBPyConnection:
        if self._conn is None:
            raise SinkError(f"{self.display} is not open")
        return self._conn

    def open(self) -> None:
        if not self.path.parent.is_dir():
            raise SinkError(
                f"cannot open {self.display}: directory {self.path.parent} does not exist"
            )
        try:
            self._conn = duckdb.connect(str(self.path))
            self._conn.execute("SET TimeZone = 'UTC'")
            for table in t.TABLES:
                self._conn.execute(sql.create_table(table, DUCKDB_TYPES))
                for statement in sql.add_columns(table, DUCKDB_TYPES):
                    self._conn.execute(statement)
        except duckdb.Error as exc:
            self.close()
            hint = " (is another replay writing it?)" if "lock" in str(exc).lower() else ""
            raise SinkError(f"cannot open {self.display}{hint}: {exc}") from exc

    @contextmanager
    def transaction(self) -> Iterator[None]:
        conn = self.conn
        conn.begin()
        try:
            yield
            conn.commit()
        except BaseException as exc:
            conn.rollback()
            if isinstance(exc, duckdb.Error):
                raise SinkError(f"writing to {self.display} failed (rolled back): {exc}") from exc
            raise

    def upsert(self, table: t.Table, rows: list[tuple[Any, ...]]) -> None:
        self.conn.register(INCOMING, to_arrow(table, rows))
        try:
            self.upsert_from(table, INCOMING)
        finally:
            self.conn.unregister(INCOMING)

    def upsert_from(self, table: t.Table, source: str) -> None:
        """Upsert the rows of the registered relation ``source`` (inside the transaction)."""
        self.conn.execute(sql.upsert(table, source))

    def select(self, query: str, run_ids: list[str]) -> list[tuple[Any, ...]]:
        return self.conn.execute(query, [run_ids]).fetchall()

    def count(self, table: str) -> int:
        row = self.conn.execute(sql.count(t.BY_NAME[table])).fetchone()
        return int(row[0]) if row else 0

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
