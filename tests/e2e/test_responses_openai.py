"""The official ``openai`` package against koda's Responses API subset (gateway/responses.py).

One namespace, one in-process gateway and one worker process with the openai handler for
the module; the worker's model is :class:`PacedModel` below, a local server speaking the
chat completions wire format that streams as many pieces, as slowly, as the user's last
message asks, and records every request it gets.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from typing import Any

import openai
import pytest
from openai import OpenAI
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from koda_runtime.gateway.app import create_app
from koda_runtime.localstack import StackInfo
from koda_runtime.settings import Settings
from tests.fixtures.gateway import db_rows, serve_app
from tests.fixtures.model_server import serve_model
from tests.fixtures.namespaces import make_settings, prepared_namespace
from tests.fixtures.processes import WorkerProcess
from tests.support import wait_until

MODEL = "m-responses"
EVENTS = TypeAdapter(ResponseStreamEvent)


class PacedModel(BaseHTTPRequestHandler):
    """``[pieces:N]`` (default 5) and ``[delay_ms:D]`` (default 0) in the last user
    message shape the answer, piece i being ``w<i> ``; ``[hang]`` streams a piece every
    50 ms until the client goes away (at most 2 minutes); ``[cut_once]`` ends the first
    request for that message after 3 pieces, without usage or ``[DONE]`` (a cut stream:
    the worker tries the run again, which starts over with a ``reset``)."""

    seen: list[dict[str, Any]] = []
    cut: set[str] = set()
    lock = threading.Lock()

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with PacedModel.lock:
            PacedModel.seen.append(body)
        said = next((m["content"] for m in reversed(body["messages"]) if m["role"] == "user"), "")
        pieces = int(_marker(said, "pieces", 5))
        delay = _marker(said, "delay_ms", 0) / 1000.0
        if "[hang]" in said:
            pieces, delay = 2400, 0.05
        with PacedModel.lock:
            cut_now = "[cut_once]" in said and said not in PacedModel.cut
            PacedModel.cut.add(said)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        try:
            for i in range(pieces):
                if delay:
                    time.sleep(delay)
                piece = {"choices": [{"index": 0, "delta": {"content": f"w{i} "}}]}
                self.wfile.write(f"data: {json.dumps(piece)}\n\n".encode())
                self.wfile.flush()
                if cut_now and i == 2:
                    return
            usage = {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": pieces}}
            self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        except OSError:
            return  # the worker hung up (a cancel)

    def log_message(self, *args: object) -> None:
        return


def _marker(text: str, name: str, default: float) -> float:
    found = re.search(rf"\[{name}:(\d+)\]", text)
    return float(found.group(1)) if found else default


def answer(pieces: int) -> str:
    return "".join(f"w{i} " for i in range(pieces))


@pytest.fixture(scope="module")
def model_url() -> Iterator[str]:
    url, httpd = serve_model(PacedModel)
    yield url
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(scope="module")
def settings(stack: StackInfo, model_url: str) -> Iterator[Settings]:
    base = make_settings(
        stack,
        rate_per_s=1000.0,
        rate_burst=1000,
        handler="openai",
        openai_model=MODEL,
        openai_base_url=model_url,
        memory_enabled=False,
    )
    with prepared_namespace(base):
        yield base


@pytest.fixture(scope="module")
def gateway(settings: Settings, model_url: str) -> Iterator[str]:
    worker = WorkerProcess(
        settings,
        "w-responses",
        {"KODA_OPENAI_BASE_URL": model_url, "KODA_OPENAI_MODEL": MODEL, "KODA_MEMORY": "false"},
    ).start()
    try:
        with serve_app(create_app(settings)) as url:
            yield url
    finally:
        worker.stop()


def sdk(gateway: str, user: str) -> OpenAI:
    """The official client on koda: base URL and a koda token as the API key."""
    return OpenAI(base_url=f"{gateway}/v1", api_key=f"dev:{user}", max_retries=0)


def run_of(resp_id: str) -> str:
    assert resp_id.startswith("resp_")
    return resp_id.removeprefix("resp_")


def strict(event: Any) -> None:
    """The event as sent validates against the SDK's own types (not only leniently)."""
    EVENTS.validate_python(event.model_dump(mode="json", exclude_unset=True))


def test_a_cut_stream_resumes_with_exactly_the_rest(gateway: str, settings: Settings) -> None:
    client = sdk(gateway, "ada")
    first: list[Any] = []
    stream = client.responses.create(
        model=MODEL, input="count [pieces:40] [delay_ms:25]", background=True, stream=True
    )
    for event in stream:
        strict(event)
        first.append(event)
        if len(first) == 6:
            break
    stream.close()  # the client's connection drops mid-answer
    assert first[0].type == "response.created"
    resp_id = first[0].response.id
    assert [e.sequence_number for e in first] == list(range(6))

    rest = list(
        client.responses.retrieve(resp_id, stream=True, starting_after=first[-1].sequence_number)
    )
    for event in rest:
        strict(event)
    numbers = [e.sequence_number for e in first + rest]
    assert numbers == list(range(len(numbers))), "contiguous, no gap and no repeat"
    assert rest[-1].type == "response.completed"
    deltas = "".join(e.delta for e in first + rest if e.type == "response.output_text.delta")
    final = rest[-1].response
    assert deltas == answer(40) == final.output_text
    assert final.status == "completed" and final.id == resp_id
    (row,) = db_rows(
        settings,
        "SELECT status, (SELECT string_agg(content, '' ORDER BY seq) FROM messages"
        " WHERE run_id = :r AND kind = 'chunk') FROM runs WHERE id = :r",
        r=run_of(resp_id),
    )
    assert tuple(row) == ("done", deltas)

    # A resume after the last event has nothing left to send.
    assert list(client.responses.retrieve(resp_id, stream=True, starting_after=numbers[-1])) == []


def test_a_retried_run_shows_its_partial_answer_as_an_incomplete_message(
    gateway: str,
) -> None:
    """A run that starts over (koda's ``reset``) closes the partial message ``incomplete``
    and streams the answer in a new one; the response's output is the new one only."""
    client = sdk(gateway, "abe")
    events: list[Any] = list(client.responses.create(input="[cut_once] [pieces:6]", stream=True))
    for event in events:
        strict(event)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    closed = [e for e in events if e.type == "response.output_item.done"]
    statuses = [(e.output_index, e.item.status) for e in closed]
    assert statuses == [(0, "incomplete"), (1, "completed")]
    assert closed[0].item.content[0].text == answer(3)
    final = events[-1].response
    assert events[-1].type == "response.completed"
    assert final.output_text == answer(6) and len(final.output) == 1
    assert final.output[0].id == closed[1].item.id


def test_background_polls_to_completion(gateway: str) -> None:
    client = sdk(gateway, "bea")
    created = client.responses.create(
        model=MODEL, input="[pieces:8] [delay_ms:20]", background=True, metadata={"k": "v"}
    )
    assert created.status in ("queued", "in_progress") and created.background is True

    def done() -> Any:
        got = client.responses.retrieve(created.id)
        return got if got.status == "completed" else None

    final = wait_until(done, timeout=30, what="the response completed")
    assert final.output_text == answer(8)
    assert final.metadata == {"k": "v"} and final.model == MODEL
    assert final.usage is not None
    assert (final.usage.input_tokens, final.usage.output_tokens) == (7, 8)


def test_cancelling_a_running_response(gateway: str, settings: Settings) -> None:
    client = sdk(gateway, "cid")
    created = client.responses.create(model=MODEL, input="go on [hang]", background=True)

    def streaming() -> bool:
        got = client.responses.retrieve(created.id)
        return got.status == "in_progress" and bool(got.output_text)

    wait_until(streaming, timeout=30, what="the response streaming")
    # A conversation is continued once its response has ended, not while it runs.
    with pytest.raises(openai.BadRequestError) as running:
        client.responses.create(input="and?", previous_response_id=created.id)
    assert running.value.param == "previous_response_id"
    assert running.value.code == "previous_response_in_progress"
    cancelled = client.responses.cancel(created.id)
    assert cancelled.status == "cancelled" and cancelled.id == created.id
    (row,) = db_rows(settings, "SELECT status FROM runs WHERE id = :r", r=run_of(created.id))
    assert row[0] == "cancelled"
    # Its stream ends with the answer so far, closed incomplete, and the cancelled status.
    events: list[Any] = list(client.responses.retrieve(created.id, stream=True))
    assert events[-2].type == "response.output_item.done"
    assert events[-2].item.status == "incomplete"
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.status == "cancelled"
    assert client.responses.cancel(created.id).status == "cancelled"  # idempotent


def test_previous_response_id_continues_the_conversation(gateway: str) -> None:
    client = sdk(gateway, "dee")
    one = client.responses.create(model=MODEL, input="My name is Dee. [pieces:3]")
    assert one.status == "completed" and one.output_text == answer(3)
    two = client.responses.create(
        input="What is my name? [pieces:2]",
        instructions="Answer briefly.",
        previous_response_id=one.id,
    )
    assert two.status == "completed" and two.previous_response_id == one.id
    assert two.instructions == "Answer briefly."
    request = next(
        b for b in reversed(PacedModel.seen) if b["messages"][-1]["content"].startswith("What")
    )
    assert request["messages"] == [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "My name is Dee. [pieces:3]"},
        {"role": "assistant", "content": answer(3)},
        {"role": "user", "content": "What is my name? [pieces:2]"},
    ]
    # koda conversations are linear: a branch from an older response is refused.
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(input="And again?", previous_response_id=one.id)
    assert refused.value.param == "previous_response_id"
    assert two.id in refused.value.message
    # Another user's response is not a conversation to continue.
    with pytest.raises(openai.BadRequestError) as foreign:
        sdk(gateway, "eve").responses.create(input="hi", previous_response_id=two.id)
    assert foreign.value.param == "previous_response_id"


@pytest.mark.parametrize(
    ("field", "value"),
    [("temperature", 0.2), ("tools", []), ("store", False), ("model", "gpt-nope")],
)
def test_an_unsupported_field_is_refused_by_name(gateway: str, field: str, value: Any) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        sdk(gateway, "fay").responses.create(input="hi", **{field: value})
    assert refused.value.param == field
    assert field in refused.value.message


def test_another_users_response_is_not_found(gateway: str) -> None:
    mine = sdk(gateway, "gus").responses.create(model=MODEL, input="[pieces:1]", background=True)
    other = sdk(gateway, "hal")
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError):
        list(other.responses.retrieve(mine.id, stream=True))
    with pytest.raises(openai.NotFoundError):
        other.responses.cancel(mine.id)
