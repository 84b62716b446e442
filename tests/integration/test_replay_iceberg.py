"""`koda replay --to iceberg://` against the real stack: the Iceberg tables equal the
DuckDB sink's; a job killed with SIGKILL between two tables of a batch, and again
between a batch's commit and its offsets, then run again, ends with the tables of a
clean replay and no duplicate key; DuckDB's iceberg extension reads the same tables;
`--follow` keeps the tables within seconds of the topics while runs are submitted.

One small stack serves the module: a worker, a few dozen runs (some retried, some
dead-lettered). The follow test comes last: it adds runs."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from pyiceberg.catalog.sql import SqlCatalog

from koda_runtime.lifecycle.chunks import visible_output
from koda_runtime.schemas.migrate import upgrade
from koda_runtime.settings import Settings
from koda_runtime.topics.admin import apply_topics
from koda_runtime.topics.replay import tables as t
from koda_runtime.topics.replay.sinks.iceberg import CATALOG_FILE, snapshot_offsets
from tests.fixtures.namespaces import delete_topics, drop_schema, make_settings
from tests.fixtures.processes import ROOT, WorkerProcess, settings_env
from tests.fixtures.runs import Submitter
from tests.integration.replay_stack import demo_input, duck_tables, normal
from tests.support import wait_until

# DuckDB 1.5.5 with its iceberg extension, installed by `make install` (see
# tests/fixtures/duckdb-iceberg-requirements.txt): koda's DuckDB has no such extension.
DUCKDB_ICEBERG = ROOT / ".venv" / "duckdb-iceberg"


@dataclass
class Stack:
    settings: Settings
    sub: Submitter
    worker: WorkerProcess
    tmp: Path
    runs: list[str]

    @property
    def env(self) -> dict[str, str]:
        return settings_env(self.settings)


@pytest.fixture(scope="module")
def stack_runs(stack: Any) -> Iterator[Stack]:
    settings = make_settings(stack, max_inflight=16)
    upgrade(settings)
    apply_topics(settings)
    tmp = Path(tempfile.mkdtemp(prefix="koda-iceberg-", dir="/tmp"))
    sub = Submitter(settings)
    worker = WorkerProcess(settings, "iw0").start()
    try:
        runs = [sub.submit(f"user-{i % 7}", demo_input("ice", i)) for i in range(40)]

        def all_ended() -> bool:
            worker.check()
            return sub.all_terminal(runs)

        wait_until(
            all_ended,
            timeout=120,
            interval=0.25,
            what="runs terminal",
        )
        yield Stack(settings, sub, worker, tmp, runs)
    finally:
        worker.stop()
        sub.close()
        delete_topics(settings)
        drop_schema(settings)
        shutil.rmtree(tmp, ignore_errors=True)


def replay(
    s: Stack, *args: str, fault: str | None = None, timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    env = s.env | ({"KODA_TEST_FAULT": fault} if fault else {})
    return subprocess.run(  # noqa: S603
        [sys.executable, "-m", "koda_runtime.cli", "replay", "--quiet", *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def catalog(directory: Path) -> SqlCatalog:
    return SqlCatalog(
        "koda", uri=f"sqlite:///{directory / CATALOG_FILE}", warehouse=directory.as_uri()
    )


def iceberg_tables(s: Stack, directory: Path) -> dict[str, list[tuple[Any, ...]]]:
    """Every table as pyiceberg reads it, rows normalised and sorted (as duck_tables)."""
    cat = catalog(directory)
    ns = s.settings.names.warehouse_schema()
    out = {}
    for table in t.TABLES:
        data = cat.load_table((ns, table.name)).scan().to_arrow().select(list(table.names))
        out[table.name] = sorted(normal(table, tuple(r.values())) for r in data.to_pylist())
    return out


def duplicate_keys(s: Stack, directory: Path) -> dict[str, int]:
    found = {}
    for table in t.TABLES:
        index = [table.names.index(k) for k in table.key]
        keys = [tuple(r[i] for i in index) for r in iceberg_tables(s, directory)[table.name]]
        if len(keys) != len(set(keys)):
            found[table.name] = len(keys) - len(set(keys))
    return found


def test_iceberg_equals_duckdb_and_a_job_killed_anywhere_resumes_to_the_same_tables(
    stack_runs: Stack,
) -> None:
    s = stack_runs
    duck = s.tmp / "reference.duckdb"
    done = replay(s, "--to", f"duckdb:///{duck}")
    assert done.returncode == 0, done.stderr
    reference = duck_tables(duck)
    clean = s.tmp / "clean"
    done = replay(s, "--to", f"iceberg:///{clean}")
    assert done.returncode == 0, done.stderr
    assert iceberg_tables(s, clean) == reference
    assert len(reference["outputs"]) == len(s.runs) and reference["dead_letters"]

    # A job in small batches, killed between two tables of its second batch, then
    # between its second batch's last table and the job's offsets, then run to the end.
    crashed = s.tmp / "crashed"
    job = ["--job", "iceberg-crash", "--batch", "40", "--to", f"iceberg:///{crashed}"]
    for fault in ("kill-between-iceberg-tables", "kill-after-iceberg-batch"):
        died = replay(s, *job, fault=fault)
        assert died.returncode == -signal.SIGKILL, (fault, died.returncode, died.stderr)
        assert f"test fault {fault}: SIGKILL" in died.stderr
        partial = iceberg_tables(s, crashed)
        assert partial != reference, f"{fault}: the job had finished before the kill"
    done = replay(s, *job)
    assert done.returncode == 0, done.stderr
    assert "resumed" in done.stdout, done.stdout
    assert iceberg_tables(s, crashed) == reference
    assert duplicate_keys(s, crashed) == {}

    # Each table's snapshot holds the offsets its last batch was cut at; the outputs'
    # (written by every batch with chunks) reach the chunk topic's end.
    cat = catalog(crashed)
    ns = s.settings.names.warehouse_schema()
    chunk_topic = s.settings.names.topic("run-chunks")
    stored = snapshot_offsets(cat.load_table((ns, "outputs")))
    assert any(topic == chunk_topic for topic, _ in stored), stored

    # DuckDB's own iceberg extension reads the same rows.
    assert duckdb_extension_rows(s, crashed) == {
        name: [[_text(v) for v in row] for row in rows] for name, rows in reference.items()
    }


def _text(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bytes):
        return value.hex()
    return str(value)


READER = """
import json, os, sys
import duckdb, duckdb_extension_avro, duckdb_extension_iceberg
def ext(module, name):
    return os.path.join(os.path.dirname(module.__file__), "extensions", "v" + duckdb.__version__,
                        name + ".duckdb_extension")
conn = duckdb.connect(config={"autoinstall_known_extensions": False,
                              "autoload_known_extensions": False})
conn.execute(f"LOAD '{ext(duckdb_extension_avro, 'avro')}'")
conn.execute(f"LOAD '{ext(duckdb_extension_iceberg, 'iceberg')}'")
conn.execute("SET TimeZone = 'UTC'")
def text(v):
    if v is None:
        return None
    return v.hex() if isinstance(v, (bytes, bytearray)) else str(v)
out = {}
for name, (metadata, columns) in json.loads(sys.argv[1]).items():
    rows = conn.execute(f"SELECT {columns} FROM iceberg_scan('{metadata}')").fetchall()
    out[name] = [[text(v) for v in row] for row in rows]
print(json.dumps(out))
"""


def duckdb_extension_rows(s: Stack, directory: Path) -> dict[str, list[list[str | None]]]:
    """Every table read by DuckDB 1.5.5's iceberg extension from its metadata file, in a
    subprocess (koda's own DuckDB cannot load that extension); rows as text, sorted the
    way the reference's are (by the normalised Python values)."""
    assert (DUCKDB_ICEBERG / ".installed").exists(), "run `make install` (DuckDB's iceberg reader)"
    cat = catalog(directory)
    ns = s.settings.names.warehouse_schema()
    where = {
        table.name: (cat.load_table((ns, table.name)).metadata_location, ", ".join(table.names))
        for table in t.TABLES
    }
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(DUCKDB_ICEBERG)
    done = subprocess.run(  # noqa: S603
        [sys.executable, "-c", READER, json.dumps(where)],
        env=env,
        cwd=str(directory),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    read = json.loads(done.stdout)
    out = {}
    for table in t.TABLES:
        pyrows = iceberg_tables(s, directory)[table.name]
        by_text = {tuple(_text(v) for v in r): r for r in pyrows}
        rows = [tuple(json_text(table, row)) for row in read[table.name]]
        assert len(rows) == len(pyrows), table.name
        out[table.name] = [list(r) for r in sorted(rows, key=lambda r: _sort_key(by_text, r))]
    return out


def json_text(table: t.Table, row: list[str | None]) -> list[str | None]:
    """JSON columns as the reference normalises them."""
    return [
        json.dumps(json.loads(v)) if c.type == "json" and v is not None else v
        for c, v in zip(table.columns, row, strict=True)
    ]


def _sort_key(by_text: dict[tuple[str | None, ...], tuple[Any, ...]], row: tuple[Any, ...]) -> Any:
    found = by_text.get(row)
    assert found is not None, f"DuckDB read a row pyiceberg did not: {row}"
    return found


def test_follow_keeps_the_tables_within_seconds_of_the_topics(stack_runs: Stack) -> None:
    s = stack_runs
    lake = s.tmp / "follow"
    proc = subprocess.Popen(  # noqa: S603
        [
            sys.executable,
            "-m",
            "koda_runtime.cli",
            "replay",
            "--quiet",
            "--follow",
            "--job",
            "iceberg-follow",
            "--to",
            f"iceberg:///{lake}",
        ],
        env=s.env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    ns = s.settings.names.warehouse_schema()

    def ended_outputs() -> dict[str, str]:
        assert proc.poll() is None, proc.communicate()[1]
        if not (lake / CATALOG_FILE).exists():
            return {}
        try:
            data = catalog(lake).load_table((ns, "outputs")).scan().to_arrow()
        except Exception:  # noqa: BLE001 - the tables are being made
            return {}
        return {r["run_id"]: r["output"] for r in data.to_pylist() if r["end_kind"] is not None}

    try:
        wait_until(lambda: set(s.runs) <= set(ended_outputs()), timeout=120, what="the backlog in")
        lags = []
        for i in range(6):
            run = s.sub.submit(f"follow-user-{i}", demo_input("follow", i % 4))

            def terminal_at(run: str = run) -> float | None:
                return time.monotonic() if s.sub.all_terminal([run]) else None

            def with_run(run: str = run) -> dict[str, str] | None:
                found = ended_outputs()
                return found if run in found else None

            ended = wait_until(terminal_at, timeout=60, interval=0.05, what="a run terminal")
            outputs = wait_until(with_run, timeout=60, interval=0.1, what="its output in Iceberg")
            lags.append(time.monotonic() - ended)
            messages = [(m.seq, m.kind, m.content) for m in s.sub.messages(run)]
            assert outputs[run] == visible_output(messages)
        print(f"iceberg --follow lag after a run ended: max {max(lags):.2f}s, lags {lags}")
        assert duplicate_keys(s, lake) == {}
    finally:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
