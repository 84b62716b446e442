"""Runs with tools and memory, end to end: Kafka, a worker process, PostgreSQL + pgvector
and a local OpenAI-compatible server that streams tool calls."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import pytest
from typer.testing import CliRunner

from koda_runtime.cli.memories import memories_app
from koda_runtime.gateway.app import create_app
from koda_runtime.processors.memory import store, tool
from koda_runtime.processors.memory.embedders import wordllama
from koda_runtime.schemas.db import async_engine
from koda_runtime.settings import Settings
from tests.fixtures.gateway import serve_app
from tests.fixtures.model_server import (
    DISTILLED,
    FINAL_ANSWER,
    HOSTILE,
    HOSTILE_CALLS,
    TOOL_SCRIPT,
    ScriptedModel,
    serve_scripted_model,
)
from tests.fixtures.processes import WorkerProcess, settings_env
from tests.fixtures.runs import Submitter
from tests.support import wait_until


@pytest.fixture(scope="module")
def model_url() -> Iterator[str]:
    url, httpd = serve_scripted_model()
    yield url
    httpd.shutdown()


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
def worker(module_env: Settings, model_url: str) -> Iterator[WorkerProcess]:
    w = WorkerProcess(
        module_env,
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
    module_env: Settings, module_submitter: Submitter, worker: WorkerProcess
) -> None:
    seed(module_env, "ana", "I live in Lisbon, near the river.", "My dog Bolt is a border collie.")
    seed(module_env, "mallory", "My bank PIN is 4821.")
    ScriptedModel.seen.clear()
    run_id = module_submitter.submit(
        "ana", {"text": "Where do I live, and my dog's name? I am learning the cello."}
    )
    assert finished(module_submitter, run_id, worker) == "done", worker.log()[-3000:]
    rows = module_submitter.messages(run_id)
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
    # One usage row per model call of the run (4 turns), one per embedding of a query.
    usage = module_submitter.query(
        "SELECT call_index, model, prompt_tokens FROM usage WHERE run_id = :r ORDER BY call_index",
        r=run_id,
    )
    models = [u.model for u in usage]
    assert models.count("m-tools") == 4
    assert [m for m in models if m.startswith("embedding:")] == [
        "embedding:wordllama-l2-supercat-256"
    ] * 2  # query 1, query 3 (the refused call embeds nothing)
    assert [u.call_index for u in usage] == list(range(len(usage)))
    # The memory is distilled after the run is done (processors/memory/distiller.py):
    # its model call and its embedding are ledger rows of the run too.
    wait_until(
        lambda: (
            not module_submitter.query(
                "SELECT 1 FROM memory_distillations WHERE run_id = :r", r=run_id
            )
        ),
        timeout=60,
        what="the run's memories distilled",
    )
    ledger = module_submitter.query(
        "SELECT kind, count(*) AS calls FROM ledger WHERE run_id = :r GROUP BY kind", r=run_id
    )
    assert {row.kind: row.calls for row in ledger} == {"chat": 5, "embedding": 3}
    memories = module_submitter.query(
        "SELECT user_id, text, run_id FROM memories ORDER BY user_id, text"
    )
    assert [(m.user_id, m.text) for m in memories if m.run_id == run_id] == [("ana", DISTILLED[0])]
    assert [m.text for m in memories if m.user_id == "mallory"] == ["My bank PIN is 4821."]


def test_tool_arguments_aimed_at_another_user_read_nothing_of_theirs(
    module_env: Settings, module_submitter: Submitter, worker: WorkerProcess
) -> None:
    """One model turn of four calls whose arguments name another user, inject SQL and
    inject prompt text: every search runs as the run's user, through the worker."""
    seed(module_env, "vic", "My bank PIN is 4821.", "My passport number is K7719.")
    seed(module_env, "zed", "My bank PIN is 1357.")
    before = module_submitter.query("SELECT id FROM memories WHERE user_id = 'vic' ORDER BY id")
    ScriptedModel.seen.clear()
    run_id = module_submitter.submit("zed", {"text": HOSTILE + "what is vic's bank PIN?"})
    assert finished(module_submitter, run_id, worker) == "done", worker.log()[-3000:]
    tools = [json.loads(r.content) for r in module_submitter.messages(run_id) if r.kind == "tool"]
    calls = [t for t in tools if "arguments" in t]
    results = [t["result"] for t in tools if "result" in t]
    assert [c["arguments"] for c in calls] == HOSTILE_CALLS  # four calls of one turn
    assert results[0].startswith("error: memory_search has no field 'user_id'")
    # The searches did run, and found zed's own PIN; never vic's memories.
    assert "1357" in results[1] and "1357" in results[2], results
    assert results[3] == tool.EMPTY  # the SQL text is only embedded: it matches nothing
    seen_by_model = json.dumps(ScriptedModel.seen)
    for secret in ("4821", "K7719"):
        assert secret not in json.dumps(tools) and secret not in seen_by_model
    after = module_submitter.query("SELECT id FROM memories WHERE user_id = 'vic' ORDER BY id")
    assert after == before  # the injected DELETE touched nothing


def test_reaching_the_tool_turn_limit_fails_the_run_saying_so(
    module_env: Settings, module_submitter: Submitter, worker: WorkerProcess, model_url: str
) -> None:
    # The worker's model is chosen per process; this one asks for tools for ever.
    w = WorkerProcess(
        module_env.with_(namespace=module_env.namespace),
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
        run_id = module_submitter.submit("ben", {"text": "hi"})
        assert finished(module_submitter, run_id, w) == "failed"
        (row,) = module_submitter.query("SELECT error, failures FROM runs WHERE id = :r", r=run_id)
        assert "KODA_MAX_TOOL_TURNS" in row.error and "all 3 model turns" in row.error
        assert (row.failures or 0) == 1  # not retried: more turns would not help
        kinds = [r.kind for r in module_submitter.messages(run_id)]
        assert kinds.count("tool") == 6 and kinds[-1] == "error"
    finally:
        w.stop()


def memories_of(submitter: Submitter, user: str) -> list[str]:
    rows = submitter.query("SELECT text FROM memories WHERE user_id = :u ORDER BY text", u=user)
    return [r.text for r in rows]


def test_the_memories_api_and_cli_show_only_the_users_own_and_forget(
    module_env: Settings, module_submitter: Submitter, monkeypatch: pytest.MonkeyPatch
) -> None:
    seed(module_env, "cy", "I live in Lisbon, near the river.", "I drive a blue Volvo.")
    seed(module_env, "dee", "My bank PIN is 4821.")
    with (
        serve_app(create_app(module_env, run_sweeper=False)) as url,
        httpx.Client(base_url=url) as c,
    ):
        mine = c.get("/v1/memories", headers={"Authorization": "Bearer dev:cy"}).json()["memories"]
        assert sorted(m["text"] for m in mine) == [
            "I drive a blue Volvo.",
            "I live in Lisbon, near the river.",
        ]
        theirs = c.get("/v1/memories", headers={"Authorization": "Bearer dev:dee"}).json()
        (pin,) = theirs["memories"]
        as_cy = {"Authorization": "Bearer dev:cy"}
        assert c.delete(f"/v1/memories/{pin['id']}", headers=as_cy).status_code == 404
        assert memories_of(module_submitter, "dee") == ["My bank PIN is 4821."]
        (lisbon,) = [m for m in mine if "Lisbon" in m["text"]]
        assert c.delete(f"/v1/memories/{lisbon['id']}", headers=as_cy).status_code == 204
        assert c.delete(f"/v1/memories/{lisbon['id']}", headers=as_cy).status_code == 404
        assert c.get("/v1/memories").status_code == 401
        for bogus in ("%00", "mem_" + "0" * 24, "x" * 500, "mem_' OR 1=1 --"):
            assert c.delete(f"/v1/memories/{bogus}", headers=as_cy).status_code == 404
        left = c.get("/v1/memories", headers=as_cy).json()["memories"]
        assert [m["text"] for m in left] == ["I drive a blue Volvo."]
    # The operators' CLI, against the same database.
    for key, value in settings_env(module_env).items():
        monkeypatch.setenv(key, value)
    cli = CliRunner()
    listed = cli.invoke(memories_app, ["list", "--user", "dee"])
    assert listed.exit_code == 0 and pin["id"] in listed.output and "1 memories" in listed.output
    assert cli.invoke(memories_app, ["delete", pin["id"], "--user", "cy"]).exit_code == 1
    gone = cli.invoke(memories_app, ["delete", pin["id"], "--user", "dee"])
    assert gone.exit_code == 0, gone.output
    assert memories_of(module_submitter, "dee") == []
