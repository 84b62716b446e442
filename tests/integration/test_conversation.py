"""Every run sees its session: what a local OpenAI-wire model server RECEIVES.

End to end: the gateway in-process, one ``koda worker`` process with the openai handler
(memory off, a 200-token context budget), real Kafka and PostgreSQL, and a model
server in this module that records every request. The cases: a three-turn
conversation, a merged turn, a cancelled turn (cut marker), a session longer than the
budget (oldest dropped, counted with the ledger's tokens), and two sessions of one
user that never see each other.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from typing import Any

import httpx
import pytest

from koda_runtime.lifecycle.turns import CUT_MARK
from koda_runtime.settings import Settings
from tests.fixtures.model_server import serve_model
from tests.fixtures.processes import WorkerProcess
from tests.sse_client import bearer
from tests.support import wait_until

BUDGET = 200
LONG_ANSWER = "L" * 400  # ~100 tokens by estimate; the model reports 5


class RecordingModel(BaseHTTPRequestHandler):
    """Answers ``You said: <last user message>``, streamed; records each request body.

    A last message containing ``[long]`` is answered with :data:`LONG_ANSWER` and a
    reported 5 completion tokens; ``[slow]`` streams 30 pieces 0.1 s apart; ``[hang]``
    streams a piece every 0.05 s until the client goes away (at most 60 s).
    """

    seen: list[dict[str, Any]] = []
    lock = threading.Lock()

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with RecordingModel.lock:
            RecordingModel.seen.append(body)
        last = str(body["messages"][-1]["content"])
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        completion = 6
        try:
            if "[long]" in last:
                pieces, delay, completion = [LONG_ANSWER[:200], LONG_ANSWER[200:]], 0.0, 5
            elif "[slow]" in last:
                pieces, delay = [f"w{i} " for i in range(30)], 0.1
            elif "[hang]" in last:
                pieces, delay = [f"p{i} " for i in range(1200)], 0.05
            else:
                pieces, delay = ["You said: ", last], 0.0
            for piece in pieces:
                event = {"choices": [{"index": 0, "delta": {"content": piece}}], "model": "rec-1"}
                self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
                self.wfile.flush()
                if delay:
                    time.sleep(delay)
            prompt = sum(len(str(m["content"])) for m in body["messages"]) // 4
            usage = {"prompt_tokens": prompt, "completion_tokens": completion}
            tail = {"choices": [], "model": "rec-1", "usage": usage}
            self.wfile.write(f"data: {json.dumps(tail)}\n\ndata: [DONE]\n\n".encode())
        except (BrokenPipeError, ConnectionResetError):
            return  # the worker stopped reading: a cancel or a merge

    def log_message(self, *args: object) -> None:
        return


def sent_for(last_user_text: str) -> list[dict[str, str]]:
    """The messages of the last request whose final message is ``last_user_text``."""
    with RecordingModel.lock:
        for body in reversed(RecordingModel.seen):
            if body["messages"][-1]["content"] == last_user_text:
                return [{"role": m["role"], "content": m["content"]} for m in body["messages"]]
    raise AssertionError(f"the model never received {last_user_text!r}")


@pytest.fixture(scope="module")
def model_url() -> Iterator[str]:
    url, httpd = serve_model(RecordingModel)
    yield url
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(scope="module")
def worker(module_env: Settings, model_url: str) -> Iterator[WorkerProcess]:
    w = WorkerProcess(
        module_env,
        "conv-w1",
        {
            "KODA_HANDLER": "openai",
            "KODA_OPENAI_BASE_URL": model_url,
            "KODA_MEMORY": "false",
            "KODA_CONTEXT_TOKENS": str(BUDGET),
        },
    ).start()
    yield w
    w.stop()


class Chat:
    """One user talking to the gateway."""

    def __init__(self, client: httpx.Client, user: str, worker: WorkerProcess) -> None:
        self.client = client
        self.user = user
        self.worker = worker

    def post(self, session: str, text: str) -> dict[str, Any]:
        r = self.client.post(
            "/v1/runs",
            json={"session_id": session, "input": text, "client_message_id": uuid.uuid4().hex},
            headers=bearer(self.user),
        )
        assert r.status_code == 202, r.text
        accepted: dict[str, Any] = r.json()
        return accepted

    def run(self, run_id: str) -> dict[str, Any]:
        r = self.client.get(f"/v1/runs/{run_id}", headers=bearer(self.user))
        assert r.status_code == 200, r.text
        run: dict[str, Any] = r.json()
        return run

    def ended(self, run_id: str) -> dict[str, Any]:
        def terminal() -> dict[str, Any] | None:
            assert self.worker.alive(), self.worker.log()[-3000:]
            run = self.run(run_id)
            return run if run["status"] in ("done", "failed", "cancelled") else None

        return wait_until(terminal, timeout=90, interval=0.1, what=f"run {run_id} ended")

    def say(self, session: str, text: str) -> str:
        """Send ``text``, wait for the answer; the run must end done."""
        run = self.ended(self.post(session, text)["run_id"])
        assert run["status"] == "done", (run, self.worker.log()[-3000:])
        return str(run["output"])


@pytest.fixture
def chat(client: httpx.Client, worker: WorkerProcess) -> Chat:
    return Chat(client, f"conv-{uuid.uuid4().hex[:8]}", worker)


def session() -> str:
    return f"conv-{uuid.uuid4().hex[:12]}"


def test_a_three_turn_conversation_is_sent_whole_oldest_first(chat: Chat) -> None:
    s = session()
    first = chat.say(s, "my name is Ada")
    assert sent_for("my name is Ada") == [{"role": "user", "content": "my name is Ada"}]
    second = chat.say(s, "what is my name?")
    assert sent_for("what is my name?") == [
        {"role": "user", "content": "my name is Ada"},
        {"role": "assistant", "content": first},
        {"role": "user", "content": "what is my name?"},
    ]
    chat.say(s, "and once more?")
    assert sent_for("and once more?") == [
        {"role": "user", "content": "my name is Ada"},
        {"role": "assistant", "content": first},
        {"role": "user", "content": "what is my name?"},
        {"role": "assistant", "content": second},
        {"role": "user", "content": "and once more?"},
    ]
    # The console's view of the same session: each turn, oldest first.
    r = chat.client.get(f"/v1/sessions/{s}/turns", headers=bearer(chat.user))
    assert r.status_code == 200, r.text
    turns = r.json()["turns"]
    assert [(t["messages"], t["answer"], t["status"]) for t in turns] == [
        (["my name is Ada"], first, "done"),
        (["what is my name?"], second, "done"),
        (["and once more?"], "You said: and once more?", "done"),
    ]
    # Another user's token cannot read it: the same 404 as a session that does not exist.
    other = chat.client.get(f"/v1/sessions/{s}/turns", headers=bearer(chat.user + "-x"))
    missing = chat.client.get(f"/v1/sessions/{session()}/turns", headers=bearer(chat.user))
    assert other.status_code == missing.status_code == 404
    assert other.json()["error"]["field"] == "session_id"


def test_a_merged_turn_is_one_user_turn_with_both_messages(chat: Chat) -> None:
    s = session()
    first = chat.post(s, "[slow] tell me about Kafka")
    wait_until(
        lambda: chat.run(first["run_id"])["output"], timeout=60, what="the first answer streams"
    )
    merged = chat.post(s, "and about Postgres")
    assert merged["merged"] is True and merged["run_id"] == first["run_id"]
    run = chat.ended(first["run_id"])
    assert run["status"] == "done"
    chat.say(s, "which two did I ask about?")
    assert sent_for("which two did I ask about?") == [
        {"role": "user", "content": "[slow] tell me about Kafka\n\nand about Postgres"},
        {"role": "assistant", "content": run["output"]},
        {"role": "user", "content": "which two did I ask about?"},
    ]
    r = chat.client.get(f"/v1/sessions/{s}/turns", headers=bearer(chat.user))
    assert r.json()["turns"][0]["messages"] == ["[slow] tell me about Kafka", "and about Postgres"]


def test_a_cancelled_turn_is_sent_cut_and_marked(chat: Chat) -> None:
    s = session()
    run_id = chat.post(s, "[hang] a very long story")["run_id"]
    wait_until(lambda: len(chat.run(run_id)["output"]) > 10, timeout=60, what="some output")
    r = chat.client.post(
        f"/v1/runs/{run_id}/cancel", json={"reason": "enough"}, headers=bearer(chat.user)
    )
    assert r.status_code in (200, 202), r.text
    cut = chat.ended(run_id)
    assert cut["status"] == "cancelled" and cut["output"].startswith("p0 p1 ")
    chat.say(s, "are you still there?")
    assert sent_for("are you still there?") == [
        {"role": "user", "content": "[hang] a very long story"},
        {"role": "assistant", "content": f"{cut['output']}\n\n{CUT_MARK}"},
        {"role": "user", "content": "are you still there?"},
    ]


def test_a_session_longer_than_the_budget_drops_its_oldest_turns(chat: Chat) -> None:
    """Each turn: 240 chars of user text (60 tokens, estimated) and a 400-char answer the
    ledger counts as 5 tokens: 65 a turn. The new message (~4 tokens) leaves 196 of 200:
    the newest three turns fit, the oldest is dropped. Had the answers been estimated
    (100 tokens each), only one turn would fit."""
    s = session()
    said = [f"[long] turn {n} " + "x" * (240 - len(f"[long] turn {n} ")) for n in range(4)]
    for text in said:
        assert chat.say(s, text) == LONG_ANSWER
    chat.say(s, "summary please")
    sent = sent_for("summary please")
    assert [m["content"] for m in sent if m["role"] == "user"] == [*said[1:], "summary please"]
    assert [m["content"] for m in sent if m["role"] == "assistant"] == [LONG_ANSWER] * 3


def test_two_sessions_of_one_user_never_see_each_other(chat: Chat) -> None:
    a, b = session(), session()
    answer_a = chat.say(a, "in A: my name is Ada")
    chat.say(b, "in B: what is my name?")
    assert sent_for("in B: what is my name?") == [
        {"role": "user", "content": "in B: what is my name?"}
    ]
    chat.say(a, "in A: and now?")
    assert sent_for("in A: and now?") == [
        {"role": "user", "content": "in A: my name is Ada"},
        {"role": "assistant", "content": answer_a},
        {"role": "user", "content": "in A: and now?"},
    ]
