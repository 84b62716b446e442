"""The AI SDK's ``useChat`` against koda (gateway/chat.py), in headless Chromium.

The page (tests/e2e/chat_page/app.jsx) uses the real ``ai`` and ``@ai-sdk/react`` from
npm, pinned by the committed package-lock.json: ``npm ci`` runs once per lock file into
build/chat_page/<hash of the lock>/, then esbuild bundles the page. The test serves it
on the gateway's own origin (Playwright answers /chat-test/), so the page calls
/v1/chat like any same-origin app.

One stack for the module: a gateway process and one worker with the openai handler,
talking to a local OpenAI-wire model (tests/fixtures/model_server.py's scripted tool
model, plus slow answers for a message starting ``[slow N]``: N pieces, 100 ms apart).
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from io import BytesIO
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import Browser, Page, Route, sync_playwright

from koda_runtime.schemas.migrate import upgrade
from koda_runtime.settings import Settings
from koda_runtime.topics.admin import apply_topics
from tests.fixtures.model_server import (
    FINAL_ANSWER,
    TOOL_SCRIPT,
    ScriptedModel,
    serve_model,
)
from tests.fixtures.namespaces import delete_topics, drop_schema, make_settings
from tests.fixtures.processes import ROOT, GatewayProcess, WorkerProcess
from tests.fixtures.runs import Submitter
from tests.support import wait_until

CHROMIUM = Path("/usr/bin/chromium")
PAGE_SRC = Path(__file__).parent / "chat_page"
PAGE_PATH = "/chat-test/"
SLOW = re.compile(r"^\[slow (\d+)\] ")
PIECE_DELAY_S = 0.1
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run"]


def slow_pieces(n: int) -> list[str]:
    return [f"w{i} " for i in range(n)]


class ChatModel(ScriptedModel):
    """ScriptedModel, except that a last user message ``[slow N] ...`` is answered with
    :func:`slow_pieces` one every PIECE_DELAY_S (a stopped run just hangs up)."""

    def do_POST(self) -> None:  # noqa: N802
        raw = self.rfile.read(int(self.headers["Content-Length"]))
        body = json.loads(raw)
        users = [m["content"] for m in body.get("messages", []) if m.get("role") == "user"]
        slow = SLOW.match(users[-1]) if users and "response_format" not in body else None
        if self.path == "/v1/embeddings" or slow is None:
            self.rfile = BytesIO(raw)
            super().do_POST()
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        try:
            for piece in slow_pieces(int(slow.group(1))):
                delta = {"choices": [{"index": 0, "delta": {"content": piece}}]}
                self.wfile.write(f"data: {json.dumps(delta)}\n\n".encode())
                self.wfile.flush()
                time.sleep(PIECE_DELAY_S)
            usage = {"prompt_tokens": 5, "completion_tokens": 5}
            self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")
        except OSError:
            pass  # the worker hung up: the run was stopped


# --- the page -------------------------------------------------------------------------

_BUILD_LOCK = threading.Lock()


def build_page() -> Path:
    """The bundled page's directory: ``npm ci`` once per lock file, then esbuild."""
    lock = (PAGE_SRC / "package-lock.json").read_bytes()
    out = ROOT / "build" / "chat_page" / hashlib.sha256(lock).hexdigest()[:16]
    with _BUILD_LOCK:
        if not (out / "node_modules" / ".bin" / "esbuild").exists():
            if shutil.which("npm") is None:
                pytest.fail("npm is missing: run `make system-deps` (apt-get install npm)")
            out.mkdir(parents=True, exist_ok=True)
            for name in ("package.json", "package-lock.json"):
                shutil.copy(PAGE_SRC / name, out / name)
            subprocess.run(  # noqa: S603
                ["npm", "ci", "--no-audit", "--no-fund"],  # noqa: S607
                cwd=out,
                check=True,
                capture_output=True,
                timeout=600,
            )
        shutil.copy(PAGE_SRC / "app.jsx", out / "app.jsx")
        subprocess.run(  # noqa: S603
            [
                str(out / "node_modules" / ".bin" / "esbuild"),
                "app.jsx",
                "--bundle",
                "--format=iife",
                "--jsx=automatic",
                '--define:process.env.NODE_ENV="production"',
                "--outfile=bundle.js",
            ],
            cwd=out,
            check=True,
            capture_output=True,
            timeout=120,
        )
    return out


INDEX = b"""<!doctype html><html><head><meta charset="utf-8"><title>chat</title></head>
<body><div id="root"></div><script src="bundle.js"></script></body></html>"""


# --- the stack --------------------------------------------------------------------------


class Stack:
    def __init__(self, settings: Settings, model_url: str) -> None:
        self.settings = settings
        self.sub = Submitter(settings)
        self.gateway = GatewayProcess(settings, {"KODA_SSE_KEEPALIVE": "0.5"}).start()
        self.worker = WorkerProcess(
            settings,
            "chat-w1",
            {
                "KODA_HANDLER": "openai",
                "KODA_OPENAI_BASE_URL": model_url,
                "KODA_MAX_TOOL_TURNS": "5",
            },
        ).start()

    def runs_of(self, chat_id: str) -> list[Any]:
        return self.sub.query(
            "SELECT id, status, user_id FROM runs WHERE session_id = :s ORDER BY created_at",
            s=chat_id,
        )

    def ended(self, run_id: str, timeout: float = 90) -> str:
        def terminal() -> bool:
            assert self.worker.alive(), self.worker.log()[-3000:]
            return self.sub.all_terminal([run_id])

        wait_until(terminal, timeout=timeout, interval=0.2, what=f"run {run_id} terminal")
        return self.sub.statuses([run_id])[run_id]


@pytest.fixture(scope="module")
def chat_stack(stack: Any) -> Iterator[Stack]:
    settings = make_settings(stack)
    apply_topics(settings)
    upgrade(settings)
    url, httpd = serve_model(ChatModel)
    s = Stack(settings, url)
    try:
        yield s
    finally:
        s.worker.stop()
        s.gateway.stop()
        s.sub.close()
        httpd.shutdown()
        httpd.server_close()
        delete_topics(settings)
        drop_schema(settings)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if not CHROMIUM.exists():
        pytest.fail("chromium is missing: run `make system-deps` (apt-get install chromium)")
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=ARGS)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture(scope="module")
def page_dir() -> Path:
    return build_page()


class ChatPage:
    """The bundled page for one chat and user, on the gateway's origin."""

    def __init__(self, browser: Browser, stack: Stack, page_dir: Path, user: str) -> None:
        self.chat_id = f"chat-{user}-{int(time.time() * 1000)}"
        self.context = browser.new_context()
        self.errors: list[str] = []
        self.requests: list[str] = []
        bundle = (page_dir / "bundle.js").read_bytes()

        def serve(route: Route) -> None:
            if route.request.url.split("?")[0].endswith("bundle.js"):
                route.fulfill(body=bundle, content_type="text/javascript")
            else:
                route.fulfill(body=INDEX, content_type="text/html")

        self.context.route(f"{stack.gateway.url}{PAGE_PATH}**", serve)
        self.page: Page = self.context.new_page()
        self.page.on("pageerror", lambda e: self.errors.append(f"pageerror: {e}"))
        self.page.on(
            "request",
            lambda r: self.requests.append(f"{r.method} {r.url.removeprefix(stack.gateway.url)}"),
        )
        self.url = f"{stack.gateway.url}{PAGE_PATH}?chat={self.chat_id}&token=dev:{user}"
        self.page.goto(self.url)
        self.page.wait_for_function("window.chat !== undefined")

    def send(self, text: str) -> None:
        self.page.fill("#message", text)
        self.page.click("#send")

    def state(self) -> dict[str, Any]:
        state: dict[str, Any] = self.page.evaluate("window.chat")
        return state

    def answer(self) -> str:
        """The last assistant message's text: its text parts after its last reset."""
        messages = [m for m in self.state()["messages"] if m["role"] == "assistant"]
        if not messages:
            return ""
        parts = messages[-1]["parts"]
        resets = [i for i, p in enumerate(parts) if p["type"] == "data-koda-reset"]
        start = resets[-1] + 1 if resets else 0
        return "".join(p["text"] for p in parts[start:] if p["type"] == "text")

    def wait(self, condition: str, timeout_s: float = 60) -> None:
        self.page.wait_for_function(condition, timeout=timeout_s * 1000)

    def close(self) -> None:
        self.context.close()


@pytest.fixture
def chat_page(browser: Browser, chat_stack: Stack, page_dir: Path) -> Iterator[ChatPage]:
    opened: list[ChatPage] = []

    def open_page(user: str) -> ChatPage:
        page = ChatPage(browser, chat_stack, page_dir, user)
        opened.append(page)
        return page

    yield open_page  # type: ignore[misc]
    for p in opened:
        assert p.errors == [], p.errors
        p.close()


ASSISTANT_TEXT = (
    "(() => { const m = window.chat.messages.filter(m => m.role === 'assistant').at(-1);"
    " return m ? m.parts.filter(p => p.type === 'text').map(p => p.text).join('') : ''; })()"
)


# --- the tests --------------------------------------------------------------------------


def test_a_message_streams_and_a_reload_resumes_it_without_gap_or_repeat(
    chat_stack: Stack, chat_page: Any
) -> None:
    page: ChatPage = chat_page("ana")
    page.send("[slow 60] tell me a story")
    # It streams: part of the answer is on the page while the run is still going.
    page.wait(f"{ASSISTANT_TEXT}.split(' ').length > 6 && window.chat.status === 'streaming'")
    (run,) = chat_stack.runs_of(page.chat_id)
    assert run.user_id == "ana" and run.status in ("running", "streaming")
    message_ids = [m["id"] for m in page.state()["messages"] if m["role"] == "assistant"]
    assert message_ids == [run.id]  # the assistant message is the run
    # useChat's resume on load: GET <api>/<chat id>/stream, answered with the running answer.
    resume_url = f"{chat_stack.gateway.url}/v1/chat/{page.chat_id}/stream"
    with page.page.expect_request(lambda r: r.method == "GET" and r.url == resume_url):
        page.page.reload()
    page.wait("window.chat !== undefined")
    assert chat_stack.ended(run.id) == "done"
    page.wait("window.chat.status === 'ready'")
    expected = "".join(slow_pieces(60))
    assert chat_stack.sub.output(run.id) == expected
    assert page.answer() == expected  # exactly the run's output: no gap, no repeat
    state = page.state()
    assert [m["id"] for m in state["messages"]] == [run.id]
    assert state["error"] is None
    # Nothing running any more: the reconnect URL answers 204, and useChat stays ready.
    page.page.reload()
    page.wait("window.chat !== undefined && window.chat.status === 'ready'")
    response = httpx.get(
        f"{chat_stack.gateway.url}/v1/chat/{page.chat_id}/stream",
        headers={"Authorization": "Bearer dev:ana"},
    )
    assert response.status_code == 204


def test_stop_cancels_the_run(chat_stack: Stack, chat_page: Any) -> None:
    page: ChatPage = chat_page("bea")
    page.send("[slow 400] a very long answer")
    page.wait(f"{ASSISTANT_TEXT}.split(' ').length > 3")
    (run,) = chat_stack.runs_of(page.chat_id)
    page.page.click("#stop")
    assert chat_stack.ended(run.id) == "cancelled"
    page.wait("window.chat.status === 'ready'")
    assert f"DELETE /v1/chat/{page.chat_id}/stream?message_id={run.id}" in page.requests
    # The page keeps what had streamed, a prefix of what the run said before it stopped.
    assert chat_stack.sub.output(run.id).startswith(page.answer())
    assert page.answer().startswith("w0 w1 w2 ")


def test_a_tool_call_shows_as_a_tool_part(chat_stack: Stack, chat_page: Any) -> None:
    page: ChatPage = chat_page("cai")
    page.send("Where do I live, and what is my dog's name?")
    page.wait("window.chat.status === 'ready' && window.chat.messages.length === 2", 90)
    (run,) = chat_stack.runs_of(page.chat_id)
    assert chat_stack.ended(run.id) == "done"
    assistant = page.state()["messages"][-1]
    tools = [p for p in assistant["parts"] if p["type"] == "dynamic-tool"]
    assert [(t["toolName"], t["toolCallId"], t["state"]) for t in tools] == [
        ("memory_search", f"call_{i}", "output-available") for i in range(3)
    ]
    assert tools[0]["input"] == json.loads(TOOL_SCRIPT[0][1])
    assert isinstance(tools[0]["output"], str)
    assert page.answer() == TOOL_SCRIPT[0][0] + "".join(FINAL_ANSWER)
    # The text before the call and the answer after it are two text parts around it.
    kinds = [p["type"] for p in assistant["parts"] if p["type"] in ("text", "dynamic-tool")]
    assert kinds == ["text", "dynamic-tool", "dynamic-tool", "dynamic-tool", "text"]
    assert page.page.locator(".tool").count() == 3


# --- the protocol over plain HTTP (same stack) ------------------------------------------


def _post(stack: Stack, user: str, body: Any) -> httpx.Response:
    return httpx.post(
        f"{stack.gateway.url}/v1/chat",
        headers={"Authorization": f"Bearer dev:{user}"},
        json=body,
        timeout=60,
    )


def _message(text: str, message_id: str) -> dict[str, Any]:
    return {"id": message_id, "role": "user", "parts": [{"type": "text", "text": text}]}


def _parts(body: str) -> list[Any]:
    frames = [line[len("data: ") :] for line in body.splitlines() if line.startswith("data: ")]
    assert frames[-1] == "[DONE]", frames[-3:]
    return [json.loads(f) for f in frames[:-1]]


def test_the_protocol_answers_and_refuses_over_http(chat_stack: Stack) -> None:
    chat_id = f"http-chat-{int(time.time() * 1000)}"
    body = {"id": chat_id, "messages": [_message("hello there", "m1")], "trigger": "submit-message"}
    first = _post(chat_stack, "dan", body)
    assert first.status_code == 200, first.text
    assert first.headers["x-vercel-ai-ui-message-stream"] == "v1"
    assert first.headers["content-type"].startswith("text/event-stream")
    parts = _parts(first.text)
    (run,) = chat_stack.runs_of(chat_id)
    assert parts[0] == {"type": "start", "messageId": run.id}
    assert [p["type"] for p in parts][-2:] == ["text-end", "finish"]
    text = "".join(p["delta"] for p in parts if p["type"] == "text-delta")
    assert text == chat_stack.sub.output(run.id) == TOOL_SCRIPT[0][0] + "".join(FINAL_ANSWER)
    # The same message again (a resend) is the same run, replayed.
    again = _post(chat_stack, "dan", body)
    assert _parts(again.text)[0] == {"type": "start", "messageId": run.id}
    assert len(chat_stack.runs_of(chat_id)) == 1
    # Another user's chat id is unknown to them, for sending and resuming alike.
    other = _post(chat_stack, "eve", {**body, "messages": [_message("hi", "m9")]})
    assert other.status_code == 404 and other.json()["error"]["field"] == "id"
    resume = httpx.get(
        f"{chat_stack.gateway.url}/v1/chat/{chat_id}/stream",
        headers={"Authorization": "Bearer dev:eve"},
    )
    assert resume.status_code == 404
    # Bad requests name the field.
    regenerate = _post(chat_stack, "dan", {**body, "trigger": "regenerate-message"})
    assert regenerate.status_code == 422 and regenerate.json()["error"]["field"] == "trigger"
    assistant_last = {**body, "messages": [{**_message("x", "m2"), "role": "assistant"}]}
    refused = _post(chat_stack, "dan", assistant_last)
    assert refused.json()["error"]["field"] == "messages[0].role"
    unknown = _post(chat_stack, "dan", {**body, "temperature": 2})
    assert unknown.status_code == 422 and unknown.json()["error"]["field"] == "temperature"
    unauthenticated = httpx.post(f"{chat_stack.gateway.url}/v1/chat", json=body)
    assert unauthenticated.status_code == 401


def test_a_message_sent_while_the_answer_runs_is_merged_into_it(chat_stack: Stack) -> None:
    chat_id = f"merge-chat-{int(time.time() * 1000)}"
    results: dict[str, httpx.Response] = {}

    def send(key: str, text: str, message_id: str) -> None:
        results[key] = _post(
            chat_stack, "fay", {"id": chat_id, "message": _message(text, message_id)}
        )

    first = threading.Thread(target=send, args=("first", "[slow 30] first question", "m1"))
    first.start()
    wait_until(
        lambda: [r.status for r in chat_stack.runs_of(chat_id)] == ["streaming"],
        what="the first answer streaming",
    )
    send("second", "and a second one", "m2")
    first.join(90)
    (run,) = chat_stack.runs_of(chat_id)  # merged: still one run
    assert chat_stack.ended(run.id) == "done"
    expected = chat_stack.sub.output(run.id)
    assert expected == "".join(slow_pieces(30))
    for key in ("first", "second"):
        parts = _parts(results[key].text)
        assert parts[0] == {"type": "start", "messageId": run.id}, key
        assert parts[-1] == {"type": "finish", "finishReason": "stop"}, key
        resets = [i for i, p in enumerate(parts) if p["type"] == "data-koda-reset"]
        after = parts[resets[-1] + 1 :] if resets else parts
        answer = "".join(p["delta"] for p in after if p["type"] == "text-delta")
        assert answer == expected, key
    # The first stream saw the draft it dropped: a reset part, then the new answer.
    assert any(p["type"] == "data-koda-reset" for p in _parts(results["first"].text))
