"""The pure rules of a run's context and of a repeated message: the user's messages of a
run (merged ones included), turn tokens, the budget, the chat messages built from the
turns, the demo handler's view of them, the dedup window's keys and the
client_message_id check."""

from __future__ import annotations

import pytest

from koda_runtime.gateway.admission import idempotency_key_for
from koda_runtime.gateway.errors import InvalidField
from koda_runtime.gateway.intake import parse_run_request
from koda_runtime.lifecycle.control import merge_inputs
from koda_runtime.lifecycle.handler import RunContext
from koda_runtime.lifecycle.ids import dedup_bucket, derived_idempotency_key
from koda_runtime.lifecycle.turns import (
    CUT_MARK,
    Turn,
    estimate_tokens,
    fit_budget,
    input_tokens,
    turn_tokens,
    user_messages,
)
from koda_runtime.processors.handlers.conversation import with_turns
from koda_runtime.processors.handlers.demo import DemoHandler, demo_tokens


def test_user_messages_of_text_chat_and_merged_inputs() -> None:
    assert user_messages({"text": "hello"}) == ["hello"]
    assert user_messages({"prompt": "hi"}) == ["hi"]
    assert user_messages({"demo": {"tokens": 3}}) == []
    merged = merge_inputs(merge_inputs({"text": "a\n\nb"}, {"text": "c"}), {"text": "d"})
    assert user_messages(merged) == ["a\n\nb", "c", "d"]
    chat = {
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "x"}]
    }
    assert user_messages(merge_inputs(chat, {"text": "y"})) == ["x", "y"]
    assert user_messages(
        merge_inputs({"text": "p"}, {"messages": [{"role": "user", "content": "q"}]})
    ) == ["p", "q"]


def test_a_turn_costs_its_ledger_tokens_and_an_estimate_of_text_never_counted() -> None:
    assert (
        estimate_tokens("") == 0 and estimate_tokens("abcd") == 1 and estimate_tokens("abcde") == 2
    )
    # 8 chars of user text (2 tokens) + the ledger's 5 completion tokens, whatever the answer.
    assert turn_tokens(["12345678"], "x" * 400, False, 5) == 7
    # No ledger count: the answer is estimated too.
    assert turn_tokens(["12345678"], "x" * 400, False, 0) == 102
    # A cut answer is sent with its mark, which costs its estimate.
    assert turn_tokens(["12345678"], "", True, 0) == 2 + estimate_tokens(CUT_MARK)
    assert input_tokens({"text": "12345678"}) == 2


def _turn(n: int, tokens: int) -> Turn:
    return Turn(f"r{n}", (f"m{n}",), f"a{n}", tokens=tokens)


def test_the_budget_drops_the_oldest_turns_first_and_whole() -> None:
    turns = [_turn(1, 50), _turn(2, 10), _turn(3, 30), _turn(4, 20)]
    assert [t.run_id for t in fit_budget(turns, 100, reserved=5)] == ["r2", "r3", "r4"]
    assert [t.run_id for t in fit_budget(turns, 60, reserved=0)] == ["r2", "r3", "r4"]
    # A turn that does not fit ends the context: an older, smaller one is not taken.
    assert [t.run_id for t in fit_budget(turns, 55, reserved=0)] == ["r3", "r4"]
    assert fit_budget(turns, 10, reserved=10) == ()
    assert fit_budget([], 100) == ()


def test_turns_are_sent_as_chat_pairs_before_the_new_message() -> None:
    turns = [Turn("r1", ("my name is Ada",), "Hello Ada"), Turn("r2", ("a", "b"), "par", cut=True)]
    own = [{"role": "system", "content": "sys"}, {"role": "user", "content": "what is my name?"}]
    assert with_turns(turns, own) == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "my name is Ada"},
        {"role": "assistant", "content": "Hello Ada"},
        {"role": "user", "content": "a\n\nb"},
        {"role": "assistant", "content": f"par\n\n{CUT_MARK}"},
        {"role": "user", "content": "what is my name?"},
    ]
    assert Turn("r", ("q",), "", cut=True).answer_text == CUT_MARK
    assert with_turns([], own) == own


async def test_the_demo_handler_echoes_the_turns_it_was_given() -> None:
    inp = {"text": "third", "demo": {"tokens": 3, "delay_ms": 0, "echo_turns": True}}
    turns = (Turn("r1", ("first",), "x"), Turn("r2", ("second",), "", cut=True))
    ctx = RunContext("r3", "u", inp, 1, turns=turns)
    chunks = [c async for c in DemoHandler().stream(ctx) if isinstance(c, str)]
    assert chunks[0] == "turns=2 | first | second (cut)\n"
    assert chunks[1:] == demo_tokens(inp)
    # Without the option the answer is as before, turns or not.
    plain = {"text": "third", "demo": {"tokens": 3, "delay_ms": 0}}
    ctx = RunContext("r3", "u", plain, 1, turns=turns)
    assert [c async for c in DemoHandler().stream(ctx) if isinstance(c, str)] == demo_tokens(plain)


def test_a_key_derived_from_the_body_alone_lives_one_dedup_window() -> None:
    req = parse_run_request({"input": "yes", "session_id": "s1"})
    key, previous = idempotency_key_for("u", req, None, now_s=100.0, window_s=10.0)
    again, _ = idempotency_key_for("u", req, None, now_s=109.9, window_s=10.0)
    later, later_previous = idempotency_key_for("u", req, None, now_s=110.0, window_s=10.0)
    assert again == key  # a double click in the same window: the same key
    assert later != key and later_previous == key  # the next window asks for the previous
    assert previous is not None and previous != key
    assert dedup_bucket(109.9, 10.0) == 10 and dedup_bucket(110.0, 10.0) == 11
    with pytest.raises(ValueError, match="positive"):
        dedup_bucket(1.0, 0.0)


def test_a_client_message_id_or_key_makes_the_key_with_no_window() -> None:
    one = parse_run_request({"input": "yes", "session_id": "s1", "client_message_id": "m-1"})
    two = parse_run_request({"input": "yes", "session_id": "s1", "client_message_id": "m-2"})
    k1, p1 = idempotency_key_for("u", one, None, now_s=100.0, window_s=10.0)
    k1_later, _ = idempotency_key_for("u", one, None, now_s=100_000.0, window_s=10.0)
    k2, _ = idempotency_key_for("u", two, None, now_s=100.0, window_s=10.0)
    assert p1 is None and k1 == k1_later and k1 != k2
    ck, cp = idempotency_key_for("u", one, "client-key", now_s=100.0, window_s=10.0)
    assert cp is None and ck.startswith("client:")
    # A bucket never enters a key made from a client_message_id.
    assert derived_idempotency_key("u", "s", "m", {"b": 1}, 5) == derived_idempotency_key(
        "u", "s", "m", {"b": 1}, 6
    )


@pytest.mark.parametrize("value", ["", "has space", "tab\there", "é", "x" * 201])
def test_a_bad_client_message_id_is_named(value: str) -> None:
    with pytest.raises(
        InvalidField, match="client_message_id must be 1-200 printable ASCII"
    ) as exc:
        parse_run_request({"input": "x", "client_message_id": value})
    assert exc.value.field == "client_message_id"


def test_a_uuid_client_message_id_is_accepted() -> None:
    req = parse_run_request(
        {"input": "x", "client_message_id": "3f2b8c1e-0d4a-4c1b-9a7e-5b6c7d8e9f00"}
    )
    assert req.client_message_id == "3f2b8c1e-0d4a-4c1b-9a7e-5b6c7d8e9f00"
