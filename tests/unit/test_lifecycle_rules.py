"""The run lifecycle's rules (koda/lifecycle), pure: the state machine, the attempt
rules (claim bound, give-up, retry, reset, first output), the end of a run's output
(status → end event, the terminal kinds) and the seq counter."""

from __future__ import annotations

import json
import random

import pytest

from koda_runtime.lifecycle.attempts import (
    MAX_CLAIMS_PER_ATTEMPT,
    GiveUp,
    Retry,
    Start,
    after_claim,
    after_failure,
    end_event,
    first_output,
)
from koda_runtime.lifecycle.chunks import (
    END_KIND,
    TERMINAL_KINDS,
    Chunk,
    ChunkKind,
    SeqCounter,
    end_kind,
)
from koda_runtime.lifecycle.retry import RetryPolicy
from koda_runtime.lifecycle.states import (
    ACTIVE,
    ALLOWED,
    OPEN,
    TERMINAL,
    RunStatus,
    can_transition,
    sources_of,
)
from koda_runtime.schemas.runs.worker import edges

POLICY = RetryPolicy(max_attempts=3, base_s=0.5, cap_s=10.0)


def test_terminal_statuses_have_no_way_out_and_every_other_one_can_end() -> None:
    for status in RunStatus:
        assert status.terminal == (status in TERMINAL)
        if status.terminal:
            assert ALLOWED[status] == frozenset()
        else:
            assert {RunStatus.FAILED, RunStatus.CANCELLED} <= ALLOWED[status]
    assert OPEN == frozenset(RunStatus) - TERMINAL
    assert ACTIVE <= OPEN and RunStatus.PENDING not in ACTIVE


def test_sources_of_is_the_inverse_of_can_transition() -> None:
    assert sources_of(RunStatus.RUNNING) == {
        RunStatus.PENDING,
        RunStatus.RUNNING,
        RunStatus.STREAMING,
        RunStatus.WAITING,  # resumed once a person approved or rejected its tool call
    }
    assert sources_of(RunStatus.WAITING) == ACTIVE
    assert RunStatus.WAITING in OPEN and RunStatus.WAITING not in ACTIVE  # holds no worker
    assert not can_transition(RunStatus.WAITING, RunStatus.DONE)  # it runs again first
    assert not can_transition(RunStatus.PENDING, RunStatus.WAITING)
    assert sources_of(RunStatus.STREAMING) == {RunStatus.RUNNING}
    assert sources_of(RunStatus.DONE) == ACTIVE
    assert sources_of(RunStatus.PENDING) == frozenset()
    assert not can_transition(RunStatus.STREAMING, RunStatus.STREAMING)
    assert not can_transition(RunStatus.PENDING, RunStatus.DONE)
    for target in RunStatus:
        for source in RunStatus:
            assert (source in sources_of(target)) == can_transition(source, target)


def test_the_store_moves_rows_only_along_the_state_machines_edges() -> None:
    got = edges([RunStatus.STREAMING, RunStatus.DONE])
    pairs = set(zip(got["edge_from"], got["edge_to"], strict=True))
    assert pairs == {("running", "streaming"), ("running", "done"), ("streaming", "done")}
    every = edges(RunStatus)
    assert len(every["edge_from"]) == sum(len(d) for d in ALLOWED.values())


def test_a_claim_starts_the_attempt_with_a_reset_when_output_exists() -> None:
    assert after_claim(1, 0, had_output=False, rerun=False, policy=POLICY) == Start(False, False)
    assert after_claim(2, 1, had_output=True, rerun=False, policy=POLICY) == Start(True, False)
    # A merged rerun drops the old answer at once, not with its first token.
    assert after_claim(2, 0, had_output=True, rerun=True, policy=POLICY) == Start(True, True)
    assert after_claim(2, 0, had_output=False, rerun=True, policy=POLICY) == Start(False, False)


def test_a_claim_gives_up_when_the_retry_budget_is_spent() -> None:
    # A successor resuming a run whose three attempts all failed (its owner died
    # before writing the failure): it ends the run, it does not run it a fourth time.
    assert after_claim(4, 3, had_output=True, rerun=False, policy=POLICY) == GiveUp(
        3, "attempts exhausted"
    )


def test_claims_are_bounded_even_when_no_attempt_failed() -> None:
    bound = POLICY.max_attempts * MAX_CLAIMS_PER_ATTEMPT
    assert isinstance(after_claim(bound, 0, had_output=True, rerun=False, policy=POLICY), Start)
    give_up = after_claim(bound + 1, 0, had_output=True, rerun=False, policy=POLICY)
    assert give_up == GiveUp(
        bound, f"claimed {bound} times without finishing (cut off or its worker died)"
    )


def test_a_failure_is_retried_with_backoff_until_the_budget_is_spent() -> None:
    rng = random.Random(7)
    first = after_failure(1, 1, "boom", final=False, policy=POLICY, rng=rng)
    assert isinstance(first, Retry) and 0.25 <= first.backoff_s <= 0.5
    second = after_failure(2, 2, "boom", final=False, policy=POLICY, rng=rng)
    assert isinstance(second, Retry) and 0.5 <= second.backoff_s <= 1.0
    assert after_failure(3, 3, "boom", final=False, policy=POLICY) == GiveUp(3, "boom")


def test_a_final_failure_gives_up_at_once() -> None:
    assert after_failure(1, 1, "tool turns", final=True, policy=POLICY) == GiveUp(
        1, "tool turns", dead_letter=False
    )


def test_backoff_doubles_and_is_capped() -> None:
    rng = random.Random(1)
    for attempt in range(1, 12):
        raw = min(POLICY.cap_s, POLICY.base_s * 2 ** (attempt - 1))
        assert raw / 2 <= POLICY.backoff_s(attempt, rng) <= raw


def test_first_output_is_the_first_chunk_of_a_run_not_yet_streaming() -> None:
    reset = Chunk("r", 4, ChunkKind.RESET, "{}", 2)
    tool = Chunk("r", 5, ChunkKind.TOOL, "{}", 2)
    chunk = Chunk("r", 6, ChunkKind.CHUNK, "hi", 2)
    assert first_output(False, [reset, tool, chunk])
    assert not first_output(False, [reset, tool])
    assert not first_output(True, [chunk])
    assert not first_output(False, [])


def test_each_terminal_status_ends_with_its_own_kind() -> None:
    assert {s for s in RunStatus if s.terminal} == set(END_KIND)
    assert TERMINAL_KINDS == {ChunkKind.DONE, ChunkKind.ERROR, ChunkKind.CANCELLED}
    assert end_kind(RunStatus.FAILED) is ChunkKind.ERROR
    assert {k for k in ChunkKind if k.terminal} == TERMINAL_KINDS
    # Wire values are found in the set as they are (readers compare strings).
    assert "done" in TERMINAL_KINDS and "error" in TERMINAL_KINDS and "chunk" not in TERMINAL_KINDS
    with pytest.raises(ValueError, match="running is not a terminal status"):
        end_kind(RunStatus.RUNNING)


def test_end_events_carry_what_viewers_are_told() -> None:
    assert end_event(RunStatus.DONE) == (ChunkKind.DONE, json.dumps({"status": "done"}))
    kind, content = end_event(RunStatus.CANCELLED, reason="user")
    assert kind is ChunkKind.CANCELLED
    assert json.loads(content) == {"status": "cancelled", "reason": "user"}
    kind, content = end_event(RunStatus.FAILED, error="x" * 900, attempts=3)
    assert kind is ChunkKind.ERROR
    assert json.loads(content) == {"error": "x" * 500, "attempts": 3}
    with pytest.raises(ValueError, match="streaming is not a terminal status"):
        end_event(RunStatus.STREAMING)


def test_the_seq_counter_gives_back_only_the_last_seq() -> None:
    seq = SeqCounter(3)
    assert [seq.take(), seq.take()] == [3, 4]
    with pytest.raises(ValueError, match="only the last seq"):
        seq.give_back(3)
    seq.give_back(4)
    assert seq.next == 4 and seq.take() == 4
