"""Dead-letter ids and how `koda dlq list` / `show` print a letter (no broker needed)."""

from __future__ import annotations

import pytest

from koda_runtime.errors import DeadLetterError
from koda_runtime.topics.dlq import LetterAt, LetterId
from koda_runtime.topics.dlq_view import detail_lines, list_line, run_id_of
from koda_runtime.topics.records.codec import (
    RUN_REQUESTED,
    RunRequested,
    dead_letter_value,
    headers_for,
)
from koda_runtime.topics.records.dead_letters import decode_dead_letter


def at(value: bytes | None, key: bytes | None = b"alice", reason: str = "unknown_run") -> LetterAt:
    raw = dead_letter_value(
        key=key,
        value=value,
        headers=headers_for(RUN_REQUESTED),
        topic="dev.koda.runs",
        partition=3,
        offset=41,
        attempts=0,
        reason=reason,
        error="no run r-1 in Postgres\nsecond line",
    )
    return LetterAt(LetterId(0, 17), decode_dead_letter(raw), 1_764_000_000_000)


def test_letter_ids_read_as_partition_colon_offset() -> None:
    assert LetterId.parse("2:17") == LetterId(2, 17)
    assert LetterId.parse("17") == LetterId(0, 17)
    assert str(LetterId(2, 17)) == "2:17"
    for bad in ("", "a:1", "1:", "-1:2", "1:2:3"):
        with pytest.raises(DeadLetterError, match="use <partition>:<offset>"):
            LetterId.parse(bad)


def test_a_list_line_names_id_reason_run_and_key() -> None:
    line = list_line(at(RunRequested("r-1", "alice", "s", "").encode()))
    assert line.startswith("0:17 ")
    assert "unknown_run" in line and "run=r-1" in line and "key=alice" in line
    assert "\n" not in line and "in Postgres second line" in line  # the error on one line
    assert "run=-" in list_line(at(b"\xff\x00", key=b"\xff"))
    assert "(not a dead letter)" in list_line(LetterAt(LetterId(0, 1), None, 0))


def test_show_prints_every_field_and_the_original() -> None:
    text = "\n".join(detail_lines(at(RunRequested("r-1", "alice", "s", "").encode())))
    assert "original:  dev.koda.runs [3] @ 41" in text
    assert "schema: run.requested/1" in text
    assert '"run_id": "r-1"' in text  # pretty-printed JSON
    binary = "\n".join(detail_lines(at(b"\xff\x00", key=b"\xfe")))
    assert "key:       base64:/g==" in binary and "base64:/wA=" in binary
    assert run_id_of(at(None)) is None
