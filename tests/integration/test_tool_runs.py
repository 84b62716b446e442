"""Runs with tools and memory, end to end: Kafka, a worker process, PostgreSQL + pgvector
and a local OpenAI-compatible server that streams tool calls."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import pytest

from koda.db import async_engine
from koda.settings import Settings
from processors.memory import store
from processors.memory.embedders import wordllama
from schemas.migrate import upgrade
from tests.integration.conftest import delete_topics, drop_schema, make_settings
from tests.integration.test_openai_handler import (
    DISTILLED,
    FINAL_ANSWER,
    TOOL_SCRIPT,
    ScriptedModel,
    serve_scripted_model,
)
from tests.support import wait_until
from tests.workers import Submitter, WorkerProcess
from topics.admin import apply_topics


@pytest.fixture(scope="module")
def model_url() -> Iterator[str]:
    url, httpd = serve_scripted_model()
    yield url
    httpd.shutdown()


@pytest.fixture(scope="module")
def space(stack) -> Iterator[Settings]:  # type: ignore[no-untyped-def]
    settings = make_settings(stack)
    upgrade(settings)
    apply_topics(settings)
    yield settings
    delete_topics(settings)
    drop_schema(settings)


@pytest.fixture(scope="module")
def submitter(space: Settings) -> Iterator[Submitter]:
    s = Submitter(space)
    yield s
    s.close()


async def _seed(settings: Settings, user: str, statements: list[str]) -> None:
    engine = async_engine(settings, pool_size=1)
    try:
        embedded = await wordllama().embed(statements)
        async with engine.begin() as conn:
            await store.insert(
                conn,
                user_id=user,
                run_id=None,
                texts=statements,
                vectors=embedded.vectors,
                embedder=embedded.model,
            )
    finally:
        await engine.dispose()


def seed(settings: Settings, user: str, *statements: str) -> None:
    for statement in statements:  # one memory each
        asyncio.run(_seed(settings, user, [statement]))


@pytest.fixture(scope="module")
def worker(space: Settings, model_url: str) -> Iterator[WorkerProcess]:
    w = WorkerProcess(
        space,
        "tools-w1",
        {"KODA_HANDLER": "openai", "KODA_OPENAI_BASE_URL": model_url, "KODA_MAX_TOOL_TURNS": "5"},
    ).start()
    yield w
    w.stop()


def finished(submitter: Submitter, run_id: str, w: WorkerProcess, timeout: float = 90) -> str:
    def terminal() -> bool:
        assert w.alive(), w.log()[-3000:]
        return submitter.all_terminal([run_id])

    wait_until(terminal, timeout=timeout, interval=0.2, what=f"run {run_id} terminal")
    return submitter.statuses([run_id])[run_id]


def test_a_run_with_tool_calls_streams_every_turn_and_remembers(
    space: Settings, submitter: Submitter, worker: WorkerProcess
) -> None:
    seed(space, "ana", "I live in Lisbon, near the river.", "My dog Bolt is a border collie.")
    seed(space, "mallory", "My bank PIN is 4821.")
    ScriptedModel.seen.clear()
    run_id = submitter.submit(
        "ana", {"text": "Where do I live, and my dog's name? I am learning the cello."}
    )
    assert finished(submitter, run_id, worker) == "done", worker.log()[-3000:]
    rows = submitter.messages(run_id)
    assert [r.seq for r in rows] == list(range(len(rows)))
    text = "".join(r.content for r in rows if r.kind == "chunk")
    assert text == TOOL_SCRIPT[0][0] + "".join(FINAL_ANSWER)
    tools = [json.loads(r.content) for r in rows if r.kind == "tool"]
    # Three calls, each a call chunk then a result chunk, in seq order.
    assert [("arguments" in t, t["call_id"]) for t in tools] == [
        (True, "call_0"), (False, "call_0"),
        (True, "call_1"), (False, "call_1"),
        (True, "call_2"), (False, "call_2"),
    ]  # fmt: skip
    assert tools[0]["arguments"] == TOOL_SCRIPT[0][1]  # reassembled from its pieces
    assert "Lisbon" in tools[1]["result"] and '"score"' in tools[1]["result"]
    assert tools[3]["result"].startswith("error: field 'limit' must be an integer from 1 to 10")
    assert "Bolt" in tools[5]["result"]
    assert "4821" not in json.dumps(tools)
    assert [r.kind for r in rows][-1] == "done"
    # The model was given each result under its call's id.
    last_turn = [b for b in ScriptedModel.seen if "response_format" not in b][-1]
    fed = [m for m in last_turn["messages"] if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in fed] == ["call_0", "call_1", "call_2"]
    assert last_turn["tools"][0]["function"]["name"] == "memory_search"
    # One usage row per model call (4 turns + the distillation), one per embedding.
    usage = submitter.query(
        "SELECT call_index, model, prompt_tokens FROM usage WHERE run_id = :r ORDER BY call_index",
        r=run_id,
    )
    models = [u.model for u in usage]
    assert models.count("m-tools") == 5
    assert [m for m in models if m.startswith("embedding:")] == [
        "embedding:wordllama-l2-supercat-256"
    ] * 3  # query 1, query 3 (the refused call embeds nothing), the new memory
    assert [u.call_index for u in usage] == list(range(len(usage)))
    memories = submitter.query("SELECT user_id, text, run_id FROM memories ORDER BY user_id, text")
    assert [(m.user_id, m.text) for m in memories if m.run_id == run_id] == [("ana", DISTILLED[0])]
    assert [m.text for m in memories if m.user_id == "mallory"] == ["My bank PIN is 4821."]


def test_reaching_the_tool_turn_limit_fails_the_run_saying_so(
    space: Settings, submitter: Submitter, worker: WorkerProcess, model_url: str
) -> None:
    # The worker's model is chosen per process; this one asks for tools for ever.
    w = WorkerProcess(
        space.with_(namespace=space.namespace),
        "tools-forever",
        {
            "KODA_HANDLER": "openai",
            "KODA_OPENAI_BASE_URL": model_url,
            "KODA_OPENAI_MODEL": "tools-forever",
            "KODA_MAX_TOOL_TURNS": "3",
        },
    )
    worker.stop()  # hand the partitions to the new worker
    w.start()
    try:
        run_id = submitter.submit("ben", {"text": "hi"})
        assert finished(submitter, run_id, w) == "failed"
        (row,) = submitter.query("SELECT error, failures FROM runs WHERE id = :r", r=run_id)
        assert "KODA_MAX_TOOL_TURNS" in row.error and "all 3 model turns" in row.error
        assert (row.failures or 0) == 1  # not retried: more turns would not help
        kinds = [r.kind for r in submitter.messages(run_id)]
        assert kinds.count("tool") == 6 and kinds[-1] == "error"
    finally:
        w.stop()
