"""Output Kafka or Postgres would refuse, and the limits on an admitted run, on the real
broker and database with worker processes (koda issue 34, items 2 and 3).

Two workers, each on a namespace of its own: the demo handler (a 2 MB token, dirty
output, the output byte cap, rows left by an older release) and the openai handler
against a local model server speaking the OpenAI wire format (the deadline,
``max_completion_tokens``, the budget checked on every usage record, the tool-argument
cap, a usage count Postgres refuses). Every failure must end the run ``failed`` at its
first claim naming its cause, and the user's next run must reach ``done``.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from decimal import Decimal
from http.server import BaseHTTPRequestHandler
from typing import Any

import pytest
from sqlalchemy import text

from koda_runtime.lifecycle.chunks import MAX_CHUNK_BYTES, chunk_key, storable
from koda_runtime.localstack import StackInfo
from koda_runtime.processors.handlers.demo import demo_tokens
from koda_runtime.processors.handlers.openai import MAX_TOOL_ARGUMENT_BYTES
from koda_runtime.settings import Settings
from koda_runtime.topics.catalogue import RUN_CHUNKS
from tests.fixtures.ledger import koda
from tests.fixtures.model_server import serve_model
from tests.fixtures.namespaces import make_settings, prepared_namespace
from tests.fixtures.processes import WorkerProcess
from tests.fixtures.runs import Submitter, read_topic, wait_terminal

MODEL = "m-limits"
MAX_OUTPUT_TOKENS = 321
MAX_RUN_S = 4
OUTPUT_CAP = 3_000_000  # KODA_MAX_OUTPUT_BYTES of the demo worker: one 2 MB token fits


# -- a model server whose behaviour the user's last message chooses --------------------


def _sse(obj: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def _content(piece: str) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": {"content": piece}}], "model": MODEL}


def _tool_call(call_id: str, arguments: str) -> dict[str, Any]:
    call = {"index": 0, "id": call_id, "type": "function"}
    call["function"] = {"name": "memory_search", "arguments": arguments}
    return {"choices": [{"index": 0, "delta": {"tool_calls": [call]}}], "model": MODEL}


def _usage(prompt: int, completion: int) -> dict[str, Any]:
    return {
        "choices": [],
        "model": MODEL,
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion},
    }


class LimitsModel(BaseHTTPRequestHandler):
    """``forever``: streams a piece every 20 ms until the client goes away. ``spend``: a
    first call that reports 1000 + 1000 tokens and asks for a tool; the next call waits
    for :attr:`release` (the budget must stop the run before it says anything).
    ``bigargs``: a tool call whose arguments are over the cap. ``hugeint``: a usage
    count past Postgres' integer. Anything else: ``Hello`` and its usage."""

    seen: list[dict[str, Any]] = []
    release = threading.Event()

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        LimitsModel.seen.append(body)
        if "response_format" in body:  # the memory distillation: nothing to remember
            answer = {
                "model": MODEL,
                "choices": [{"index": 0, "message": {"content": '{"statements": []}'}}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1},
            }
            payload = json.dumps(answer).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
            return
        said = next(m["content"] for m in reversed(body["messages"]) if m["role"] == "user")
        turn = sum(1 for m in body["messages"] if m["role"] == "tool")
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        if said == "forever":
            self._forever()
            return
        events: list[dict[str, Any]] = []
        if said == "spend" and turn == 0:
            events = [_content("Looking. "), _tool_call("call_0", '{"query": "x"}')]
            events.append(_usage(1000, 1000))
        elif said == "spend":
            LimitsModel.release.wait(120)
            events = [_content("too late"), _usage(1, 1)]
        elif said == "bigargs":
            arguments = json.dumps({"query": "q" * (MAX_TOOL_ARGUMENT_BYTES + 1)})
            events = [_tool_call("call_0", arguments), _usage(5, 5)]
        elif said == "hugeint":
            events = [_content("counted "), _usage(3_000_000_000, 1)]
        else:
            events = [_content("Hel"), _content("lo"), _usage(7, 2)]
        for event in events:
            self.wfile.write(_sse(event))
        self.wfile.write(b"data: [DONE]\n\n")

    def _forever(self) -> None:
        try:
            while not LimitsModel.release.wait(0.02):
                self.wfile.write(_sse(_content("more ")))
                self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            return  # the worker cut the call

    def log_message(self, *args: object) -> None:
        return


# -- fixtures -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo_env(stack: StackInfo) -> Iterator[Settings]:
    with prepared_namespace(make_settings(stack)) as settings:
        yield settings


@pytest.fixture(scope="module")
def demo(demo_env: Settings) -> Iterator[tuple[Submitter, WorkerProcess]]:
    sub = Submitter(demo_env)
    worker = WorkerProcess(
        demo_env, "limits-demo", {"KODA_MAX_OUTPUT_BYTES": str(OUTPUT_CAP)}
    ).start()
    yield sub, worker
    worker.stop()
    sub.close()


@pytest.fixture(scope="module")
def model(
    module_env: Settings, module_submitter: Submitter
) -> Iterator[tuple[Submitter, WorkerProcess]]:
    url, httpd = serve_model(LimitsModel)
    worker = WorkerProcess(
        module_env,
        "limits-model",
        {
            "KODA_HANDLER": "openai",
            "KODA_OPENAI_BASE_URL": url,
            "KODA_OPENAI_MODEL": MODEL,
            "KODA_MAX_RUN_S": str(MAX_RUN_S),
            "KODA_MAX_OUTPUT_TOKENS": str(MAX_OUTPUT_TOKENS),
        },
    ).start()
    yield module_submitter, worker
    LimitsModel.release.set()
    worker.stop()
    httpd.shutdown()
    httpd.server_close()


def ended(sub: Submitter, worker: WorkerProcess, run_id: str) -> Any:
    """The run's row once it is terminal: status, error, attempt (its claims)."""
    wait_terminal(sub, [run_id], 90, worker)
    (row,) = sub.query("SELECT status, error, attempt FROM runs WHERE id = :r", r=run_id)
    return row


def next_run_is_done(sub: Submitter, worker: WorkerProcess, user: str, inp: dict) -> None:
    """The user's next run reaches ``done`` on its first claim: nothing stalled."""
    row = ended(sub, worker, sub.submit(user, inp))
    assert (row.status, row.attempt) == ("done", 1), row


def gap_free(sub: Submitter, run_id: str) -> list[Any]:
    rows = sub.messages(run_id)
    assert [r.seq for r in rows] == list(range(len(rows)))
    return rows


# -- output Kafka or Postgres would refuse ---------------------------------------------


def test_a_2mb_token_is_written_as_64_kib_chunks_and_the_run_is_done_at_once(
    demo: tuple[Submitter, WorkerProcess], demo_env: Settings
) -> None:
    sub, worker = demo
    inp = {"text": "one huge token", "demo": {"token_bytes": 2_000_000, "tokens": 1}}
    run_id = sub.submit("huge", inp)
    row = ended(sub, worker, run_id)
    assert (row.status, row.error, row.attempt) == ("done", None, 1), row
    rows = gap_free(sub, run_id)
    chunks = [r for r in rows if r.kind == "chunk"]
    assert len(chunks) >= 2_000_000 // MAX_CHUNK_BYTES
    assert max(len(r.content.encode()) for r in chunks) <= MAX_CHUNK_BYTES
    assert sub.output(run_id) == "".join(demo_tokens(inp))
    assert [r.kind for r in rows][-1] == "done"
    # Every one of them is on the chunk topic: the broker took them all.
    keys = {m.key().decode() for m in read_topic(demo_env, demo_env.names.topic(RUN_CHUNKS), 60)}
    assert {chunk_key(run_id, r.seq) for r in rows} <= keys
    next_run_is_done(sub, worker, "huge", {"text": "and then", "demo": {"tokens": 3}})


def test_nul_and_lone_surrogates_in_output_are_stored_cleaned(
    demo: tuple[Submitter, WorkerProcess],
) -> None:
    sub, worker = demo
    inp = {"text": "broken model", "demo": {"tokens": 5, "dirty": True, "delay_ms": 1}}
    assert "\x00" in demo_tokens(inp)[0] and "\ud800" in demo_tokens(inp)[0]
    run_id = sub.submit("dirty", inp)
    row = ended(sub, worker, run_id)
    assert (row.status, row.attempt) == ("done", 1), row
    gap_free(sub, run_id)
    assert sub.output(run_id) == "".join(storable(t) for t in demo_tokens(inp))
    assert "\ufffd\ufffd" in sub.output(run_id)


def test_output_past_the_byte_cap_fails_the_run_naming_the_cap(
    demo: tuple[Submitter, WorkerProcess],
) -> None:
    sub, worker = demo
    inp = {"text": "too much", "demo": {"token_bytes": 2_000_000, "tokens": 2, "delay_ms": 1}}
    run_id = sub.submit("wordy", inp)
    row = ended(sub, worker, run_id)
    assert (row.status, row.attempt) == ("failed", 1), row
    assert row.error.startswith("output_bytes:") and f"{OUTPUT_CAP}" in row.error, row.error
    assert "KODA_MAX_OUTPUT_BYTES" in row.error
    assert sub.output(run_id) == demo_tokens(inp)[0]  # what came before the cap stays
    assert [r.kind for r in gap_free(sub, run_id)][-1] == "error"
    next_run_is_done(sub, worker, "wordy", {"text": "short", "demo": {"tokens": 2}})


def test_an_oversize_row_an_older_release_left_is_passed_over_not_resent_for_ever(
    demo: tuple[Submitter, WorkerProcess],
) -> None:
    """The review's stall: a 2 MB chunk in Postgres that the producer refuses. Sent again
    when the run resumes, it is logged and passed over; the run is done at its next claim
    and never marked whole on the topic; the user's next run is done."""
    sub, worker = demo
    inp = {"text": "resumed", "demo": {"tokens": 3, "delay_ms": 1}}
    run_id = sub.submit("old", inp, publish=False)
    with sub.engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE runs SET status = 'streaming', attempt = 1, started_at = now(),"
                " first_chunk_at = now() WHERE id = :id"
            ),
            {"id": run_id},
        )
        conn.execute(
            text(
                "INSERT INTO messages (run_id, seq, kind, content, attempt)"
                " VALUES (:id, 0, 'chunk', :c, 1)"
            ),
            {"id": run_id, "c": "x" * 2_000_000},
        )
    sub.publish(run_id, "old")
    row = ended(sub, worker, run_id)
    assert (row.status, row.attempt) == ("done", 2), row
    assert [r.kind for r in gap_free(sub, run_id)][:2] == ["chunk", "reset"]
    assert f"event=chunk_refused run_id={run_id} seq=0" in worker.log()
    (published,) = sub.query("SELECT published_seq FROM runs WHERE id = :r", r=run_id)
    assert published.published_seq is None
    next_run_is_done(sub, worker, "old", {"text": "next", "demo": {"tokens": 2}})


# -- limits on an admitted run (the openai handler) --------------------------------------


def test_the_model_is_asked_for_at_most_max_output_tokens(
    model: tuple[Submitter, WorkerProcess],
) -> None:
    sub, worker = model
    LimitsModel.seen.clear()
    run_id = sub.submit("tokens", {"text": "hello"})
    row = ended(sub, worker, run_id)
    assert (row.status, row.attempt) == ("done", 1), row
    assert sub.output(run_id) == "Hello"
    assert LimitsModel.seen, "the model was called"
    assert [b.get("max_completion_tokens") for b in LimitsModel.seen] == [MAX_OUTPUT_TOKENS] * len(
        LimitsModel.seen
    )


def test_a_model_that_streams_forever_is_cut_at_the_deadline(
    model: tuple[Submitter, WorkerProcess],
) -> None:
    sub, worker = model
    run_id = sub.submit("endless", {"text": "forever"})
    row = ended(sub, worker, run_id)
    assert (row.status, row.attempt) == ("failed", 1), row
    assert row.error.startswith("deadline:") and f"{MAX_RUN_S} s" in row.error, row.error
    rows = gap_free(sub, run_id)
    assert rows[0].kind == "chunk" and rows[-1].kind == "error"
    assert json.loads(rows[-1].content)["error"].startswith("deadline:")
    # The cut call is billed, estimated: its pieces were streamed.
    calls = sub.query(
        "SELECT outcome, estimated FROM ledger WHERE run_id = :r ORDER BY call_index", r=run_id
    )
    assert [(c.outcome, c.estimated) for c in calls] == [("failed", True)]
    next_run_is_done(sub, worker, "endless", {"text": "hello"})


def test_a_run_stops_after_the_call_that_spends_its_users_budget(
    model: tuple[Submitter, WorkerProcess], module_env: Settings
) -> None:
    sub, worker = model
    price = ("prices", "set", MODEL, "--prompt", "10", "--completion", "10")
    assert koda(module_env, *price).exit_code == 0  # 1000 + 1000 tokens: 0.02 USD
    assert koda(module_env, "budgets", "set", "spender", "--daily", "0.01").exit_code == 0
    run_id = sub.submit("spender", {"text": "spend"})
    row = ended(sub, worker, run_id)
    assert (row.status, row.attempt) == ("failed", 1), row
    assert row.error.startswith("budget_exceeded: the user's day budget of 0.01"), row.error
    calls = sub.query(
        "SELECT call_index, model, kind, outcome, cost_usd FROM ledger"
        " WHERE run_id = :r AND kind = 'chat' ORDER BY call_index",
        r=run_id,
    )
    assert [(c.model, c.outcome) for c in calls] == [(MODEL, "ok")]
    assert calls[0].cost_usd == Decimal("0.02")
    # The model's second call was never answered: the run stopped while it waited.
    rows = gap_free(sub, run_id)
    assert "too late" not in sub.output(run_id)
    assert rows[-1].kind == "error"


def test_tool_arguments_over_the_cap_fail_the_run_naming_the_cap(
    model: tuple[Submitter, WorkerProcess],
) -> None:
    sub, worker = model
    run_id = sub.submit("toolish", {"text": "bigargs"})
    row = ended(sub, worker, run_id)
    assert (row.status, row.attempt) == ("failed", 1), row
    assert row.error.startswith("tool_arguments:"), row.error
    assert f"cap of {MAX_TOOL_ARGUMENT_BYTES} bytes" in row.error
    assert [r.kind for r in gap_free(sub, run_id)] == ["error"]  # no tool event written
    next_run_is_done(sub, worker, "toolish", {"text": "hello"})


def test_a_usage_count_postgres_refuses_fails_the_run_naming_the_cause(
    model: tuple[Submitter, WorkerProcess],
) -> None:
    """Three billion prompt tokens do not fit the ledger's integer: Postgres refuses the
    row. Before, every rerun called the model again up to the claim bound; now the
    first claim fails the run with the refusal named."""
    sub, worker = model
    run_id = sub.submit("overflow", {"text": "hugeint"})
    row = ended(sub, worker, run_id)
    assert (row.status, row.attempt) == ("failed", 1), row
    assert "NumericValueOutOfRange" in row.error and "refused" in row.error, row.error
    assert [r.kind for r in gap_free(sub, run_id)][-1] == "error"
    next_run_is_done(sub, worker, "overflow", {"text": "hello"})
