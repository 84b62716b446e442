"""The DuckDB sink's deferred outputs rebuild (sinks/duckdb.py ``defer_outputs``).

Failure mode: dirty runs lost, so a replay killed between a batch that deferred its
outputs and the rebuild leaves outputs rows missing or stale after the next replay.
The dirty runs are written in the batch's own transaction; a process that dies right
after it (no close, no flush) must leave them for the next open to rebuild.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from koda_runtime.lifecycle.ids import uuid7
from koda_runtime.topics.replay import tables as t
from koda_runtime.topics.replay.batch import RowBatch
from koda_runtime.topics.replay.sinks import duckdb as duckdb_sink
from koda_runtime.topics.replay.sinks.duckdb import DuckDBSink
from tests.fixtures.processes import ROOT
from tests.unit.replay_records import chunk, decode, final

RUNS = [
    "018f0000-0000-7000-8000-000000000001",
    "018f0000-0000-7000-8000-000000000002",
    "018f0000-0000-7000-8000-000000000003",
]


def batches() -> list[list[Any]]:
    """Three batches: each run's chunks spread over them, one run ending in a final."""
    a, b, c = RUNS
    return [
        [
            chunk(0, a, 0, "chunk", "one "),
            chunk(1, b, 0, "chunk", "x"),
            chunk(2, c, 0, "chunk", "c"),
        ],
        [
            chunk(3, a, 1, "reset", "{}"),
            chunk(4, a, 2, "chunk", "two"),
            chunk(5, b, 1, "chunk", "y"),
        ],
        [chunk(6, a, 3, "done", "{}"), final(7, b, 1, "done", "whole answer")],
    ]


def rows(sink: DuckDBSink, table: t.Table) -> list[tuple[Any, ...]]:
    return sorted(sink.conn.execute(f"SELECT * FROM {table.name}").fetchall())  # noqa: S608


def flush() -> RowBatch:
    batch = RowBatch()
    batch.flush_outputs = True
    return batch


def reference(path: Path) -> list[tuple[Any, ...]]:
    """The outputs rows of the batches each rebuilt at once (the rule before deferral)."""
    sink = DuckDBSink(path, "ref")
    sink.defer_outputs = False
    sink.open()
    try:
        for records in batches():
            sink.write(decode(*records))
        return rows(sink, t.OUTPUTS)
    finally:
        sink.close()


def deferred(*records: Any) -> RowBatch:
    batch = decode(*records)
    batch.defer_outputs = True
    return batch


def test_deferred_runs_are_rebuilt_once_at_the_flush_with_the_same_rows(tmp_path: Path) -> None:
    want = reference(tmp_path / "ref.duckdb")
    assert {r[0] for r in want} == set(RUNS)
    sink = DuckDBSink(tmp_path / "w.duckdb", "w")
    sink.open()
    try:
        written = [sink.write(deferred(*records)) for records in batches()]
        # Only the final record's row so far: nothing rebuilt, each run marked once.
        assert [r[0] for r in rows(sink, t.OUTPUTS)] == [RUNS[1]]
        assert "outputs" not in written[0] and "outputs" not in written[1]
        dirty = sink.conn.execute("SELECT run_id FROM _dirty_runs ORDER BY 1").fetchall()
        assert [r[0] for r in dirty] == RUNS
        assert sink.write(flush()) == {"outputs": 2}  # the compacted run is not rebuilt
        assert rows(sink, t.OUTPUTS) == want
        assert sink.conn.execute("SELECT count(*) FROM _dirty_runs").fetchone() == (0,)
    finally:
        sink.close()


def test_a_process_killed_after_deferring_leaves_its_runs_for_the_next_replay(
    tmp_path: Path,
) -> None:
    want = reference(tmp_path / "ref.duckdb")
    path = tmp_path / "w.duckdb"
    code = (
        "import os\n"
        "from pathlib import Path\n"
        "from koda_runtime.topics.replay.sinks.duckdb import DuckDBSink\n"
        "from tests.unit.test_replay_deferred_outputs import batches, deferred\n"
        f"sink = DuckDBSink(Path({str(path)!r}), 'w')\n"
        "sink.open()\n"
        "for records in batches():\n"
        "    sink.write(deferred(*records))\n"
        "os._exit(9)  # killed: no close, no rebuild\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 9, done.stderr
    again = DuckDBSink(path, "w")
    again.open()
    try:
        assert [r[0] for r in rows(again, t.OUTPUTS)] == [RUNS[1]]  # the rebuild was lost
        again.write(flush())  # what the next replay's last batch does, having read nothing
        assert rows(again, t.OUTPUTS) == want
    finally:
        again.close()


def test_too_many_dirty_runs_are_rebuilt_even_by_a_deferring_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(duckdb_sink, "DIRTY_RUNS_MAX", 3)
    sink = DuckDBSink(tmp_path / "w.duckdb", "w")
    sink.open()
    try:
        sink.write(deferred(*(chunk(i, r, 0, "chunk", "a") for i, r in enumerate(RUNS[:2]))))
        assert rows(sink, t.OUTPUTS) == []
        sink.write(
            deferred(chunk(9, RUNS[2], 0, "chunk", "b"), chunk(10, uuid7(), 0, "chunk", "c"))
        )
        assert len(rows(sink, t.OUTPUTS)) == 4
        assert sink.conn.execute("SELECT count(*) FROM _dirty_runs").fetchone() == (0,)
    finally:
        sink.close()


def test_iceberg_and_parquet_rebuild_with_every_batch() -> None:
    from koda_runtime.topics.replay.sinks.iceberg import IcebergSink
    from koda_runtime.topics.replay.sinks.parquet import ParquetSink

    assert DuckDBSink.defer_outputs
    assert not ParquetSink.defer_outputs and not IcebergSink.defer_outputs
