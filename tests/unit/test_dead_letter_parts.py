"""What a dead letter cut of its original, part by part, as `koda dlq show`, `koda dlq
replay` and the replay's ``dead_letters`` table tell it (no broker needed)."""

from __future__ import annotations

import json
from typing import Any

from koda_runtime.topics.catalogue import RUNS, RUNS_DLQ
from koda_runtime.topics.dlq import LetterAt, LetterId, _replay_one
from koda_runtime.topics.dlq_view import detail_lines
from koda_runtime.topics.records.codec import (
    DEAD_LETTER,
    MAX_DEAD_LETTER_HEADER_VALUE,
    MAX_DEAD_LETTER_KEY,
    MAX_DEAD_LETTER_ORIGINAL,
    RUN_REQUESTED,
    RunRequested,
    dead_letter_value,
    headers_for,
)
from koda_runtime.topics.records.dead_letters import DeadLetter, decode_dead_letter
from koda_runtime.topics.replay import tables as t
from tests.unit.replay_records import NAMES, FakeMessage, decode

GOOD = RunRequested("r-1", "alice", "s", "").encode()


def raw(
    key: bytes | None = b"alice",
    value: bytes | None = GOOD,
    headers: Any = None,
    *,
    bare: bool = False,
) -> bytes:
    return dead_letter_value(
        key=key,
        value=value,
        headers=headers_for(RUN_REQUESTED) if headers is None else headers,
        topic=NAMES.topic(RUNS),
        partition=3,
        offset=41,
        attempts=0,
        reason="unknown_run",
        error="no run r-1",
        bare=bare,
    )


def parts(dl: DeadLetter) -> tuple[bool | None, bool | None, bool | None]:
    return dl.key_truncated, dl.headers_truncated, dl.value_truncated


def test_each_part_says_whether_it_was_cut() -> None:
    whole = decode_dead_letter(raw())
    assert parts(whole) == (False, False, False) and not whole.truncated
    long_key = decode_dead_letter(raw(key=b"k" * (MAX_DEAD_LETTER_KEY + 1)))
    assert parts(long_key) == (True, False, False) and long_key.truncated
    big_header = [("schema", b"run.requested/1"), ("x", b"v" * (MAX_DEAD_LETTER_HEADER_VALUE + 1))]
    assert parts(decode_dead_letter(raw(headers=big_header))) == (False, True, False)
    many = [(f"h{i}", b"v") for i in range(100)]
    assert parts(decode_dead_letter(raw(headers=many))) == (False, True, False)
    long_name = [("n" * 300, b"v")]
    assert parts(decode_dead_letter(raw(headers=long_name))) == (False, True, False)
    big = decode_dead_letter(raw(value=b"x" * (MAX_DEAD_LETTER_ORIGINAL + 1)))
    assert parts(big) == (False, False, True)
    # A bare letter keeps neither value nor headers; a missing original is not "cut".
    assert parts(decode_dead_letter(raw(bare=True))) == (False, True, True)
    assert parts(decode_dead_letter(raw(key=None, value=None, headers=[]))) == (
        False,
        False,
        False,
    )
    assert parts(decode_dead_letter(raw(value=b""))) == (False, False, False)


def test_a_letter_written_before_the_sizes_were_kept_cannot_tell() -> None:
    old = json.loads(raw(key=b"k" * 5000))
    for name in ("original_key_size", "original_headers_count", "original_headers_size"):
        del old[name]
    dl = decode_dead_letter(json.dumps(old).encode())
    assert dl.truncated and (dl.key_truncated, dl.headers_truncated) == (None, None)
    text = "\n".join(detail_lines(LetterAt(LetterId(0, 1), dl, 0)))
    assert "truncated: yes (cannot be replayed)" in text
    assert "key size:  -" in text and "headers:   2 kept" in text


def test_show_names_the_original_sizes_and_what_was_cut() -> None:
    letter = decode_dead_letter(
        raw(key=b"k" * 2000, headers=[("schema", b"run.requested/1"), ("big", b"v" * 4000)])
    )
    text = "\n".join(detail_lines(LetterAt(LetterId(0, 17), letter, 0)))
    assert "key size:  2000 bytes (truncated)" in text
    assert f"size:      {len(GOOD)} bytes\n" in text  # the value is whole
    assert "truncated: key, headers (cannot be replayed)" in text
    assert "headers:   2 (4024 bytes), 2 kept (truncated)" in text
    whole = "\n".join(detail_lines(LetterAt(LetterId(0, 18), decode_dead_letter(raw()), 0)))
    assert "truncated: no" in whole and "(truncated)" not in whole
    assert "key size:  5 bytes" in whole


def test_replay_names_the_parts_that_keep_a_letter_from_being_replayed() -> None:
    letter = decode_dead_letter(raw(key=b"k" * 2000, value=b"x" * (MAX_DEAD_LETTER_ORIGINAL + 9)))
    verdict = _replay_one(letter, NAMES.topic(RUNS), (), None, lambda *_: None)
    assert verdict == "skipped: original truncated (key, value)"
    assert _replay_one(decode_dead_letter(raw()), NAMES.topic(RUNS), (), None, lambda *_: None) == (
        "replayed"
    )


def test_the_dead_letters_table_has_the_sizes_and_the_parts() -> None:
    value = raw(key=b"k" * 3000, headers=[(f"h{i}", b"v" * 10) for i in range(70)])
    msg = FakeMessage(NAMES.topic(RUNS_DLQ), 0, 5, b"k" * 1024, value, headers_for(DEAD_LETTER))
    (row,) = decode(msg).sorted_rows(t.DEAD_LETTERS)
    got = dict(zip(t.DEAD_LETTERS.names, row, strict=True))
    assert (got["original_key_size"], got["original_headers_count"]) == (3000, 70)
    assert got["original_headers_size"] == sum(len(f"h{i}") + 10 for i in range(70))
    assert (got["key_truncated"], got["headers_truncated"], got["value_truncated"]) == (
        True,
        True,
        False,
    )
    assert got["original_truncated"] is True and got["original_size"] == len(GOOD)


def test_a_letter_whose_error_quotes_a_lone_surrogate_is_still_utf8() -> None:
    """A run id of JSON escapes ("x\\udfff") named in the error: the letter must encode,
    or the record would be retried until it counted as failed before its claim."""
    value = dead_letter_value(
        key=b"alice",
        value=GOOD,
        headers=[],
        topic=NAMES.topic(RUNS),
        partition=0,
        offset=1,
        attempts=0,
        reason="unknown_run",
        error="no run x\udfff in Postgres",
    )
    assert decode_dead_letter(value).error == "no run x\\udfff in Postgres"
