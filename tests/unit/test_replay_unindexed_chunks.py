"""The DuckDB sink's chunks table has no primary key (topics/replay/sinks/duckdb.py,
UNINDEXED): its rows stay one per (run_id, seq) only because every write is a MERGE on
that key.

Failure mode: a chunk written again (a replay run twice, a batch read again after a
crash, a chunk rewritten by a later attempt, overlapping polls of one batch) leaves a
second row of its key. Each test writes the same keys again and counts the rows per key.
"""

from __future__ import annotations

from pathlib import Path

import duckdb
import pyarrow.parquet as pq

from koda_runtime.lifecycle.ids import uuid7
from koda_runtime.topics.replay.rows import RecordDecoder, RowBatch
from koda_runtime.topics.replay.sinks.duckdb import DuckDBSink
from koda_runtime.topics.replay.sinks.parquet import ParquetSink
from tests.unit.replay_records import NAMES, PRICES, FakeMessage, chunk


def in_duckdb(*polls: list[FakeMessage]) -> RowBatch:
    """The batch of ``polls`` as the replay of a DuckDB sink decodes it (Arrow parts)."""
    batch, decoder = RowBatch(), RecordDecoder(NAMES, PRICES, arrow_chunks=True)
    try:
        for msgs in polls:
            decoder.add_many(msgs, batch)
    finally:
        decoder.close()
    assert batch.chunk_parts, "the polls took the Arrow path"
    return batch


def chunks(sink: DuckDBSink) -> list[tuple[object, ...]]:
    return sorted(sink.conn.execute("SELECT run_id, seq, content, attempt FROM chunks").fetchall())


def one_row_per_key(sink: DuckDBSink) -> bool:
    rows, keys = sink.conn.execute(
        "SELECT count(*), count(DISTINCT (run_id, seq)) FROM chunks"
    ).fetchone() or (0, 0)
    return bool(rows == keys)


def test_the_chunks_table_has_no_primary_key_and_its_key_columns_are_not_null(
    tmp_path: Path,
) -> None:
    sink = DuckDBSink(tmp_path / "w.duckdb", "w")
    sink.open()
    try:
        kinds = sink.conn.execute(
            "SELECT constraint_type, constraint_column_names FROM duckdb_constraints()"
            " WHERE table_name = 'chunks'"
        ).fetchall()
    finally:
        sink.close()
    assert ("PRIMARY KEY", ["run_id", "seq"]) not in kinds
    assert ("NOT NULL", ["run_id"]) in kinds and ("NOT NULL", ["seq"]) in kinds


def test_writing_the_same_chunks_again_leaves_one_row_per_key_the_last_one(
    tmp_path: Path,
) -> None:
    run = uuid7()
    first = [chunk(i, run, i, "chunk", f"w{i} ") for i in range(5)]
    sink = DuckDBSink(tmp_path / "w.duckdb", "w")
    sink.open()
    try:
        sink.write(in_duckdb(first))
        once = chunks(sink)
        sink.write(in_duckdb(first))  # the replay run again
        assert chunks(sink) == once and len(once) == 5
        # A later attempt rewrites seq 2, twice within one batch (two polls): the last wins.
        again = [chunk(10, run, 2, "chunk", "x ", 2)]
        last = [chunk(11, run, 2, "chunk", "y ", 3), chunk(12, run, 5, "done", "{}", 3)]
        sink.write(in_duckdb(again, last))
        assert one_row_per_key(sink)
        assert (run, 2, "y ", 3) in chunks(sink) and len(chunks(sink)) == 6
        output = sink.conn.execute("SELECT output, end_kind FROM outputs").fetchall()
        assert output == [("w0 w1 y w3 w4 ", "done")]
    finally:
        sink.close()


def test_a_warehouse_whose_chunks_table_has_the_old_primary_key_still_upserts(
    tmp_path: Path,
) -> None:
    path = tmp_path / "old.duckdb"
    old = duckdb.connect(str(path))
    old.execute(
        "CREATE TABLE chunks (run_id VARCHAR, seq INTEGER, day DATE, kind VARCHAR,"
        " content VARCHAR, attempt INTEGER, PRIMARY KEY (run_id, seq))"
    )
    old.close()
    run = uuid7()
    records = [chunk(i, run, i, "chunk", "a ") for i in range(3)]
    sink = DuckDBSink(path, "old.duckdb")
    sink.open()
    try:
        sink.write(in_duckdb(records))
        sink.write(in_duckdb([*records, chunk(3, run, 1, "chunk", "b ", 2)]))
        assert one_row_per_key(sink)
        assert chunks(sink) == [(run, 0, "a ", 1), (run, 1, "b ", 2), (run, 2, "a ", 1)]
    finally:
        sink.close()


def test_the_parquet_sink_keeps_one_row_per_key_too(tmp_path: Path) -> None:
    run = uuid7()
    records = [chunk(i, run, i, "chunk", "a ") for i in range(4)]
    sink = ParquetSink(tmp_path / "lake", "lake")
    sink.open()
    try:
        sink.write(in_duckdb(records))
        sink.write(in_duckdb(records))
        assert one_row_per_key(sink) and len(chunks(sink)) == 4
    finally:
        sink.close()
    files = list((tmp_path / "lake" / "chunks").rglob("*.parquet"))
    assert len(files) == 1 and pq.read_table(files[0]).num_rows == 4
