"""`koda replay` against the real stack: the warehouse equals Postgres, replays are
idempotent and resumable, `--from-timestamp` selects, every sink holds the same tables,
real records match the JSON Schemas, and a fixed dead letter replays into one run.

One populated stack serves the module (tests/integration/replay_stack.py). The dead-letter
test comes last: it is the only one that adds records to the topics."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import jsonschema
import psycopg
import pyarrow.dataset as ds
import pytest
from confluent_kafka import Consumer, TopicPartition
from sqlalchemy import text

from koda_runtime.kafka import consumer_config
from koda_runtime.topics.catalogue import (
    RUN_CHUNKS,
    RUN_EVENTS,
    RUNS,
    RUNS_DLQ,
    WORKER_GROUP,
    WORKERS,
    partition_for_key,
)
from koda_runtime.topics.records import formats as record_specs
from koda_runtime.topics.records.codec import header_value
from koda_runtime.topics.records.json_schemas import DIRECTORY, file_name
from koda_runtime.topics.replay import tables as t
from tests.fixtures.processes import ROOT
from tests.fixtures.runs import committed_offsets, read_topic
from tests.integration.replay_stack import (
    END_KIND,
    Populated,
    duck_tables,
    koda,
    normal,
    populate,
    postgres_truth,
)
from tests.support import wait_until

REPLAYED = (RUNS, RUN_EVENTS, RUN_CHUNKS, RUNS_DLQ)


@pytest.fixture(scope="module")
def populated(stack: Any) -> Iterator[Populated]:
    yield from populate(stack)


@pytest.fixture(scope="module")
def reference(populated: Populated) -> dict[str, list[tuple[Any, ...]]]:
    """A one-shot replay of everything into DuckDB: the tables every other replay must equal."""
    path = populated.tmp / "reference.duckdb"
    koda(populated, "replay", "--quiet", "--to", f"duckdb:///{path}")
    return duck_tables(path)


def as_dicts(rows: list[tuple[Any, ...]], table: t.Table) -> list[dict[str, Any]]:
    return [dict(zip(table.names, r, strict=True)) for r in rows]


def test_a_replay_into_duckdb_matches_postgres_and_a_second_changes_nothing(
    populated: Populated, reference: dict[str, list[tuple[Any, ...]]]
) -> None:
    p = populated
    truth = postgres_truth(p)
    runs = {r["run_id"]: r for r in as_dicts(reference["runs"], t.RUNS)}
    fixable, _ = p.fixable
    # Every Postgres run, plus the trigger of the one run Postgres does not have.
    assert set(runs) == set(truth["runs"]) | {fixable}
    assert runs[fixable]["status"] == "pending" and fixable not in truth["runs"]
    for run_id, (status, attempt, created_at) in truth["runs"].items():
        assert (runs[run_id]["status"], runs[run_id]["attempt"]) == (status, attempt), run_id
        if run_id in p.via_gateway:
            assert runs[run_id]["created_at"] == created_at
    statuses = {s for s, _, _ in truth["runs"].values()}
    assert statuses == {"done", "failed"}, statuses

    outputs = {o["run_id"]: o for o in as_dicts(reference["outputs"], t.OUTPUTS)}
    assert set(outputs) == set(truth["outputs"])
    for run_id, answer in truth["outputs"].items():
        out = outputs[run_id]
        assert out["output"] == answer, run_id
        assert out["end_kind"] == END_KIND[truth["runs"][run_id][0]]
        assert out["compacted"] is (run_id in p.compacted)
    assert any("reset" in {c[3] for c in reference["chunks"] if c[0] == r} for r in outputs)

    usage = {
        (u["run_id"], u["call_index"]): (
            u["model"],
            u["prompt_tokens"],
            u["completion_tokens"],
            u["cost_usd"],
        )
        for u in as_dicts(reference["usage"], t.USAGE)
    }
    assert usage == truth["usage"] and len(usage) > 200
    assert all(cost > 0 for *_, cost in usage.values())  # Decimal, priced like Postgres
    # Every ledger column of every attempt's calls, failed attempts included.
    ledger = {
        (c["run_id"], c["attempt"], c["call_index"]): (
            c["user_id"],
            c["model"],
            c["kind"],
            c["prompt_tokens"],
            c["completion_tokens"],
            c["cost_usd"],
            c["price_id"],
            c["outcome"],
            c["estimated"],
        )
        for c in as_dicts(reference["ledger"], t.LEDGER)
    }
    assert ledger == truth["ledger"] and len(ledger) > len(usage)
    assert {v[7] for v in ledger.values()} == {"ok", "failed"}

    letters = [
        json.loads(m.value()) for m in read_topic(p.settings, p.settings.names.topic(RUNS_DLQ))
    ]
    stored = as_dicts(reference["dead_letters"], t.DEAD_LETTERS)
    assert sorted(d["reason"] for d in stored) == sorted(x["reason"] for x in letters)
    assert {d["run_id"] for d in stored if d["reason"] == "handler_failed"} == {
        r for r, (s, _, _) in truth["runs"].items() if s == "failed"
    }
    raw = {r["reason"] for r in as_dicts(reference["raw_records"], t.RAW_RECORDS)}
    assert raw == {"undecodable", "unknown_schema_version"}

    again = p.tmp / "reference.duckdb"
    done = koda(p, "replay", "--quiet", "--to", f"duckdb:///{again}")
    assert "replayed" in done.stdout and "kept raw in raw_records: 2" in done.stdout
    assert duck_tables(again) == reference


def test_dry_run_counts_and_writes_nothing(populated: Populated) -> None:
    path = populated.tmp / "dry.duckdb"
    done = koda(populated, "replay", "--dry-run", "--quiet", "--to", f"duckdb:///{path}")
    assert done.stdout.startswith("counted ") and not path.exists()
    total = int(done.stdout.split()[1].replace(",", ""))
    assert total > 1000
    for topic in REPLAYED:
        assert populated.settings.names.topic(topic) in done.stdout


def test_postgres_and_parquet_hold_the_same_tables_even_from_overlapping_replays(
    populated: Populated, reference: dict[str, list[tuple[Any, ...]]]
) -> None:
    p = populated
    url = p.settings.database_url
    argv = [
        sys.executable,
        "-m",
        "koda_runtime.cli",
        "replay",
        "--quiet",
        "--batch",
        "300",
        "--to",
        url,
    ]
    both = [
        subprocess.Popen(argv, env=p.env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # noqa: S603
        for _ in range(2)
    ]
    for proc in both:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err.decode()
    schema = p.settings.names.warehouse_schema()
    with psycopg.connect(url) as conn:
        for table in t.TABLES:
            rows = conn.execute(
                f'SELECT {", ".join(table.names)} FROM "{schema}".{table.name}'  # noqa: S608
            ).fetchall()
            assert sorted(normal(table, r) for r in rows) == reference[table.name], table.name

    lake = p.tmp / "lake"
    koda(p, "replay", "--quiet", "--to", f"parquet:///{lake}")
    for table in t.TABLES:
        if not (lake / table.name).exists():  # a table without rows has no files
            assert reference[table.name] == [], table.name
            continue
        data = ds.dataset(lake / table.name, format="parquet", partitioning="hive").to_table()
        names = [n for n in table.names if n != "day"]
        rows = [tuple(r[n] for n in names) for r in data.to_pylist()]
        expected = [
            tuple(v for n, v in zip(table.names, r, strict=True) if n != "day")
            for r in reference[table.name]
        ]
        assert sorted(normal(_without_day(table), r) for r in rows) == sorted(expected), table.name


def _without_day(table: t.Table) -> t.Table:
    return t.Table(table.name, tuple(c for c in table.columns if c.name != "day"))


def test_a_job_killed_half_way_resumes_to_the_same_tables(
    populated: Populated, reference: dict[str, list[tuple[Any, ...]]]
) -> None:
    p = populated
    path = p.tmp / "job.duckdb"
    group = p.settings.names.replay_group("nightly")
    topics = [p.settings.names.topic(b) for b in REPLAYED]
    total = backlog(p, topics)
    args = ["replay", "--job", "nightly", "--to", f"duckdb:///{path}", "--batch", "100"]
    proc = subprocess.Popen(  # noqa: S603
        [sys.executable, "-m", "koda_runtime.cli", *args, "--max-rate", "1500"],
        env=p.env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )

    def committed() -> int:
        return sum(
            max(0, o) for x in topics for o in committed_offsets(p.settings, group, x).values()
        )

    try:
        wait_until(lambda: committed() >= total // 4, timeout=60, interval=0.1, what="a quarter")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=30)
    before = committed()
    assert 0 < before < total, f"the job was not killed half-way ({before} of {total})"

    done = koda(p, "replay", "--quiet", *args[1:])
    assert "resumed" in done.stdout, done.stdout
    read_again = int(done.stdout.split()[1].replace(",", ""))
    assert read_again < total
    assert duck_tables(path) == reference
    # Finished: the same job again reads nothing and changes nothing.
    idle = koda(p, "replay", "--quiet", *args[1:])
    assert idle.stdout.startswith("replayed 0 records")
    assert duck_tables(path) == reference


def test_from_timestamp_replays_only_what_came_after(populated: Populated) -> None:
    p = populated
    path = p.tmp / "subset.duckdb"
    when = datetime.fromtimestamp(p.boundary_ms / 1000, UTC).isoformat()
    koda(p, "replay", "--quiet", "--to", f"duckdb:///{path}", "--from-timestamp", when)
    tables = duck_tables(path)
    wave_b, allowed = set(p.wave_b), set(p.wave_b) | p.late
    assert wave_b <= {r[0] for r in tables["runs"]} <= allowed
    for name in ("outputs", "chunks", "usage"):
        assert {r[0] for r in tables[name]} <= allowed and tables[name], name
    transitions = as_dicts(tables["run_transitions"], t.RUN_TRANSITIONS)
    assert {r["run_id"] for r in transitions} <= allowed
    letters = as_dicts(tables["dead_letters"], t.DEAD_LETTERS)
    assert {d["run_id"] for d in letters} <= allowed and not tables["raw_records"]

    future = p.tmp / "future.duckdb"
    done = koda(
        p, "replay", "--quiet", "--to", f"duckdb:///{future}", "--from-timestamp", "2999-01-01"
    )
    assert done.stdout.startswith("replayed 0 records")


def test_real_records_validate_against_the_json_schemas(populated: Populated) -> None:
    p = populated
    validators = {
        s.header: jsonschema.Draft202012Validator(
            json.loads((DIRECTORY / file_name(s)).read_text())
        )
        for s in record_specs.ALL
    }
    seen: set[str] = set()
    unlabelled = 0
    for base in (*REPLAYED, WORKERS):
        for msg in read_topic(p.settings, p.settings.names.topic(base)):
            header = header_value(msg.headers(), "schema")
            if msg.value() is None:
                continue  # tombstones: no value to validate
            if header is None:
                unlabelled += 1
                continue
            name = header.decode()
            if name == "run.requested/9":
                continue  # the poison from a "future" producer
            obj = json.loads(msg.value())
            if name == "run.event/1":
                name += f" {obj['event']}"
            errors = [e.message for e in validators[name.split(" ")[0]].iter_errors(obj)]
            assert errors == [], (base, name, obj, errors)
            seen.add(name)
    assert unlabelled == p.poison_without_header
    assert seen == {
        "run.requested/1",
        "run.chunk/1",
        "run.final/1",
        "run.event/1 transition",
        "run.event/1 usage",
        "run.dead-letter/1",
        "worker.heartbeat/1",
    }


def test_the_replay_never_touched_kodas_groups_or_tables(populated: Populated) -> None:
    p = populated
    tables = {
        r.table_name
        for r in p.sub.query(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = :s",
            s=p.settings.names.pg_schema(),
        )
    }
    # runs, usage, ledger, run_merges, schedules and memories are koda's own tables too
    # (the warehouse mirrors them).
    mirrored = ("runs", "usage", "ledger", "run_merges", "schedules", "memories")
    assert not {x.name for x in t.TABLES if x.name not in mirrored} & tables
    workers = committed_offsets(
        p.settings, p.settings.names.group(WORKER_GROUP), p.settings.names.topic(RUNS)
    )
    assert sum(max(0, o) for o in workers.values()) > 0  # the workers' own progress only
    one_shot = p.settings.names.group("replay-reader")
    assert all(
        o < 0
        for o in committed_offsets(p.settings, one_shot, p.settings.names.topic(RUNS)).values()
    )


def backlog(p: Populated, topics: list[str]) -> int:
    """Offsets from each partition's start to its end, over ``topics``."""
    consumer = Consumer(consumer_config(p.settings, "test-backlog", None) | {"group.id": "unused"})
    try:
        total = 0
        for topic in topics:
            meta = consumer.list_topics(topic, timeout=10).topics[topic]
            for part in meta.partitions:
                low, high = consumer.get_watermark_offsets(TopicPartition(topic, part), timeout=10)
                total += high - low
        return total
    finally:
        consumer.close()


def test_dlq_list_show_and_replay_of_a_fixed_poison_record_runs_once(populated: Populated) -> None:
    """A trigger for a run Postgres did not have was dead-lettered (unknown_run). Once the
    run's row exists, replaying the letter runs it; replaying it again runs nothing."""
    p = populated
    run_id, user = p.fixable
    listed = koda(p, "dlq", "list", "--reason", "unknown_run")
    lines = [line for line in listed.stdout.splitlines() if run_id in line]
    assert len(lines) == 1, listed.stdout
    letter_id = lines[0].split()[0]
    shown = koda(p, "dlq", "show", letter_id).stdout
    assert "reason:    unknown_run" in shown and f'"run_id": "{run_id}"' in shown
    assert "schema: run.requested/1" in shown and f"key:       {user}" in shown

    with p.sub.engine.begin() as conn:
        conn.execute(
            text("INSERT INTO sessions (id, user_id) VALUES (:s, :u) ON CONFLICT DO NOTHING"),
            {"s": f"s-{user}", "u": user},
        )
        conn.execute(
            text(
                "INSERT INTO runs (id, session_id, user_id, idempotency_key, input, partition)"
                " VALUES (:id, :s, :u, :k, CAST(:inp AS jsonb), :p)"
            ),
            {
                "id": run_id,
                "s": f"s-{user}",
                "u": user,
                "k": f"fixed:{run_id}",
                "inp": json.dumps({"text": "fixed", "demo": {"tokens": 4, "delay_ms": 0}}),
                "p": partition_for_key(user.encode(), p.settings.partitions),
            },
        )
    p.late.add(run_id)
    first = koda(p, "dlq", "replay", letter_id)
    assert "replayed 1 of 1 dead letters" in first.stdout, first.stdout
    wait_until(lambda: p.sub.statuses([run_id]).get(run_id) == "done", what="the fixed run done")
    messages = p.sub.messages(run_id)
    assert [m.content for m in messages if m.kind == "chunk"]

    second = koda(p, "dlq", "replay", letter_id)
    assert "replayed 1 of 1 dead letters" in second.stdout
    runs_topic = p.settings.names.topic(RUNS)
    part = partition_for_key(user.encode(), p.settings.partitions)
    end = backlog_end(p, runs_topic, part)
    workers = p.settings.names.group(WORKER_GROUP)
    wait_until(
        lambda: committed_offsets(p.settings, workers, runs_topic).get(part, -1) >= end,
        timeout=60,
        what="the workers past the second copy",
    )
    (row,) = p.sub.query("SELECT status, attempt FROM runs WHERE id = :r", r=run_id)
    assert (row.status, row.attempt) == ("done", 1)
    assert p.sub.messages(run_id) == messages
    claims = [
        e
        for e in (
            json.loads(m.value())
            for m in read_topic(p.settings, p.settings.names.topic(RUN_EVENTS))
        )
        if e["run_id"] == run_id and e.get("to") == "running"
    ]
    assert len(claims) == 1, claims


def backlog_end(p: Populated, topic: str, partition: int) -> int:
    consumer = Consumer(consumer_config(p.settings, "test-backlog", None) | {"group.id": "unused"})
    try:
        return consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=10)[1]
    finally:
        consumer.close()
