"""Chunk polls decoded by DuckDB (topics/replay/chunk_polls.py) must leave exactly the
rows of the per-record path, or hand the poll back to it; and a DuckDB sink must store
the same rows from Arrow parts as from tuples."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from koda_runtime.lifecycle.ids import uuid7
from koda_runtime.topics.records.codec import chunk_value
from koda_runtime.topics.replay import tables as t
from koda_runtime.topics.replay.chunk_polls import ChunkPolls
from koda_runtime.topics.replay.rows import RecordDecoder, RowBatch, plain_chunk_poll
from koda_runtime.topics.replay.sinks.base import SqlSink
from koda_runtime.topics.replay.sinks.duckdb import DuckDBSink
from tests.unit.replay_records import NAMES, PRICES, FakeMessage, chunk, final
from tests.unit.test_replay_columns import clean_poll, one_by_one, same, spoilers, with_value


@pytest.fixture(scope="module")
def polls() -> Any:
    p = ChunkPolls()
    yield p
    p.close()


def in_duckdb(*polls_: list[FakeMessage]) -> RowBatch:
    """The polls through a decoder that decodes chunk polls in DuckDB."""
    batch, decoder = RowBatch(), RecordDecoder(NAMES, PRICES, arrow_chunks=True)
    try:
        for msgs in polls_:
            decoder.add_many(msgs, batch)
    finally:
        decoder.close()
    return batch


def folded(batch: RowBatch) -> RowBatch:
    batch.rows_of(t.CHUNKS)  # the Arrow parts into the tuples the per-record path keeps
    return batch


def test_a_clean_poll_is_decoded_in_duckdb_into_the_per_record_rows(polls: ChunkPolls) -> None:
    msgs = [m for m in clean_poll() if b"not-a-uuid7" not in (m.key_ or b"")]
    assert polls.decode(msgs) is not None  # a key seen twice, records without headers
    batch = in_duckdb(msgs)
    assert len(batch.chunk_parts) == 1 and not batch.rows[t.CHUNKS.name]
    assert same(folded(batch), one_by_one(msgs))


def test_an_uppercase_uuid7_and_unicode_content_stay_on_the_fast_path(polls: ChunkPolls) -> None:
    run = uuid7().upper()
    msgs = [chunk(i, run, i, "chunk", text) for i, text in enumerate(["é😀", "\u2028", '"\\/'])]
    assert polls.decode(msgs) is not None
    assert same(folded(in_duckdb(msgs)), one_by_one(msgs))


def lenient(m: FakeMessage, run: str) -> dict[str, FakeMessage]:
    """Values DuckDB's JSON reader takes and Python's refuses or reads otherwise, and
    values that are valid but not what chunk_value writes."""
    text = (m.value_ or b"").decode()
    obj = json.loads(text)
    return {
        "trailing comma": with_value(m, (text[:-1] + ",}").encode()),
        "NaN attempt": with_value(m, text.replace('"attempt":1', '"attempt":NaN').encode()),
        "run_id twice": with_value(m, ('{"run_id":"other",' + text[1:]).encode()),
        "an extra field": with_value(m, (text[:-1] + ',"x":1}').encode()),
        "fields reordered": with_value(m, json.dumps(dict(reversed(obj.items()))).encode()),
        "spaces": with_value(m, json.dumps(obj).encode()),
        "ascii escapes": with_value(m, json.dumps({**obj, "content": "é"}).encode()),
        "control character": with_value(m, chunk_value(run, 0, "chunk", "\x1f", 1)),
        "attempt past int32": with_value(m, chunk_value(run, 0, "chunk", "x", 2**31)),
        "run id in braces": replace(
            with_value(m, chunk_value("{" + run + "}", 0, "chunk", "x", 1)),
            key_=("{" + run + "}:0000000000").encode(),
        ),
        "key not UTF-8": replace(m, key_=(m.key_ or b"") + b"\xff"),
        "no UUIDv7": replace(
            with_value(m, chunk_value("run-1", 0, "chunk", "x", 1)), key_=b"run-1:0000000000"
        ),
        "uuid7 of year 10000": replace(
            with_value(m, chunk_value("ffffffff-ffff-7fff-bfff-ffffffffffff", 0, "chunk", "x", 1)),
            key_=b"ffffffff-ffff-7fff-bfff-ffffffffffff:0000000000",
        ),
    }


def test_any_doubtful_record_hands_the_poll_back(polls: ChunkPolls) -> None:
    run = uuid7()
    base = chunk(3, run, 0, "chunk", "x")
    cases = {**spoilers(base, run), **lenient(base, run)}
    for what, bad in cases.items():
        clean = [m for m in clean_poll() if b"not-a-uuid7" not in (m.key_ or b"")]
        msgs = [*clean, bad, chunk(11, run, 1, "chunk", "y")]
        assert polls.decode([*clean, chunk(11, run, 1, "chunk", "y")]) is not None
        if plain_chunk_poll(msgs):  # else the decoder never asks DuckDB
            assert polls.decode(msgs) is None, what
        try:
            expected = one_by_one(msgs)
        except (ValueError, OverflowError):
            continue  # the per-record path cannot take it either (a date past 9999)
        assert same(folded(in_duckdb(msgs)), expected), what


def test_later_rows_win_across_parts_and_per_record_rows() -> None:
    run = uuid7()
    first = [chunk(0, run, 0, "chunk", "a"), chunk(1, run, 1, "chunk", "b")]
    mixed = [chunk(2, run, 0, "chunk", "c"), chunk(3, run, 1, "reset", "{}")]
    mixed.append(with_value(chunk(4, run, 2, "chunk", "d"), b"[]"))  # per-record: raw
    last = [chunk(5, run, 1, "chunk", "e")]
    batch = in_duckdb(first, mixed, last)
    assert len(batch.chunk_parts) == 3  # the per-record rows became the middle part
    assert same(folded(batch), one_by_one(first + mixed + last))


@pytest.mark.parametrize("arrow", [True, False])
def test_a_duckdb_sink_stores_the_same_rows_from_parts_as_from_tuples(
    tmp_path: Path, arrow: bool
) -> None:
    runs = [uuid7() for _ in range(3)]
    polls_ = [
        [
            chunk(i, r, s, "chunk", f"{r[-2:]}{s}")
            for i, (r, s) in enumerate((r, s) for r in runs for s in range(3))
        ],
        [chunk(20, runs[0], 1, "chunk", "again"), chunk(21, runs[1], 3, "done", "{}")],
        [chunk(22, runs[0], 1, "chunk", "last")],
    ]
    stored = {}
    for mode in (arrow, not arrow):
        batch, decoder = RowBatch(), RecordDecoder(NAMES, PRICES, arrow_chunks=mode)
        for msgs in polls_:
            decoder.add_many(msgs, batch)
        decoder.close()
        sink = DuckDBSink(tmp_path / f"w-{mode}.duckdb", "duckdb")
        sink.open()
        written = sink.write(batch)
        chunks = sink.conn.execute("SELECT * FROM chunks ORDER BY run_id, seq").fetchall()
        outputs = sink.conn.execute("SELECT * FROM outputs ORDER BY run_id").fetchall()
        sink.close()
        stored[mode] = (written, chunks, outputs)
    assert stored[True] == stored[False]
    assert stored[True][0][t.CHUNKS.name] == 10
    texts = {row[0]: row[2] for row in stored[True][2]}
    tag = runs[0][-2:]
    assert texts[runs[0]] == f"{tag}0last{tag}2"  # the last poll's seq 1 won


TEXT = st.text(st.characters(exclude_categories=["Cs"]), max_size=8)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(["chunk", "reset", "done"]), TEXT), min_size=1, max_size=6)
)
def test_any_content_either_decodes_alike_or_goes_back(events: list[tuple[str, str]]) -> None:
    run = uuid7()
    msgs = [chunk(i, run, i, kind, text) for i, (kind, text) in enumerate(events)]
    assert same(folded(in_duckdb(msgs)), one_by_one(msgs))


class PythonOutputs(DuckDBSink):
    """A DuckDB sink whose outputs rows are rebuilt as every other sink's are."""

    write_outputs = SqlSink.write_outputs


def test_outputs_rebuilt_in_one_query_equal_the_rows_rebuilt_in_python(tmp_path: Path) -> None:
    """Stored chunks completed later, a compacted output that stays, a hole, a final
    record beside chunks, and a run whose chunks come in a later poll."""
    a, b, c, d = (uuid7() for _ in range(4))
    first = [
        chunk(0, a, 0, "chunk", "a0 "),
        final(1, b, 1, "done", "b final"),
        chunk(2, d, 0, "chunk", "d0"),
    ]
    second = [
        chunk(3, a, 1, "chunk", "a1"),
        chunk(4, a, 2, "done", "{}"),
        chunk(5, b, 0, "chunk", "ignored: b is compacted"),
        chunk(6, c, 0, "chunk", "c0"),
        chunk(7, c, 2, "done", "{}"),  # seq 1 missing: no end yet
        chunk(8, d, 1, "reset", "{}"),
        final(9, d, 2, "done", "d final"),
    ]
    stored = {}
    for kind in (DuckDBSink, PythonOutputs):
        sink = kind(tmp_path / f"{kind.__name__}.duckdb", "duckdb")
        sink.open()
        decoder = RecordDecoder(NAMES, PRICES, arrow_chunks=True)
        written = []
        for poll in (first, second, [chunk(10, c, 1, "chunk", "c1")]):
            batch = RowBatch()
            decoder.add_many(poll, batch)
            written.append(sink.write(batch))
        decoder.close()
        stored[kind] = (written, sink.conn.execute("SELECT * FROM outputs ORDER BY 1").fetchall())
        sink.close()
    assert stored[DuckDBSink] == stored[PythonOutputs]
    outputs = {row[0]: row for row in stored[DuckDBSink][1]}
    assert outputs[a][2:4] == ("a0 a1", "done") and outputs[b][2] == "b final"
    assert outputs[c][2:4] == ("c0c1", "done") and outputs[d][2] == "d final"
