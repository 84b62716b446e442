"""The default sink: one DuckDB file (``--to duckdb:///warehouse.duckdb``).

A batch arrives as an Arrow table registered on the connection and is upserted with
``INSERT ... SELECT ... ON CONFLICT DO UPDATE`` per table (``MERGE`` on the key for the
chunks table, which has no primary key: :data:`UNINDEXED`), inside one transaction.
DuckDB lets one process write a file at a time; a second writer gets a clear error.
The ``outputs`` rows are rebuilt when the engine says (:data:`DIRTY_RUNS`): a batch may
only mark its runs, in its own transaction, for a later batch to rebuild.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa

from koda_runtime.lifecycle.chunks import TERMINAL_KINDS, ChunkKind
from koda_runtime.topics.replay import sql
from koda_runtime.topics.replay import tables as t
from koda_runtime.topics.replay.arrow import to_arrow
from koda_runtime.topics.replay.errors import SinkError
from koda_runtime.topics.replay.rows import RowBatch
from koda_runtime.topics.replay.sinks.base import SqlSink, output_row

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
WANTED = "koda_wanted"  # the runs whose outputs rows a batch rebuilds (rebuild_sql)
# The runs whose outputs rows are not rebuilt yet (DuckDBSink.defer_outputs), written in
# the transaction of the chunks that made them dirty, so a replay killed at any point
# leaves them marked and the next replay's last batch rebuilds them.
DIRTY_RUNS = "_dirty_runs"
# Dirty runs that make a batch rebuild them even when it defers: bounds the rebuild's
# size (and the staleness of a long bounded replay's outputs).
DIRTY_RUNS_MAX = 50_000
# Tables created without a primary key, kept unique by MERGE (sql.merge) on their key:
# the chunks table's index cost more than the rest of its upsert (200,000 chunk rows in
# five transactions: 0.25 s to upsert and commit with it, 0.09 s with MERGE and none).
UNINDEXED = frozenset({t.CHUNKS.name})


_KINDS = {
    "ends": sorted(k.value for k in TERMINAL_KINDS),
    "reset": ChunkKind.RESET.value,
    "chunk": ChunkKind.CHUNK.value,
}


class DuckDBSink(SqlSink):
    """Tables in one DuckDB database file at ``path``."""

    key_order = False  # DuckDB lets one process write a file: no lock order to keep
    arrow_chunks = True
    defer_outputs = True

    # A batch's chunks rows, the last of each key (by part, then place in its part).
    last_chunks_sql = sql.last_rows(t.CHUNKS, INCOMING, "part DESC, pos DESC")

    compacted_sql = (
        "SELECT run_id FROM outputs WHERE compacted AND run_id IN (SELECT unnest(?::VARCHAR[]))"
    )
    chunks_sql = (
        "SELECT run_id, seq, kind, content FROM chunks"
        " WHERE run_id IN (SELECT unnest(?::VARCHAR[]))"
    )

    # output_row in SQL, one row per run of the list $runs: the text of the ``chunk``
    # events after the last ``reset`` by seq; the terminal event with the highest seq,
    # kept only when every seq below it is there (seqs are unique per run, so counting
    # them is enough).
    outputs_sql = """
        WITH c AS (
            SELECT run_id, seq, kind, content FROM chunks
            WHERE run_id IN (SELECT unnest($runs::VARCHAR[]))
        ), r AS (
            SELECT run_id,
                coalesce(max(seq) FILTER (WHERE kind = $reset), -1) AS last_reset,
                max(seq) FILTER (WHERE list_contains($ends, kind)) AS end_seq,
                arg_max(kind, seq) FILTER (WHERE list_contains($ends, kind)) AS end_kind,
                arg_max(content, seq) FILTER (WHERE list_contains($ends, kind)) AS end_content,
                max(seq) AS last_seq
            FROM c GROUP BY run_id
        )
        SELECT r.run_id,
            coalesce(
                string_agg(c.content, '' ORDER BY c.seq)
                    FILTER (WHERE c.kind = $chunk AND c.seq > r.last_reset),
                ''
            ) AS output,
            CASE WHEN count(*) FILTER (WHERE c.seq <= r.end_seq) = r.end_seq + 1
                THEN r.end_kind END AS end_kind,
            CASE WHEN count(*) FILTER (WHERE c.seq <= r.end_seq) = r.end_seq + 1
                THEN r.end_content END AS end_content,
            r.last_seq
        FROM r JOIN c USING (run_id)
        GROUP BY r.run_id, r.last_reset, r.end_seq, r.end_kind, r.end_content, r.last_seq
    """
    # A batch's rebuilt outputs rows in one query (the same rules over the runs of the
    # relation koda_wanted: run_id, day), as an Arrow table upserted without the rows
    # becoming Python objects: every run but those whose stored output is compacted (a
    # final record's), a run without stored chunks as output_row builds it (empty
    # text, no end). It replaced a query for the compacted runs, one for the rebuilt
    # rows fetched into Python, and their conversion back to Arrow.
    rebuild_sql = """
        SELECT w.run_id, w.day, coalesce(o.output, '') AS output, o.end_kind,
            o.end_content, o.last_seq, false AS compacted
        FROM koda_wanted w LEFT JOIN (
            WITH c AS (
                SELECT run_id, seq, kind, content FROM chunks
                WHERE run_id IN (SELECT run_id FROM koda_wanted)
            ), r AS (
                SELECT run_id,
                    coalesce(max(seq) FILTER (WHERE kind = $reset), -1) AS last_reset,
                    max(seq) FILTER (WHERE list_contains($ends, kind)) AS end_seq,
                    arg_max(kind, seq) FILTER (WHERE list_contains($ends, kind)) AS end_kind,
                    arg_max(content, seq) FILTER (WHERE list_contains($ends, kind))
                        AS end_content,
                    max(seq) AS last_seq
                FROM c GROUP BY run_id
            )
            SELECT r.run_id,
                coalesce(
                    string_agg(c.content, '' ORDER BY c.seq)
                        FILTER (WHERE c.kind = $chunk AND c.seq > r.last_reset),
                    ''
                ) AS output,
                CASE WHEN count(*) FILTER (WHERE c.seq <= r.end_seq) = r.end_seq + 1
                    THEN r.end_kind END AS end_kind,
                CASE WHEN count(*) FILTER (WHERE c.seq <= r.end_seq) = r.end_seq + 1
                    THEN r.end_content END AS end_content,
                r.last_seq
            FROM r JOIN c USING (run_id)
            GROUP BY r.run_id, r.last_reset, r.end_seq, r.end_kind, r.end_content, r.last_seq
        ) o USING (run_id)
        WHERE w.run_id NOT IN (SELECT run_id FROM outputs WHERE compacted)
    """
    # The dirty runs (DIRTY_RUNS); a batch's runs marked (their day: the last batch's).
    create_dirty_sql = (
        "CREATE TABLE IF NOT EXISTS _dirty_runs (run_id VARCHAR PRIMARY KEY, day DATE)"
    )
    mark_dirty_sql = (
        "INSERT INTO _dirty_runs SELECT run_id, day FROM koda_wanted"
        " ON CONFLICT (run_id) DO UPDATE SET day = excluded.day"
    )
    clear_dirty_sql = "DELETE FROM _dirty_runs"

    # Every (table, column) of the database's own tables, for open().
    columns_sql = (
        "SELECT table_name, column_name FROM duckdb_columns()"
        " WHERE database_name = current_database() AND schema_name = current_schema()"
    )

    def __init__(self, path: Path, display: str) -> None:
        self.path = path
        self.display = display
        self._conn: duckdb.DuckDBPyConnection | None = None
        self._dirty = 0  # rows of DIRTY_RUNS (at most: a run marked twice counts twice)

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
            self._conn = conn = duckdb.connect(str(self.path))
            conn.execute("SET TimeZone = 'UTC'")
            # One transaction, and ALTER only for a column missing (a table of an older
            # release): a statement apiece, committed apiece, took a third of the opening.
            conn.begin()
            for table in t.TABLES:
                indexed = table.name not in UNINDEXED
                conn.execute(sql.create_table(table, DUCKDB_TYPES, primary_key=indexed))
            if self.defer_outputs:
                conn.execute(self.create_dirty_sql)
                self._dirty = len(conn.table(DIRTY_RUNS))
            have = set(conn.execute(self.columns_sql).fetchall())
            for table in t.TABLES:
                for column, statement in sql.add_columns_by_name(table, DUCKDB_TYPES):
                    if (table.name, column) not in have:
                        conn.execute(statement)
            conn.commit()
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

    def upsert_batch(self, table: t.Table, batch: RowBatch) -> int:
        if table is not t.CHUNKS or not batch.chunk_parts:
            return super().upsert_batch(table, batch)
        incoming = batch.chunk_table()
        last = incoming.drop_columns(["part", "pos"])
        if last.group_by(list(t.CHUNKS.key)).aggregate([]).num_rows < incoming.num_rows:
            # A key more than once (a chunk written again): one statement may not update
            # a row twice, so only the last of each key goes in.
            self.conn.register(INCOMING, incoming)
            try:
                last = self.conn.sql(self.last_chunks_sql).to_arrow_table()
            finally:
                self.conn.unregister(INCOMING)
        self.conn.register(INCOMING, last)
        try:
            self.upsert_from(table, INCOMING)
        finally:
            self.conn.unregister(INCOMING)
        return int(last.num_rows)

    def upsert(self, table: t.Table, rows: list[tuple[Any, ...]]) -> None:
        self.conn.register(INCOMING, to_arrow(table, rows))
        try:
            self.upsert_from(table, INCOMING)
        finally:
            self.conn.unregister(INCOMING)

    def upsert_from(self, table: t.Table, source: str) -> None:
        """Upsert the rows of the registered relation ``source`` (inside the transaction)."""
        self.conn.execute(upsert_sql(table, source))

    def rebuild_outputs(self, run_ids: list[str], days: Mapping[str, Any]) -> list[tuple[Any, ...]]:
        """:func:`output_row` computed by DuckDB, so a batch's chunks never come back
        into Python; a run without stored chunks gets output_row's empty row."""
        params = {"runs": run_ids, **_KINDS}
        found = {row[0]: row for row in self.conn.execute(self.outputs_sql, params).fetchall()}
        return [
            (r, days[r], *found[r][1:], False) if r in found else output_row(r, days[r], [])
            for r in run_ids
        ]

    def write_outputs(self, batch: RowBatch) -> int:
        """The final records' outputs rows, then the others rebuilt by :attr:`rebuild_sql`:
        the batch's own runs, or (with :attr:`defer_outputs`) every run marked dirty,
        and only when the batch does not defer them or too many are marked. A run
        written by many batches is then rebuilt once (make bench-replay's topic: 0.2 to
        0.4 us of CPU per record less)."""
        finals = batch.rows_of(t.OUTPUTS)
        if finals:
            self.upsert(t.OUTPUTS, finals)
        wanted = [r for r in batch.chunk_runs if r not in batch.final_runs]
        if wanted:
            days = [batch.chunk_runs[r] for r in wanted]
            runs = pa.table(
                {"run_id": pa.array(wanted, pa.string()), "day": pa.array(days, pa.date32())}
            )
            self.conn.register(WANTED, runs)
        try:
            if not self.defer_outputs:
                return len(finals) + (self._rebuild() if wanted else 0)
            if wanted:
                self.conn.execute(self.mark_dirty_sql)
                self._dirty += len(wanted)
        finally:
            if wanted:
                self.conn.unregister(WANTED)
        if batch.defer_outputs and self._dirty < DIRTY_RUNS_MAX:
            return len(finals)  # (a count off after a rollback only moves the bound)
        dirty = self.conn.table(DIRTY_RUNS)
        self.conn.register(WANTED, dirty)
        try:
            rebuilt = self._rebuild()
        finally:
            self.conn.unregister(WANTED)
        self.conn.execute(self.clear_dirty_sql)
        self._dirty = 0
        return len(finals) + rebuilt

    def _rebuild(self) -> int:
        """Upsert the outputs rows of the runs of the relation koda_wanted (run_id, day)."""
        rebuilt = self.conn.sql(self.rebuild_sql, params=_KINDS).to_arrow_table()
        if rebuilt.num_rows:
            self.conn.register(INCOMING, rebuilt)
            try:
                self.upsert_from(t.OUTPUTS, INCOMING)
            finally:
                self.conn.unregister(INCOMING)
        return int(rebuilt.num_rows)

    def select(self, query: str, run_ids: list[str]) -> list[tuple[Any, ...]]:
        return self.conn.execute(query, [run_ids]).fetchall()

    def count(self, table: str) -> int:
        row = self.conn.execute(sql.count(t.BY_NAME[table])).fetchone()
        return int(row[0]) if row else 0

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def upsert_sql(table: t.Table, source: str) -> str:
    """The upsert of ``source``'s rows (one per key) into ``table``: ``MERGE`` for a table
    of :data:`UNINDEXED` (it has no key for ``ON CONFLICT``; one created by an older
    release has, and MERGE gives it the same rows), else ``INSERT ... ON CONFLICT``."""
    if table.name in UNINDEXED:
        return sql.merge(table, source)
    return sql.upsert(table, source)
