"""The DuckDB and Parquet sinks on local files: idempotent, atomic, Decimal money, and
clear errors for a sink that cannot be reached (PostgreSQL's own runs in integration)."""

from __future__ import annotations

import subprocess
import sys
from decimal import Decimal
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.dataset as ds
import pytest

from koda_runtime.lifecycle.ids import uuid7
from koda_runtime.topics.replay import tables as t
from koda_runtime.topics.replay.errors import ReplayOptionError, SinkError
from koda_runtime.topics.replay.sinks import open_sink, redact
from koda_runtime.topics.replay.sinks.duckdb import DuckDBSink
from koda_runtime.topics.replay.sinks.parquet import ParquetSink
from tests.fixtures.processes import ROOT
from tests.unit.replay_records import (
    AT,
    NAMES,
    chunk,
    decode,
    final,
    letter,
    requested,
    transition,
    usage,
)


def history(run: str, n: int = 0) -> list[Any]:
    """One run's records; ``n`` keeps each run's offsets apart (a record's place is unique)."""
    at = 10 * n
    garbage = requested(at + 5, run, "alice")
    garbage.value_ = b"not json"
    return [
        garbage,
        requested(at, run, "alice"),
        transition(at + 1, run, "running", 1, AT, worker="w1"),
        chunk(at, run, 0, "chunk", "one "),
        chunk(at + 1, run, 1, "reset", "{}"),
        chunk(at + 2, run, 2, "chunk", "two"),
        chunk(at + 3, run, 3, "done", "{}"),
        transition(at + 2, run, "done", 1, AT),
        usage(at + 3, run, 0, 2, 5, AT),
        letter(n, run, "alice", "unknown_run"),
    ]


def dump(sink: DuckDBSink) -> dict[str, list[tuple[Any, ...]]]:
    out = {}
    for x in t.TABLES:
        out[x.name] = sorted(sink.conn.execute(f"SELECT * FROM {x.name}").fetchall())
    return out


def outputs(sink: DuckDBSink) -> list[tuple[Any, ...]]:
    return sink.conn.execute("SELECT output, compacted FROM outputs").fetchall()


def test_writing_twice_or_in_other_batches_gives_the_same_tables(tmp_path: Path) -> None:
    runs = [uuid7(), uuid7()]
    records = [m for n, r in enumerate(runs) for m in history(r, n)]
    sink = DuckDBSink(tmp_path / "a.duckdb", "a")
    sink.open()
    sink.write(decode(*records))
    once = dump(sink)
    sink.write(decode(*records))
    assert dump(sink) == once
    other = DuckDBSink(tmp_path / "b.duckdb", "b")
    other.open()
    for m in reversed(records):  # one record per transaction, in reverse
        other.write(decode(m))
    assert dump(other) == once
    outputs = {r[0]: r for r in once["outputs"]}
    assert outputs[runs[0]][2:5] == ("two", "done", "{}")
    (cost,) = sink.conn.execute("SELECT cost_usd FROM usage LIMIT 1").fetchone() or ()
    assert cost == Decimal("0.00000330")
    types = dict(
        sink.conn.execute(
            "SELECT column_name, data_type FROM duckdb_columns() WHERE table_name = 'usage'"
        ).fetchall()
    )
    assert types["cost_usd"] == "DECIMAL(18,8)"
    sink.close()
    other.close()


def test_a_final_record_wins_over_chunks_and_later_chunks_do_not_undo_it(tmp_path: Path) -> None:
    run = uuid7()
    sink = DuckDBSink(tmp_path / "w.duckdb", "w")
    sink.open()
    sink.write(decode(chunk(0, run, 0, "chunk", "partial")))
    assert outputs(sink) == [("partial", False)]
    sink.write(decode(final(5, run, 3, "done", "whole answer")))
    sink.write(decode(chunk(0, run, 0, "chunk", "partial")))
    assert outputs(sink) == [("whole answer", True)]
    sink.close()


def test_a_batch_is_one_transaction(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sink = DuckDBSink(tmp_path / "w.duckdb", "duckdb:///w.duckdb")
    sink.open()
    real = sink.upsert

    def failing(table: t.Table, rows: list[Any]) -> None:
        if table is t.USAGE:
            raise duckdb.ConversionException("disk on fire")
        real(table, rows)

    monkeypatch.setattr(sink, "upsert", failing)
    with pytest.raises(
        SinkError, match="duckdb:///w.duckdb failed \\(rolled back\\): .*disk on fire"
    ):
        sink.write(decode(*history(uuid7())))
    assert all(sink.count(x.name) == 0 for x in t.TABLES)
    sink.close()


def test_parquet_files_by_day_match_the_tables_and_keep_decimals(tmp_path: Path) -> None:
    run = uuid7()
    sink = ParquetSink(tmp_path / "lake", "parquet:///lake")
    sink.open()
    sink.write(decode(*history(run)))
    sink.write(decode(*history(run)))  # rewrites the same day files: still one copy of each row
    for table in (x for x in t.TABLES if x not in t.EXPORTED):  # the topics' tables
        files = list((tmp_path / "lake" / table.name).glob("day=*/part-0.parquet"))
        assert len(files) == 1, table.name
        data = ds.dataset(
            tmp_path / "lake" / table.name, format="parquet", partitioning="hive"
        ).to_table()
        assert data.num_rows == sink.count(table.name)
    usage_file = next((tmp_path / "lake" / "usage").glob("day=*/part-0.parquet"))
    usage_table = ds.dataset(usage_file, format="parquet").to_table()
    assert usage_table.schema.field("cost_usd").type == pa.decimal128(18, 8)
    assert usage_table.column("cost_usd").to_pylist() == [Decimal("0.00000330")]
    sink.close()


def test_parquet_catches_up_on_days_a_crash_left_unwritten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sink = ParquetSink(tmp_path / "lake", "parquet:///lake")
    sink.open()

    def crash(*_: Any) -> None:
        raise OSError("killed")

    monkeypatch.setattr(sink, "_export", crash)
    with pytest.raises(SinkError, match="killed"):
        sink.write(decode(*history(uuid7())))
    sink.close()
    assert not list((tmp_path / "lake").glob("*/day=*/*.parquet"))
    monkeypatch.undo()
    again = ParquetSink(tmp_path / "lake", "parquet:///lake")
    again.open()  # the rows committed; the files are written now
    topics_tables = len(t.TABLES) - len(t.EXPORTED)  # history() has no exported rows
    assert len(list((tmp_path / "lake").glob("*/day=*/part-0.parquet"))) == topics_tables
    again.close()


def test_unreachable_sinks_say_which_without_the_password(tmp_path: Path) -> None:
    missing = open_sink(f"duckdb:///{tmp_path}/nowhere/w.duckdb", NAMES)
    with pytest.raises(SinkError, match="nowhere/w.duckdb: directory .* does not exist"):
        missing.open()
    pg = open_sink("postgresql://reader:s3cret@127.0.0.1:1/warehouse?schema=lake", NAMES)
    with pytest.raises(SinkError) as exc:
        pg.open()
    assert "postgresql://reader:***@127.0.0.1:1/warehouse" in str(exc.value)
    assert "s3cret" not in str(exc.value)
    own = open_sink(f"postgresql://u@127.0.0.1:1/db?schema={NAMES.pg_schema()}", NAMES)
    with pytest.raises(SinkError, match="holds koda's own tables"):
        own.open()
    with pytest.raises(ReplayOptionError, match="unknown sink; use one of duckdb://"):
        open_sink("mysql://u:pw@h/db", NAMES)
    with pytest.raises(ReplayOptionError, match="not a plain identifier"):
        open_sink("postgresql://u@h/db?schema=a;drop", NAMES)
    assert redact("postgresql://u:pw@h:5/d?x=1") == "postgresql://u:***@h:5/d?x=1"
    assert redact("duckdb:///w.duckdb") == "duckdb:///w.duckdb"
    # libpq also takes the password as a query parameter.
    assert redact("postgresql://h/d?password=pw&sslmode=require") == (
        "postgresql://h/d?password=***&sslmode=require"
    )


def test_two_writers_of_one_duckdb_file_get_a_clear_error(tmp_path: Path) -> None:
    first = DuckDBSink(tmp_path / "w.duckdb", "duckdb:///w.duckdb")
    first.open()
    code = (
        "from pathlib import Path; from koda_runtime.topics.replay.sinks.duckdb import DuckDBSink;"
        f"DuckDBSink(Path({str(tmp_path / 'w.duckdb')!r}), 'duckdb:///w.duckdb').open()"
    )

    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    first.close()
    assert done.returncode != 0
    assert "cannot open duckdb:///w.duckdb (is another replay writing it?)" in done.stderr


def test_a_warehouse_of_an_older_release_gains_the_new_columns(tmp_path: Path) -> None:
    path = tmp_path / "old.duckdb"
    old = duckdb.connect(str(path))
    old.execute(
        "CREATE TABLE run_transitions (source_topic TEXT, source_partition INTEGER,"
        " source_offset BIGINT, run_id TEXT, day DATE, status TEXT, attempt INTEGER,"
        " worker_id TEXT, event_at TIMESTAMPTZ,"
        " PRIMARY KEY (source_topic, source_partition, source_offset))"
    )
    old.close()
    sink = DuckDBSink(path, "old.duckdb")
    sink.open()
    try:
        cols = [r[0] for r in sink.conn.execute("DESCRIBE run_transitions").fetchall()]
    finally:
        sink.close()
    assert "reason" in cols
