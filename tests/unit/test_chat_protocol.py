"""gateway/chat.py's pure parts: useChat's request read, and koda events as UI message
stream parts (the browser test drives the real AI SDK against them)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from koda_runtime.gateway.chat import ChatRequest, UIParts, parse_chat_request, part_frames
from koda_runtime.gateway.errors import InvalidField


def user(text: str, message_id: str = "m1") -> dict[str, Any]:
    return {"id": message_id, "role": "user", "parts": [{"type": "text", "text": text}]}


def body(**extra: Any) -> dict[str, Any]:
    return {"id": "chat-1", "messages": [user("hi")], "trigger": "submit-message", **extra}


def test_the_last_user_message_becomes_the_run_in_the_chats_session() -> None:
    history = [user("old", "m0"), {"id": "a0", "role": "assistant", "parts": []}, user("new")]
    asked = parse_chat_request({**body(), "messages": history, "input": {"demo": {"tokens": 3}}})
    assert asked == ChatRequest("chat-1", "new", "m1", None, {"demo": {"tokens": 3}})
    run = asked.run_request()
    assert run.session_id == "chat-1"
    assert run.client_message_id == "m1"  # a resend of the message is the same run
    assert run.input == {"demo": {"tokens": 3}, "text": "new"}


def test_a_single_message_body_and_several_text_parts() -> None:
    message = {**user("a"), "parts": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    asked = parse_chat_request({"id": "c", "message": message, "metadata": {"k": 1}})
    assert (asked.text, asked.metadata) == ("a\nb", {"k": 1})


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"trigger": "regenerate-message"}, "trigger"),
        ({"messageId": "m0"}, "messageId"),
        ({"id": "a b"}, "id"),
        ({"messages": []}, "messages"),
        ({"messages": [{**user("x"), "role": "assistant"}]}, "messages[0].role"),
        ({"messages": [{**user("x"), "id": ""}]}, "messages[0].id"),
        (
            {"messages": [{**user("x"), "parts": [{"type": "file", "url": "u"}]}]},
            "messages[0].parts[0]",
        ),
        ({"messages": [user("   ")]}, "messages[0].parts"),
        ({"message": user("x")}, "message"),
        ({"input": {"text": "sneaked"}}, "input.text"),
        ({"input": [1]}, "input"),
        ({"metadata": "x"}, "metadata"),
        ({"temperature": 2}, "temperature"),
    ],
)
def test_bad_requests_name_the_field(changes: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidField) as refused:
        parse_chat_request(body(**changes))
    assert refused.value.field == field


def test_an_input_field_that_breaks_the_run_rules_is_refused_like_post_runs() -> None:
    with pytest.raises(InvalidField) as refused:
        parse_chat_request(body(input={"x": "nul\x00"})).run_request()
    assert refused.value.field == "input"


def events(*items: tuple[str, Any]) -> list[dict[str, Any]]:
    parts = UIParts("run-1")
    out = parts.start()
    for seq, (kind, content) in enumerate(items):
        text = content if isinstance(content, str) or content is None else json.dumps(content)
        out += parts.event(seq, kind, text)
    return out


def test_text_tools_and_done() -> None:
    call = {"call_id": "c0", "name": "memory_search", "arguments": '{"query": "q"}'}
    result = {"call_id": "c0", "name": "memory_search", "result": "found"}
    parts = events(
        ("chunk", "Let "),
        ("chunk", "me look."),
        ("tool", call),
        ("tool", result),
        ("chunk", "Done."),
        ("done", {"status": "done"}),
        ("chunk", "after the end"),
    )
    tool = {"toolCallId": "c0", "dynamic": True, "providerExecuted": True}
    assert parts == [
        {"type": "start", "messageId": "run-1"},
        {"type": "text-start", "id": "text-0"},
        {"type": "text-delta", "id": "text-0", "delta": "Let "},
        {"type": "text-delta", "id": "text-0", "delta": "me look."},
        {"type": "text-end", "id": "text-0"},
        {
            "type": "tool-input-available",
            **tool,
            "toolName": "memory_search",
            "input": {"query": "q"},
        },
        {"type": "tool-output-available", **tool, "output": "found"},
        {"type": "text-start", "id": "text-4"},
        {"type": "text-delta", "id": "text-4", "delta": "Done."},
        {"type": "text-end", "id": "text-4"},
        {"type": "finish", "finishReason": "stop"},
    ]


def test_a_reset_closes_the_draft_and_marks_where_the_answer_starts() -> None:
    parts = events(("chunk", "draft"), ("reset", {"attempt": 2}), ("chunk", "answer"))
    assert parts[3:] == [
        {"type": "text-end", "id": "text-0"},
        {"type": "data-koda-reset", "id": "reset-1", "data": {"attempt": 2}},
        {"type": "text-start", "id": "text-2"},
        {"type": "text-delta", "id": "text-2", "delta": "answer"},
    ]


def test_a_result_whose_call_was_before_the_replay_still_has_its_call() -> None:
    parts = UIParts("r").event(7, "tool", json.dumps({"call_id": "c", "name": "t", "result": "x"}))
    assert [p["type"] for p in parts] == ["tool-input-available", "tool-output-available"]


def test_ends_cancelled_failed_and_cut() -> None:
    cancelled = events(("chunk", "a"), ("cancelled", {"status": "cancelled", "reason": "stop"}))
    assert cancelled[-2:] == [
        {"type": "text-end", "id": "text-0"},
        {"type": "abort", "reason": "stop"},
    ]
    assert events(("cancelled", {"status": "cancelled", "reason": None}))[-1] == {"type": "abort"}
    failed = events(("error", {"error": "deadline: 60 s", "attempts": 1}))
    assert failed[-1] == {"type": "error", "errorText": "deadline: 60 s"}
    # A run that ended without an event of its own (the stream says how it ended).
    assert UIParts("r").event(None, "done", None) == [{"type": "finish", "finishReason": "stop"}]
    cut = UIParts("r")
    assert cut.event(None, "reconnect", None)[0]["type"] == "error"
    assert cut.ended


def test_status_is_transient_and_frames_are_one_data_line_each() -> None:
    (status,) = UIParts("r").event(0, "status", json.dumps({"model": "m2", "fallback": True}))
    assert status == {
        "type": "data-koda-status",
        "data": {"model": "m2", "fallback": True},
        "transient": True,
    }
    frames = part_frames([{"type": "text-delta", "id": "t", "delta": "a\nb é"}])
    assert frames == b'data: {"type":"text-delta","id":"t","delta":"a\\nb \xc3\xa9"}\n\n'


def test_a_run_waiting_for_approval_is_a_data_part_with_the_call() -> None:
    pending = {"step": 1, "tool": "book", "arguments": {"day": "mon"}}
    parts = events(("chunk", "Booking."), ("approval_required", pending))
    assert parts[-2:] == [
        {"type": "text-end", "id": "text-0"},
        {"type": "data-koda-approval", "id": "approval-1", "data": pending},
    ]
