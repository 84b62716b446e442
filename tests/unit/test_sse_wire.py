"""SSE wire format, resume positions, the live queue's bound and the chunk-log fold."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from koda_runtime.gateway.errors import BadRequest
from koda_runtime.gateway.eventstream import EventParser, comment, event_frame, retry_frame
from koda_runtime.gateway.livefeed import LiveEvent, Viewer
from koda_runtime.gateway.sse import resume_position
from koda_runtime.lifecycle.chunks import chunk_key, final_key, split_chunk_key, visible_output
from koda_runtime.topics.chunklog import ChunkLog
from koda_runtime.topics.records.codec import FinalRecord, chunk_value


def test_frames_parse_back_in_any_split() -> None:
    stream = (
        retry_frame(250)
        + comment("stream open")
        + event_frame(0, "chunk", chunk_value("r", 0, "chunk", "hé\nllo", 1))
        + comment("keep-alive")
        + event_frame(1, "done", b'{"status":"done"}')
        + event_frame(None, "reconnect", b'{"reason":"overflow"}')
    )
    for cut in range(len(stream)):
        parser = EventParser()
        events = parser.feed(stream[:cut]) + parser.feed(stream[cut:])
        assert [(e.id, e.event) for e in events] == [
            ("0", "chunk"),
            ("1", "done"),
            (None, "reconnect"),
        ]
        assert events[0].json()["content"] == "hé\nllo"
        assert parser.retry == 250


def test_multiline_data_is_split_not_corrupted() -> None:
    events = EventParser().feed(event_frame(3, "status", b"a\nb\r\nc"))
    assert [(e.seq, e.data) for e in events] == [(3, "a\nb\nc")]


def test_crlf_line_ends_are_accepted() -> None:
    events = EventParser().feed(b"id: 7\r\nevent: chunk\r\ndata: {}\r\n\r\n")
    assert [(e.seq, e.event, e.data) for e in events] == [(7, "chunk", "{}")]


@pytest.mark.parametrize(
    ("header", "after", "expected"),
    [
        (None, None, -1),
        ("5", None, 5),
        (None, "7", 7),
        ("5", "9", 5),
        ("", "9", 9),
        (" 12 ", None, 12),
        (None, "0", 0),
    ],
)
def test_resume_position(header: str | None, after: str | None, expected: int) -> None:
    assert resume_position(header, after) == expected


@pytest.mark.parametrize(
    ("header", "after", "field"),
    [
        ("x", None, "Last-Event-ID"),
        ("-1", None, "Last-Event-ID"),
        (None, "1.5", "after"),
        (None, "-3", "after"),
        (None, "", "after"),
        (None, str(2**31), "after"),
        ("abc", "3", "Last-Event-ID"),
    ],
)
def test_bad_resume_positions_are_refused_naming_the_parameter(
    header: str | None, after: str | None, field: str
) -> None:
    with pytest.raises(BadRequest) as info:
        resume_position(header, after)
    assert info.value.field == field and field in info.value.message


def test_chunk_keys_round_trip() -> None:
    assert split_chunk_key(chunk_key("01J:x", 42)) == ("01J:x", 42)
    assert split_chunk_key(final_key("run-1")) == ("run-1", None)
    for bad in ("run", "run:12", ":0000000001", "run:00000000x1"):
        with pytest.raises(ValueError):
            split_chunk_key(bad)


def test_visible_output_starts_after_the_last_reset() -> None:
    events = [
        (3, "chunk", "c"),
        (0, "chunk", "a"),
        (1, "reset", "{}"),
        (2, "chunk", "b"),
        (4, "done", "{}"),
    ]
    assert visible_output(events) == "bc"
    assert visible_output([]) == ""


async def test_a_viewer_queue_is_bounded_and_overflow_cuts_it() -> None:
    viewer = Viewer("r", max_bytes=100)
    frame = b"x" * 40
    viewer.offer(LiveEvent(0, "chunk", frame))
    viewer.offer(LiveEvent(1, "chunk", frame))
    assert viewer.cut is None
    viewer.offer(LiveEvent(2, "chunk", frame))  # 120 bytes > 100
    assert viewer.cut == "overflow"
    assert await viewer.next_batch(0.01) == []  # the queue was freed at once
    big = Viewer("r", max_bytes=10)
    big.offer(LiveEvent(0, "chunk", b"y" * 50))  # an empty queue always takes one event
    assert [e.seq for e in await big.next_batch(0.01)] == [0]


async def test_next_batch_waits_for_an_offer() -> None:
    viewer = Viewer("r", max_bytes=1000)
    waiter = asyncio.create_task(viewer.next_batch(5))
    # One turn of the loop runs the task up to its wait on the wake event (nothing in
    # next_batch yields before it): from here on it is provably waiting.
    await asyncio.sleep(0)
    assert not waiter.done()
    viewer.offer(LiveEvent(0, "chunk", b"a"))
    viewer.offer(LiveEvent(1, "chunk", b"b"))
    assert [e.seq for e in await waiter] == [0, 1]
    assert await viewer.next_batch(0.01) == []


def _chunk(run_id: str, seq: int, kind: str, content: str, attempt: int = 1) -> tuple[bytes, bytes]:
    return chunk_key(run_id, seq).encode(), chunk_value(run_id, seq, kind, content, attempt)


@settings(max_examples=60, deadline=None)
@given(
    st.integers(min_value=0, max_value=8),
    st.integers(min_value=1, max_value=6),
    st.randoms(use_true_random=False),
)
def test_chunk_log_gives_the_same_output_at_every_cleaning_stage(
    reset_at: int, tail: int, rnd
) -> None:
    run = "run-a"
    records = [_chunk(run, i, "chunk", f"a{i} ") for i in range(reset_at)]
    records.append(_chunk(run, reset_at, "reset", "{}", 2))
    records += [_chunk(run, reset_at + 1 + i, "chunk", f"b{i} ", 2) for i in range(tail)]
    last = reset_at + tail + 1
    records.append(_chunk(run, last, "done", "{}", 2))
    expected = "".join(f"b{i} " for i in range(tail))
    final = FinalRecord(run, last, "done", "{}", expected, 2)
    compaction: list[tuple[bytes, bytes | None]] = [(final_key(run).encode(), final.encode())]
    compaction += [(chunk_key(run, s).encode(), None) for s in range(last + 1)]
    log = records + [records[rnd.randrange(len(records))]] + compaction  # a redelivery
    # The cleaner keeps the latest record per key; any prefix of the log is a reader's view.
    for stage in (log[: len(records)], log, _cleaned(log)):
        fold = ChunkLog()
        for key, value in stage:
            fold.apply(key, value)
        assert fold.runs[run].output == expected
        assert fold.runs[run].end == "done"


def _cleaned(log: list[tuple[bytes, bytes | None]]) -> list[tuple[bytes, bytes | None]]:
    latest = {key: i for i, (key, _) in enumerate(log)}
    return [rec for i, rec in enumerate(log) if latest[rec[0]] == i and rec[1] is not None]


def test_chunk_log_skips_foreign_records() -> None:
    fold = ChunkLog()
    fold.apply(b"nonsense", b"{}")
    fold.apply(chunk_key("r", 0).encode(), b"not json")
    assert fold.runs == {} and fold.skipped == 2


def test_chunk_log_does_not_end_a_run_while_an_event_before_its_end_is_missing() -> None:
    fold = ChunkLog()
    for key, value in (
        _chunk("run-h", 0, "chunk", "a "),
        _chunk("run-h", 3, "done", "{}"),
        _chunk("run-h", 2, "chunk", "c "),
    ):
        fold.apply(key, value)
    run = fold.runs["run-h"]
    assert (run.last_seq, run.missing, run.end, run.complete) == (3, [1], None, False)
    fold.apply(*_chunk("run-h", 1, "chunk", "b "))  # produced again by the successor
    assert (run.missing, run.end, run.complete, run.output) == ([], "done", True, "a b c ")
