"""The openai handler against a local HTTP server speaking the streaming wire format."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from koda.errors import HandlerError
from koda.lifecycle.handler import RunContext, Usage
from processors.handlers.openai import OpenAIHandler

PIECES = ["Hel", "lo", ", ", "wor", "ld"]


class FakeCompletions(BaseHTTPRequestHandler):
    seen: list[dict] = []

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        FakeCompletions.seen.append({"body": body, "auth": self.headers.get("Authorization")})
        if body["model"] == "broken":
            self.send_response(500)
            self.end_headers()
            self.wfile.write(b'{"error": "boom"}')
            return
        if body["model"] in ("cut", "cut-clean"):
            self._cut(clean=body["model"] == "cut-clean")
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for piece in PIECES:
            event = {"choices": [{"index": 0, "delta": {"content": piece}}], "model": "m-1"}
            self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
            self.wfile.flush()
        usage = {
            "choices": [],
            "model": "m-1",
            "usage": {"prompt_tokens": 7, "completion_tokens": 5},
        }
        self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())

    def _cut(self, *, clean: bool) -> None:
        """Stream three pieces, then stop before the usage chunk: a dropped connection
        (chunked encoding left unfinished), or a clean end without ``[DONE]``."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for piece in PIECES[:3]:
            event = {"choices": [{"index": 0, "delta": {"content": piece}}], "model": "cut"}
            data = f"data: {json.dumps(event)}\n\n".encode()
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()
        if clean:
            self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()
        self.close_connection = True

    def log_message(self, *args: object) -> None:
        return


@pytest.fixture
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), FakeCompletions)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


async def collect(handler: OpenAIHandler, inp: dict) -> list:
    ctx = RunContext("r1", "u1", inp, 1)
    return [item async for item in handler.stream(ctx)]


async def test_streams_chunks_and_usage(server: str) -> None:
    handler = OpenAIHandler(base_url=server, api_key="sk-test", model="m-1")
    items = await collect(handler, {"text": "hi"})
    await handler.aclose()
    assert [i for i in items if isinstance(i, str)] == PIECES
    assert [i for i in items if isinstance(i, Usage)] == [Usage("m-1", 7, 5)]
    request = FakeCompletions.seen[-1]
    assert request["auth"] == "Bearer sk-test"
    assert request["body"]["stream"] is True
    assert request["body"]["messages"] == [{"role": "user", "content": "hi"}]


async def test_an_error_status_is_a_handler_error(server: str) -> None:
    handler = OpenAIHandler(base_url=server, api_key=None, model="broken")
    with pytest.raises(HandlerError, match="500"):
        await collect(handler, {"text": "hi"})
    await handler.aclose()


async def test_an_unreachable_endpoint_is_a_handler_error() -> None:
    handler = OpenAIHandler(base_url="http://127.0.0.1:9", api_key=None, model="m")
    with pytest.raises(HandlerError, match="model endpoint failed"):
        await collect(handler, {"text": "hi"})
    await handler.aclose()


@pytest.mark.parametrize("model", ["cut", "cut-clean"])
async def test_a_stream_cut_before_usage_is_billed_estimated_then_fails(
    server: str, model: str
) -> None:
    """The LiteLLM failure mode: a stream that never reaches its usage chunk must not be
    free. The handler counts what it streamed, says it is an estimate, then fails."""
    handler = OpenAIHandler(base_url=server, api_key=None, model=model)
    ctx = RunContext("r1", "u1", {"text": "count me please"}, 1)
    items: list = []
    with pytest.raises(HandlerError, match="model endpoint failed|before \\[DONE\\]"):
        async for item in handler.stream(ctx):
            items.append(item)
    await handler.aclose()
    assert [i for i in items if isinstance(i, str)] == PIECES[:3]
    # 15 characters of prompt at ~4 per token; one completion token per piece streamed.
    assert items[-1] == Usage(model, 4, 3, estimated=True)


# --- a scripted model that calls tools -------------------------------------------------
#
# Speaks the chat completions wire format, streamed tool calls included: a call's first
# delta carries index, id and name, the following deltas only the index and pieces of
# the arguments. The script for model "tools-2" is: turn 1 says a few words and calls
# memory_search("home city"); turn 2 calls memory_search("name of the dog", limit 50)
# then, answered with the validation error, the model's third turn calls it right;
# the last turn answers. Model "tools-forever" asks for a tool in every turn. A request
# with `response_format` is the distillation call and gets the statements.


def _sse(obj: dict) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def _tool_call_events(call_id: str, index: int, arguments: str) -> list[dict]:
    head = {"index": index, "id": call_id, "type": "function"}
    head["function"] = {"name": "memory_search", "arguments": ""}
    events = [{"choices": [{"index": 0, "delta": {"tool_calls": [head]}}]}]
    for start in range(0, len(arguments), 7):  # the arguments arrive in pieces
        piece = {"index": index, "function": {"arguments": arguments[start : start + 7]}}
        events.append({"choices": [{"index": 0, "delta": {"tool_calls": [piece]}}]})
    events.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]})
    return events


TOOL_SCRIPT = [
    ("Let me look. ", '{"query": "user\'s home city"}'),
    ("", '{"query": "name of the dog", "limit": 50}'),
    ("", '{"query": "name of the dog", "limit": 3}'),
]
FINAL_ANSWER = ["You live ", "in Lisbon ", "and your dog ", "is Bolt."]
DISTILLED = ["The user is learning to play the cello."]


class ScriptedModel(BaseHTTPRequestHandler):
    seen: list[dict] = []

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        ScriptedModel.seen.append(body)
        usage = {"prompt_tokens": 11, "completion_tokens": 3}
        if self.path == "/v1/embeddings":
            self._embeddings(body)
            return
        if "response_format" in body and body["model"] == "bad-distil":
            content = "Sorry, here are the facts: the user likes tea."  # not the JSON asked
            answer = {
                "model": "m-tools",
                "choices": [{"index": 0, "message": {"content": content}}],
            }
            answer["usage"] = usage
            payload = json.dumps(answer).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
            return
        if "response_format" in body:
            answer = {
                "model": "m-tools",
                "choices": [
                    {
                        "index": 0,
                        "message": {
                            "role": "assistant",
                            "content": json.dumps({"statements": DISTILLED}),
                        },
                    }
                ],
                "usage": usage,
            }
            payload = json.dumps(answer).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
            return
        turn = sum(1 for m in body["messages"] if m["role"] == "tool")
        events: list[dict] = []
        if body["model"] == "tools-forever":
            events += _tool_call_events(f"call_{turn}", 0, '{"query": "anything"}')
        elif turn < len(TOOL_SCRIPT):
            text, arguments = TOOL_SCRIPT[turn]
            if text:
                events.append({"choices": [{"index": 0, "delta": {"content": text}}]})
            events += _tool_call_events(f"call_{turn}", 0, arguments)
        else:
            for piece in FINAL_ANSWER:
                events.append({"choices": [{"index": 0, "delta": {"content": piece}}]})
        events.append({"choices": [], "model": "m-tools", "usage": usage})
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for event in events:
            self.wfile.write(_sse(event))
            self.wfile.flush()
        self.wfile.write(b"data: [DONE]\n\n")

    def _embeddings(self, body: dict) -> None:
        """Deterministic 256-d vectors (unnormalised, in reverse order, as a server may
        send them); model "emb-broken" answers 503."""
        if body["model"] == "emb-broken":
            self.send_response(503)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        data = [
            {"index": i, "embedding": [float((len(t) + k) % 7) + 1.0 for k in range(256)]}
            for i, t in enumerate(body["input"])
        ]
        answer = {"model": body["model"], "data": data[::-1], "usage": {"prompt_tokens": 9}}
        payload = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args: object) -> None:
        return


def serve_scripted_model() -> tuple[str, ThreadingHTTPServer]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), ScriptedModel)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{httpd.server_address[1]}", httpd
