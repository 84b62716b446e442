"""Records into warehouse rows, and the upsert rules that make replays idempotent."""

from __future__ import annotations

import itertools
import json
from datetime import UTC, date, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from koda_runtime.lifecycle.ids import uuid7
from koda_runtime.topics.replay import tables as t
from koda_runtime.topics.replay.prices import Price, PriceBook
from koda_runtime.topics.replay.rows import RowBatch, run_day
from koda_runtime.topics.replay.sinks.duckdb import DuckDBSink
from tests.unit.replay_records import (
    AT,
    chunk,
    decode,
    event,
    final,
    letter,
    requested,
    tombstone,
    transition,
    usage,
)


def rows(batch: RowBatch, table: t.Table) -> list[dict[str, Any]]:
    return [dict(zip(table.names, r, strict=True)) for r in batch.sorted_rows(table)]


def test_a_run_takes_its_latest_state_and_a_terminal_state_sticks() -> None:
    run = uuid7()
    batch = decode(
        requested(0, run, "alice", "2025-11-24T09:59:00+00:00"),
        transition(3, run, "running", 1, "2025-11-24T10:00:00Z", worker="w1"),
        transition(4, run, "running", 2, "2025-11-24T10:00:01Z", worker="w2"),
        transition(6, run, "done", 2, "2025-11-24T10:00:02Z"),
        # A frozen worker's late claim event: terminal states have no outgoing edge.
        transition(9, run, "running", 3, "2025-11-24T10:00:09Z", worker="w3"),
    )
    (row,) = rows(batch, t.RUNS)
    assert (row["status"], row["attempt"], row["user_id"]) == ("done", 2, "alice")
    assert row["worker_id"] == "w3"  # the last claim's worker, whatever came after it
    assert row["started_at"] == datetime(2025, 11, 24, 10, 0, tzinfo=UTC)
    assert row["finished_at"] == datetime(2025, 11, 24, 10, 0, 2, tzinfo=UTC)
    assert row["created_at"] == datetime(2025, 11, 24, 9, 59, tzinfo=UTC)
    assert row["day"] == run_day(run, date(1970, 1, 1)) == datetime.now(UTC).date()
    assert len(rows(batch, t.RUN_TRANSITIONS)) == 4


def test_usage_is_priced_in_decimal_like_postgres() -> None:
    run = uuid7()
    batch = decode(usage(1, run, 0, 2, 5, AT), usage(2, run, 1, 7, 0, AT, cost_usd="1.25"))
    first, second = rows(batch, t.USAGE)
    assert first["cost_usd"] == Decimal("0.00000330") and first["cost_source"] == "price_table"
    assert second["cost_usd"] == Decimal("1.25") and second["cost_source"] == "record"
    unpriced = rows(decode(usage(1, run, 0, 2, 5, AT), prices=PriceBook(loaded=False)), t.USAGE)
    assert (unpriced[0]["cost_usd"], unpriced[0]["cost_source"]) == (None, None)
    before = PriceBook(
        {"demo-1": [Price(datetime(2030, 1, 1, tzinfo=UTC), Decimal(1), Decimal(1))]}
    )
    assert rows(decode(usage(1, run, 0, 2, 5, AT), prices=before), t.USAGE)[0]["cost_usd"] == 0


def test_usage_records_carry_the_ledger_columns_and_every_attempt() -> None:
    run = uuid7()
    ledger = {"user_id": "u1", "kind": "chat", "price_id": 4}
    batch = decode(
        usage(
            1,
            run,
            0,
            3,
            3,
            AT,
            cost_usd="0.1",
            attempt=1,
            outcome="failed",
            estimated=True,
            **ledger,
        ),
        usage(
            2, run, 0, 3, 6, AT, cost_usd="0.2", attempt=2, outcome="ok", estimated=False, **ledger
        ),
        usage(
            3,
            run,
            1,
            9,
            0,
            AT,
            cost_usd="0",
            kind="embedding",
            attempt=2,
            outcome="ok",
            user_id="u1",
            price_id=None,
        ),
    )
    got = [
        (r["attempt"], r["call_index"], r["outcome"], r["estimated"], r["kind"], r["price_id"])
        for r in rows(batch, t.LEDGER)
    ]
    assert got == [
        (1, 0, "failed", True, "chat", 4),
        (2, 0, "ok", False, "chat", 4),
        (2, 1, "ok", False, "embedding", None),
    ]
    assert {r["user_id"] for r in rows(batch, t.LEDGER)} == {"u1"}
    # usage keeps the finishing attempt's calls only: the failed one does not overwrite them.
    assert [(r["call_index"], r["cost_usd"]) for r in rows(batch, t.USAGE)] == [
        (0, Decimal("0.2")),
        (1, Decimal("0")),
    ]
    # An older worker's record: attempt unknown (0), ok, priced from the table.
    (old,) = rows(decode(usage(1, run, 0, 2, 5, AT)), t.LEDGER)
    assert (old["attempt"], old["outcome"], old["estimated"], old["user_id"]) == (
        0,
        "ok",
        False,
        None,
    )
    assert old["cost_usd"] == Decimal("0.00000330") and old["cost_source"] == "price_table"


def test_chunks_finals_and_tombstones() -> None:
    run = uuid7()
    batch = decode(
        chunk(0, run, 0, "chunk", "a "),
        chunk(1, run, 1, "reset", "{}"),
        chunk(2, run, 2, "chunk", "b"),
        chunk(3, run, 3, "done", "{}"),
        final(4, run, 3, "done", "b"),
        tombstone(5, run, 0),
        tombstone(6, run, 1),
        tombstone(7, run, None),
    )
    assert len(rows(batch, t.CHUNKS)) == 4  # tombstones delete nothing in the warehouse
    (out,) = rows(batch, t.OUTPUTS)
    assert (out["output"], out["end_kind"], out["compacted"]) == ("b", "done", True)
    assert batch.tombstones == 3 and run in batch.final_runs and run in batch.chunk_runs


def test_what_does_not_decode_is_kept_raw_with_its_reason() -> None:
    run = uuid7()
    future = transition(1, run, "done", 1, AT)
    future.headers_ = [("schema", b"run.event/2")]
    garbage = requested(2, run, "bob")
    garbage.value_ = b"\xff not json"
    bad_key = chunk(3, run, 0, "chunk", "x")
    bad_key.key_ = b"no-seq-here"
    other = event(4, run, AT, event="teleport")
    batch = decode(future, garbage, bad_key, other, letter(5, run, "bob", "unknown_run"))
    reasons = {r["reason"]: r for r in rows(batch, t.RAW_RECORDS)}
    assert set(reasons) == {"unknown_schema_version", "undecodable", "bad_key", "unknown_event"}
    assert reasons["unknown_schema_version"]["schema_header"] == "run.event/2"
    assert reasons["undecodable"]["record_value"] == b"\xff not json"
    assert batch.raw["bad_key"] == 1
    (dl,) = rows(batch, t.DEAD_LETTERS)
    assert (dl["reason"], dl["run_id"], dl["original_offset"]) == ("unknown_run", run, 9)
    assert json.loads(dl["original_headers"])[0][0] == "schema"


def test_run_day_comes_from_the_uuid7_else_the_fallback() -> None:
    assert run_day("not-a-uuid", date(2020, 2, 2)) == date(2020, 2, 2)
    assert run_day("6ba7b810-9dad-11d1-80b4-00c04fd430c8", date(2020, 2, 2)) == date(2020, 2, 2)


RUN = "r-merge"
# (status, order) pairs a run's rows can carry; None orders never win.
state = st.tuples(
    st.sampled_from(["pending", "running", "done", "failed"]),
    st.one_of(st.none(), st.integers(-1, 2**62 + 50)),
    st.one_of(st.none(), st.sampled_from(["w1", "w2"])),
    st.one_of(st.none(), st.integers(0, 50)),
    st.one_of(
        st.none(),
        st.datetimes(
            timezones=st.just(UTC), min_value=datetime(2020, 1, 1), max_value=datetime(2030, 1, 1)
        ),
    ),
    st.one_of(st.none(), st.sampled_from(["alice", "bob"])),
)


def runs_row(s: tuple[Any, ...]) -> tuple[Any, ...]:
    status, order, worker, claim, when, user = s
    schedule = None if user is None else f"sched-{user}"
    row = (RUN, date(2025, 1, 1), user, None, None, status, 1, when, when, worker, order, claim)
    return (*row, schedule, when)


@settings(max_examples=60, deadline=None)
@given(st.lists(state, min_size=1, max_size=6))
def test_python_merge_equals_the_sql_upsert(states: list[tuple[Any, ...]]) -> None:
    """The in-batch merge (Python) and the sinks' ON CONFLICT (SQL) agree, row by row."""
    merged = runs_row(states[0])
    for s in states[1:]:
        merged = t.RUNS.merge(merged, runs_row(s))
    sink = DuckDBSink(Path(":memory:"), "duckdb://:memory:")
    sink.open()
    try:
        for s in states:
            with sink.transaction():
                sink.upsert(t.RUNS, [runs_row(s)])
        (stored,) = sink.conn.execute("SELECT * FROM runs").fetchall()
    finally:
        sink.close()
    assert stored == merged


def test_the_merge_rules_do_not_depend_on_order() -> None:
    run = uuid7()
    records = [
        requested(0, run, "alice"),
        transition(3, run, "running", 1, AT, worker="w1"),
        transition(5, run, "running", 2, AT, worker="w2"),
        transition(8, run, "failed", 2, AT),
    ]
    outcomes = {
        tuple(rows(decode(*order), t.RUNS)[0].items()) for order in itertools.permutations(records)
    }
    assert len(outcomes) == 1
    (only,) = outcomes
    assert dict(only)["status"] == "failed" and dict(only)["worker_id"] == "w2"


def test_a_run_with_a_hole_below_its_terminal_event_has_not_ended_in_the_warehouse() -> None:
    """A worker killed between its Postgres commit and its produce leaves a hole that is
    filled later, maybe after the terminal event: until then the run must not look done."""
    run = uuid7()
    sink = DuckDBSink(Path(":memory:"), "duckdb://:memory:")
    sink.open()
    try:
        sink.write(decode(chunk(0, run, 0, "chunk", "a "), chunk(1, run, 2, "done", "{}")))
        (row,) = sink.conn.execute("SELECT output, end_kind, last_seq FROM outputs").fetchall()
        assert row == ("a ", None, 2)
        sink.write(decode(chunk(2, run, 1, "chunk", "b ")))  # the hole, filled late
        (row,) = sink.conn.execute("SELECT output, end_kind, last_seq FROM outputs").fetchall()
        assert row == ("a b ", "done", 2)
    finally:
        sink.close()


def test_a_merged_rerun_and_a_cancel_keep_their_reason() -> None:
    run = uuid7()
    batch = decode(
        transition(1, run, "running", 1, AT, worker="w1"),
        transition(2, run, "running", 2, AT, worker="w1", reason="merged", input_version=1),
        transition(3, run, "cancelled", 2, AT, reason="changed my mind"),
    )
    reasons = [(r["status"], r["reason"]) for r in rows(batch, t.RUN_TRANSITIONS)]
    assert reasons == [("running", None), ("running", "merged"), ("cancelled", "changed my mind")]
