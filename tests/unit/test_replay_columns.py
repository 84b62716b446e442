"""A poll's chunk records decoded at once, and the outputs rows rebuilt in DuckDB: both
must leave exactly the rows of the per-record path, bad records included."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import date
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from koda_runtime.lifecycle.chunks import ChunkKind
from koda_runtime.lifecycle.ids import uuid7
from koda_runtime.topics.replay import tables as t
from koda_runtime.topics.replay.rows import RecordDecoder, RowBatch, chunk_columns
from koda_runtime.topics.replay.sinks.base import SqlSink
from koda_runtime.topics.replay.sinks.duckdb import DuckDBSink
from tests.unit.replay_records import NAMES, PRICES, FakeMessage, chunk, final, tombstone


def one_by_one(msgs: list[FakeMessage]) -> RowBatch:
    batch, decoder = RowBatch(), RecordDecoder(NAMES, PRICES)
    for m in msgs:
        decoder.add(m, batch)
    return batch


def at_once(msgs: list[FakeMessage]) -> RowBatch:
    batch = RowBatch()
    RecordDecoder(NAMES, PRICES).add_many(msgs, batch)
    return batch


def same(a: RowBatch, b: RowBatch) -> bool:
    return (a.rows, a.chunk_runs, a.final_runs, a.records, a.tombstones, a.raw) == (
        b.rows,
        b.chunk_runs,
        b.final_runs,
        b.records,
        b.tombstones,
        b.raw,
    )


def clean_poll() -> list[FakeMessage]:
    runs = [uuid7(), uuid7(), "not-a-uuid7"]  # the last one takes its day from the record
    msgs = [chunk(i, runs[i % 3], i // 3, "chunk", f"t{i} ") for i in range(9)]
    msgs.append(chunk(9, runs[0], 1, "reset", "{}"))  # a key seen before: the later one wins
    msgs[2].ts = 86_400_000
    msgs[4].headers_, msgs[5].headers_ = None, []  # no schema header: nothing to check
    return msgs


def with_value(m: FakeMessage, value: bytes | None) -> FakeMessage:
    return replace(m, value_=value)


def rewrite(m: FakeMessage, **fields: Any) -> FakeMessage:
    obj = json.loads(m.value_ or b"")
    return with_value(m, json.dumps({**obj, **fields}).encode())


def without(m: FakeMessage, name: str) -> FakeMessage:
    obj = json.loads(m.value_ or b"")
    del obj[name]
    return with_value(m, json.dumps(obj).encode())


def test_a_clean_poll_is_decoded_at_once_into_the_per_record_rows() -> None:
    msgs = clean_poll()
    assert chunk_columns(msgs) is not None
    assert same(at_once(msgs), one_by_one(msgs))


def spoilers(m: FakeMessage, run: str) -> dict[str, FakeMessage]:
    value = m.value_ or b""
    return {
        "tombstone": tombstone(m.offset_, run, 0),
        "final": final(m.offset_, run, 3, "done", "x"),
        "other schema": replace(m, headers_=[("schema", b"run.chunk/2")]),
        "schema not first": replace(m, headers_=[("x", b"1"), ("schema", b"run.chunk/1")]),
        "not utf-8": with_value(m, b"\xff" + value),
        "bom": with_value(m, "\ufeff".encode() + value),
        "whitespace around": with_value(m, b" " + value + b"\n"),
        "two objects": with_value(m, value + b"," + value),
        "not an object": with_value(m, b"[1, 2]"),
        "null": with_value(m, b"null"),
        "seq a string": rewrite(m, seq="0"),
        "seq a bool": rewrite(m, seq=True),
        "seq a float": rewrite(m, seq=0.0),
        "seq negative": rewrite(m, seq=-1),
        "attempt null": rewrite(m, attempt=None),
        "run_id empty": rewrite(m, run_id=""),
        "content missing": without(m, "content"),
        "key of another seq": rewrite(m, seq=7),
        "key of another run": replace(m, key_=f"{uuid7()}:0000000000".encode()),
        "no key": replace(m, key_=None),
        "seq too wide": replace(rewrite(m, seq=10**10), key_=f"{run}:{10**10}".encode()),
        "lone surrogate": with_value(m, value.replace(run.encode(), b"\\ud800")),
    }


def test_any_record_the_per_record_path_would_treat_otherwise_sends_the_poll_through_it() -> None:
    run = uuid7()
    base = chunk(3, run, 0, "chunk", "x")
    for what, bad in spoilers(base, run).items():
        msgs = [*clean_poll(), bad, chunk(11, run, 1, "chunk", "y")]
        assert chunk_columns(msgs) is None, what
        assert same(at_once(msgs), one_by_one(msgs)), what


def test_values_that_only_parse_when_joined_are_each_bad() -> None:
    """Three bad values that a single parse of "[v1,v2,v3]" would read as three objects."""
    run = uuid7()
    good = [chunk(i, run, i, "chunk", ",") for i in range(3)]
    text = [(m.value_ or b"").decode() for m in good]
    cut = text[0].index('"content":"') + len('"content":"')  # the content "," starts here
    parts = [text[0][:cut], text[0][cut + 1 :], f"{text[1]},{text[2]}"]
    msgs = [with_value(m, p.encode()) for m, p in zip(good, parts, strict=True)]
    assert json.loads("[" + ",".join(parts) + "]")[0]["content"] == ","
    assert chunk_columns(msgs) is None
    assert same(at_once(msgs), one_by_one(msgs))
    assert one_by_one(msgs).raw["undecodable"] == 3


EVENT = st.tuples(
    st.integers(0, 12),
    st.sampled_from([k.value for k in ChunkKind]),
    st.text(alphabet="ab ,'\"", max_size=3),
)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(EVENT, max_size=10, unique_by=lambda e: e[0]), min_size=1, max_size=4))
def test_outputs_rebuilt_in_duckdb_equal_output_row(runs: list[list[tuple[int, str, str]]]) -> None:
    """Holes, resets, several terminal events, runs with no chunks at all."""
    sink = DuckDBSink(Path(":memory:"), "duckdb://:memory:")
    sink.open()
    try:
        ids = [f"r{i}" for i in range(len(runs))]
        stored = [
            (r, s, None, k, c, 1) for r, evs in zip(ids, runs, strict=True) for s, k, c in evs
        ]
        if stored:
            sink.upsert(t.CHUNKS, stored)
        days = dict.fromkeys(ids, date(2025, 1, 1))
        assert sink.rebuild_outputs(ids, days) == SqlSink.rebuild_outputs(sink, ids, days)
    finally:
        sink.close()
