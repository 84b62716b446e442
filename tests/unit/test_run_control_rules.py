"""The pure rules of run control: merging inputs, control records, what a row change
refuses, and when an attempt must stop."""

from __future__ import annotations

import pytest

from koda_runtime.lifecycle.chunks import Chunk, ChunkKind, SeqCounter
from koda_runtime.lifecycle.control import (
    CANCEL,
    MERGE,
    ControlRecord,
    decode_control,
    merge_inputs,
)
from koda_runtime.lifecycle.states import RunStatus
from koda_runtime.processors.control import ControlBoard
from koda_runtime.schemas.epochs import Fence
from koda_runtime.schemas.runs.worker import ChunkWrite, FinishWrite, RunSteer

FENCE = Fence("t", 0, 1)


def test_texts_join_and_the_first_messages_options_stay() -> None:
    merged = merge_inputs({"text": "a", "demo": {"tokens": 3}}, {"text": "b", "demo": {"x": 1}})
    assert merged["text"] == "a\n\nb" and merged["demo"] == {"tokens": 3}
    again = merge_inputs(merged, {"prompt": "c"})
    assert again["text"] == "a\n\nb\n\nc"
    assert again["merged"] == [{"text": "b", "demo": {"x": 1}}, {"prompt": "c"}]


def test_chat_messages_concatenate_and_a_text_becomes_a_user_message() -> None:
    one = [{"role": "user", "content": "a"}]
    two = [{"role": "user", "content": "b"}]
    assert merge_inputs({"messages": one}, {"messages": two})["messages"] == one + two
    assert merge_inputs({"messages": one}, {"text": "b"})["messages"] == one + two
    assert merge_inputs({"text": "a"}, {"messages": two})["messages"] == one + two


def test_control_records_round_trip_and_garbage_is_refused() -> None:
    rec = ControlRecord("r1", "u1", MERGE, None, 2)
    assert decode_control(rec.encode()) == rec
    cancel = ControlRecord("r1", "u1", CANCEL, "why")
    assert decode_control(cancel.encode()) == cancel
    for bad in (
        b"",
        b"[]",
        b"not json",
        b'{"run_id": "r", "user_id": "u", "action": "pause"}',
        b'{"run_id": "", "user_id": "u", "action": "cancel"}',
        b'{"run_id": "r", "user_id": "u", "action": "merge", "input_version": true}',
        b'{"run_id": "r", "user_id": "u", "action": "cancel", "reason": 3}',
        None,
    ):
        assert decode_control(bad) is None, bad


def done(version: int | None) -> FinishWrite:
    return FinishWrite(FENCE, "r", RunStatus.DONE, [], input_version=version)


def test_a_cancel_request_refuses_every_ending_but_cancelled() -> None:
    steer = RunSteer(True, "why", 0)
    refused = steer.supersedes(done(0))
    assert refused is not None and refused.cancelled and refused.cancel_reason == "why"
    assert steer.supersedes(FinishWrite(FENCE, "r", RunStatus.FAILED, [])) is not None
    assert steer.supersedes(FinishWrite(FENCE, "r", RunStatus.CANCELLED, [])) is None
    assert steer.supersedes(ChunkWrite(FENCE, "r", [], False, 0)) is None  # chunks stay


def test_a_newer_input_refuses_done_only() -> None:
    steer = RunSteer(False, None, 2)
    refused = steer.supersedes(done(1))
    assert refused is not None and not refused.cancelled and refused.input_version == 2
    assert steer.supersedes(done(2)) is None
    assert steer.supersedes(done(None)) is None  # a writer that does not track versions
    assert steer.supersedes(FinishWrite(FENCE, "r", RunStatus.FAILED, [])) is None
    assert steer.changed_for(ChunkWrite(FENCE, "r", [], False, 1))
    assert not steer.changed_for(ChunkWrite(FENCE, "r", [], False, 2))


def test_the_board_stops_an_attempt_once_and_only_for_its_runs() -> None:
    board = ControlBoard()
    control = board.open("r")
    token = control.begin(0)
    stops: list[str] = []
    control.on_stop(lambda: stops.append("stop"))
    assert not board.deliver(ControlRecord("other", "u", CANCEL))
    assert board.deliver(ControlRecord("r", "u", MERGE, input_version=1))
    assert token.cancelled and control.stopping and stops == ["stop"]
    board.deliver(ControlRecord("r", "u", MERGE, input_version=1))  # the same again
    assert stops == ["stop"]
    token = control.begin(1)  # the rerun on version 1
    assert not token.cancelled and not control.stopping
    board.observe("r", RunSteer(True, "late", 1))
    assert token.cancelled and control.cancel_requested and control.cancel_reason == "late"
    late: list[str] = []
    control.on_stop(lambda: late.append("stop"))  # registered after the stop: runs at once
    assert late == ["stop"]
    board.close("r")
    assert not board.deliver(ControlRecord("r", "u", CANCEL))


def test_a_seq_given_back_is_taken_again() -> None:
    seq = SeqCounter(5)
    taken = seq.take()
    seq.give_back(taken)
    assert seq.take() == 5
    seq.take()
    with pytest.raises(ValueError, match="only the last seq"):
        seq.give_back(5)
    assert Chunk("r", 0, ChunkKind.CANCELLED, "{}", 1).kind.terminal
