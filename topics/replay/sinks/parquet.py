"""Parquet files partitioned by day (``--to parquet:///dir``).

Layout: ``<dir>/<table>/day=YYYY-MM-DD/part-0.parquet`` (Hive style: ``day`` comes from
the path, so readers such as DuckDB's ``read_parquet(..., hive_partitioning=true)``,
Spark or ``pyarrow.dataset`` see it as a column). Files cannot be upserted in place, so
the sink keeps the upserted tables in a DuckDB file beside them (``<dir>/_state.duckdb``;
names starting with ``_`` are skipped by Parquet readers) and rewrites every day file a
batch touched, each one atomically (written aside, then renamed).

Which days need rewriting is recorded in the same transaction as the rows
(``_dirty``) and cleared only once the file is written, so a crash between the two
leaves the day marked and the next open rewrites it: the files always catch up with
the state.
"""

from __future__ import annotations

import os
from datetime import date
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from koda_runtime.topics.replay import sql
from koda_runtime.topics.replay import tables as t
from koda_runtime.topics.replay.arrow import arrow_schema
from koda_runtime.topics.replay.errors import SinkError
from koda_runtime.topics.replay.rows import RowBatch
from koda_runtime.topics.replay.sinks.duckdb import DuckDBSink, upsert_sql

STATE_FILE = "_state.duckdb"
_DIRTY = (
    "CREATE TABLE IF NOT EXISTS _dirty"
    " (table_name VARCHAR, day DATE, PRIMARY KEY (table_name, day))"
)


class ParquetSink(DuckDBSink):
    """Day-partitioned Parquet files under ``directory``."""

    defer_outputs = False  # each batch's day files hold its outputs

    def __init__(self, directory: Path, display: str) -> None:
        super().__init__(directory / STATE_FILE, display)
        self.directory = directory

    def open(self) -> None:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise SinkError(f"cannot create {self.display}: {exc}") from exc
        super().open()
        self.conn.execute(_DIRTY)
        self._export_dirty()  # what a crash after a commit left unwritten

    def upsert_from(self, table: t.Table, source: str) -> None:
        # The days of these keys before and after the upsert (a row may move to another day).
        mark = sql.mark_days(table, source)
        self.conn.execute(mark)
        self.conn.execute(upsert_sql(table, source))
        self.conn.execute(mark)

    def write(self, batch: RowBatch) -> dict[str, int]:
        written = super().write(batch)
        self._export_dirty()
        return written

    def _export_dirty(self) -> None:
        dirty = self.conn.execute("SELECT table_name, day FROM _dirty ORDER BY 1, 2").fetchall()
        for name, day in dirty:
            try:
                self._export(t.BY_NAME[name], day)
            except OSError as exc:
                raise SinkError(f"writing {self.display} failed: {exc}") from exc
            self.conn.execute("DELETE FROM _dirty WHERE table_name = ? AND day = ?", [name, day])

    def _export(self, table: t.Table, day: date) -> None:
        cols = [c for c in table.names if c != "day"]
        data = self.conn.sql(sql.day_rows(table), params=[day]).to_arrow_table()
        schema = arrow_schema(table)
        data = data.cast(pa.schema([schema.field(c) for c in cols]))
        folder = self.directory / table.name / f"day={day.isoformat()}"
        target = folder / "part-0.parquet"
        if data.num_rows == 0:
            target.unlink(missing_ok=True)
            return
        folder.mkdir(parents=True, exist_ok=True)
        aside = folder / ".part-0.parquet.tmp"
        pq.write_table(data, aside)
        os.replace(aside, target)
