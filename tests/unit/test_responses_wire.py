"""The Responses API mapping (gateway/responses_wire.py): requests, objects, numbering.

Every event and object is validated strictly against the installed ``openai`` package's
own types: the SDK parses what koda sends.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from koda_runtime.gateway.responses_wire import (
    INPUT_KEY,
    EventNumbering,
    RequestError,
    parse_create,
    response_object,
    response_status,
    run_id_of,
    served_model,
    sse_frame,
)
from koda_runtime.processors.handlers.demo import MODEL as DEMO_MODEL
from koda_runtime.schemas.runs.reads import RunState

EVENTS = TypeAdapter(ResponseStreamEvent)
RUN = "0190f1c2-aaaa-7bbb-8ccc-0123456789ab"
AT = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


def state(status: str, output: str = "", **kw: Any) -> RunState:
    base: dict[str, Any] = {
        "run_id": RUN,
        "session_id": "s1",
        "status": status,
        "created_at": AT,
        "finished_at": AT,
        "error": None,
        "output": output,
        "resets": 0,
        "input": {"text": "hi", INPUT_KEY: {"background": True, "instructions": None}},
        "metadata": {"k": "v"},
        "model": "m-1",
        "usage": (7, 5, 2, 1),
    }
    base.update(kw)
    return RunState(**base)


def play(koda_events: list[tuple[str, str]], final: RunState) -> list[dict[str, Any]]:
    numbering = EventNumbering(RUN, response_object(state("pending")))
    out = numbering.created()
    for kind, content in koda_events:
        out += numbering.feed(kind, content)
    return out + numbering.end(response_object(final))


def test_events_are_the_sdks_types_numbered_from_zero_without_gaps() -> None:
    koda = [("chunk", "a"), ("tool", "{}"), ("chunk", "b"), ("reset", ""), ("status", "{}")]
    koda += [("chunk", "c"), ("chunk", "d")]
    events = play(koda, state("done", "cd", resets=1))
    for event in events:
        EVENTS.validate_python(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    # tool and status make no event; a reset five; the end four.
    assert len(events) == 4 + 4 * 1 + 5 + 4
    done = [e for e in events if e["type"] == "response.output_item.done"]
    assert [(e["output_index"], e["item"]["status"]) for e in done] == [
        (0, "incomplete"),
        (1, "completed"),
    ]
    assert [e["text"] for e in events if e["type"] == "response.output_text.done"] == ["ab", "cd"]
    final = events[-1]
    assert final["type"] == "response.completed"
    assert Response.model_validate(final["response"]).output_text == "cd"


def test_the_numbers_depend_on_the_events_only() -> None:
    """Two gateways (two numberings) give one run's events the same numbers, whatever
    the status the stream opened with."""
    koda = [("chunk", "x"), ("reset", ""), ("chunk", "y")]
    one = play(koda, state("done", "y", resets=1))
    numbering = EventNumbering(RUN, response_object(state("streaming", "x")))
    two = numbering.created()
    for kind, content in koda:
        two += numbering.feed(kind, content)
    two += numbering.end(response_object(state("done", "y", resets=1)))
    assert [(e["sequence_number"], e["type"]) for e in one] == [
        (e["sequence_number"], e["type"]) for e in two
    ]


@pytest.mark.parametrize(
    ("run_status", "error", "shown", "last"),
    [
        ("done", None, "completed", "response.completed"),
        ("failed", "boom", "failed", "response.failed"),
        ("cancelled", None, "cancelled", "response.incomplete"),
        ("failed", "output_bytes: over 1000 bytes", "incomplete", "response.incomplete"),
    ],
)
def test_every_end_is_an_sdk_event(run_status: str, error: str, shown: str, last: str) -> None:
    events = play([("chunk", "a")], state(run_status, "a", error=error))
    for event in events:
        EVENTS.validate_python(event)
    assert events[-1]["type"] == last
    assert events[-1]["response"]["status"] == shown


@pytest.mark.parametrize(
    ("run_status", "shown"),
    [
        ("pending", "queued"),
        ("running", "in_progress"),
        ("streaming", "in_progress"),
        ("done", "completed"),
        ("failed", "failed"),
        ("cancelled", "cancelled"),
    ],
)
def test_response_objects_are_the_sdks_type(run_status: str, shown: str) -> None:
    assert response_status(run_status, None) == shown
    obj = response_object(state(run_status, "so far"))
    parsed = Response.model_validate(obj)
    assert parsed.status == shown and parsed.id == f"resp_{RUN}"
    assert parsed.output_text == "so far" and parsed.metadata == {"k": "v"}
    assert parsed.usage is not None and parsed.usage.total_tokens == 12


def test_ids_map_back_to_runs() -> None:
    assert run_id_of(f"resp_{RUN}") == RUN
    for bad in ("resp_", "run_x", "resp_a b", "resp_" + "x" * 129):
        assert run_id_of(bad) is None


def test_the_demo_model_name_is_the_demo_handlers() -> None:
    assert served_model("demo", "gpt-x") == DEMO_MODEL
    assert served_model("openai", "gpt-x") == "gpt-x"
    assert served_model("echo", "gpt-x") == "echo"


def test_frames_carry_no_id_line() -> None:
    """The SDK's decoder keeps an ``id:`` across events and would then read a later
    keep-alive as an empty event; koda's Responses frames have none."""
    frame = sse_frame({"type": "response.created", "sequence_number": 0})
    assert frame.startswith(b"event: response.created\ndata: {")
    assert b"\nid:" not in frame and frame.endswith(b"\n\n")


# --- requests ------------------------------------------------------------------------------


def test_a_string_input_is_koda_text() -> None:
    req = parse_create({"input": "hello", "model": "m-1", "stream": True}, "m-1")
    assert req.run_input["text"] == "hello" and req.stream and not req.background


def test_messages_and_instructions_become_chat_messages() -> None:
    parts = [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]
    req = parse_create(
        {
            "input": [
                {"role": "developer", "content": "Be terse."},
                {"type": "message", "role": "user", "content": parts},
            ],
            "instructions": "You are koda.",
            "previous_response_id": f"resp_{RUN}",
            "metadata": {"k": "v"},
        },
        "m-1",
    )
    assert req.run_input["messages"] == [
        {"role": "system", "content": "You are koda."},
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "ab"},
    ]
    assert req.run_input[INPUT_KEY]["previous_response_id"] == f"resp_{RUN}"
    assert req.metadata == {"k": "v"}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "x", "temperature": 0.1}, "temperature"),
        ({"input": "x", "tools": None}, "tools"),
        ({"input": "x", "store": False}, "store"),
        ({"input": "x", "model": "gpt-other"}, "model"),
        ({"input": "x", "background": "yes"}, "background"),
        ({"input": "x", "instructions": ["a"]}, "instructions"),
        ({"input": "x", "previous_response_id": "abc"}, "previous_response_id"),
        ({"input": ""}, "input"),
        ({}, "input"),
        ({"input": [{"role": "user", "content": "x", "name": "n"}]}, "input[0].name"),
        ({"input": [{"type": "function_call_output", "role": "user"}]}, "input[0].type"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": [{"role": "assistant", "content": "x"}]}, "input"),
        ({"input": "x", "metadata": {"k": 1}}, "metadata.k"),
        ({"input": "x", "metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ],
)
def test_a_bad_or_unsupported_field_is_named(body: dict[str, Any], param: str) -> None:
    with pytest.raises(RequestError) as refused:
        parse_create(body, "m-1")
    assert refused.value.param == param
    assert refused.value.status == 400


def test_store_true_and_nulls_are_accepted() -> None:
    req = parse_create({"input": "x", "store": True, "metadata": None, "model": None}, "m-1")
    assert req.metadata is None


def test_a_run_waiting_for_a_person_is_still_in_progress() -> None:
    from koda_runtime.gateway.responses_wire import response_status

    assert response_status("waiting", None) == "in_progress"
    assert response_status("pending", None) == "queued"
