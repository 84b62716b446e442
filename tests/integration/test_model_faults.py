"""A model provider's faults, injected by a local server speaking the OpenAI wire format
(tests/fixtures/model_server.py, FaultyModel): what the openai handler does about each,
and what a run and its bill come to through a real worker, Kafka and PostgreSQL.

| fault                        | the run                         | billed                    |
|------------------------------|---------------------------------|---------------------------|
| 429, Retry-After: 2          | waits 2 s, done, one attempt    | the one answered call     |
| 500s for 15 s                | retried in the attempt, done    | the one answered call     |
| 401                          | failed at once, one call        | nothing                   |
| stream cut mid-answer        | attempt 2 (after reset), done   | attempt 1 estimated+failed|
| primary down, fallback up    | done on the fallback, announced | the fallback's call       |
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import pytest

from koda_runtime.errors import HandlerError
from koda_runtime.lifecycle.handler import RunContext, RunFailed, Status, Usage
from koda_runtime.metrics import REGISTRY
from koda_runtime.processors.handlers.openai import OpenAIHandler
from koda_runtime.processors.handlers.provider import CallPolicy
from koda_runtime.schemas.ledger import set_price
from koda_runtime.settings import Settings
from koda_runtime.topics.catalogue import RUNS_DLQ
from tests.fixtures.ledger import koda
from tests.fixtures.model_server import (
    BAD_KEY_MESSAGE,
    DOWN_MODEL,
    FAULTY_USAGE,
    OUTAGE_S,
    PIECES,
    FaultyModel,
    serve_model,
)
from tests.fixtures.processes import WorkerProcess
from tests.fixtures.runs import Submitter, read_topic, wait_terminal

FAST = CallPolicy(window_s=5.0, base_s=0.05, cap_s=0.2, breaker_failures=2, breaker_open_s=60)
MICRO = Decimal(1_000_000)


@pytest.fixture(scope="module")
def model_url() -> Iterator[str]:
    url, httpd = serve_model(FaultyModel)
    yield url
    httpd.shutdown()
    httpd.server_close()


def requests_for(text: str) -> list[dict[str, Any]]:
    with FaultyModel.lock:
        return [r for r in FaultyModel.seen if r["text"] == text]


def calls(model: str, outcome: str) -> float:
    return (
        REGISTRY.get_sample_value("koda_model_calls_total", {"model": model, "outcome": outcome})
        or 0.0
    )


async def collect(handler: OpenAIHandler, text: str, items: list[Any]) -> None:
    ctx = RunContext("r-faults", "u1", {"text": text}, 1)
    try:
        async for item in handler.stream(ctx):
            items.append(item)
    finally:
        await handler.aclose()


def handler(url: str, model: str = "m-1", **kw: Any) -> OpenAIHandler:
    return OpenAIHandler(base_url=url, api_key="sk-test", model=model, **kw)


# -- the handler alone ----------------------------------------------------------------


def test_a_429_waits_as_retry_after_says_then_answers(model_url: str) -> None:
    text = "handler [fault:429]"
    before = calls("m-1", "rate_limited")
    items: list[Any] = []
    asyncio.run(collect(handler(model_url, call_policy=FAST), text, items))
    assert [i for i in items if isinstance(i, str)] == PIECES
    first, second = requests_for(text)
    assert (first["status"], second["status"]) == (429, 200)
    # Retry-After: 2 was obeyed, although this policy's backoff would wait 0.2 s at most.
    assert second["at"] - first["at"] >= 1.9
    assert calls("m-1", "rate_limited") == before + 1


def test_a_401_fails_the_run_at_once_naming_the_status_and_message(model_url: str) -> None:
    text = "handler [fault:401]"
    items: list[Any] = []
    with pytest.raises(RunFailed) as err:
        asyncio.run(collect(handler(model_url, call_policy=FAST), text, items))
    assert len(requests_for(text)) == 1  # not retried
    message = str(err.value)
    assert "HTTP 401" in message and "Incorrect API key provided" in message
    assert "invalid_api_key" in message
    assert "sk-test" not in message and BAD_KEY_MESSAGE not in message  # the key is redacted
    assert items == []  # nothing said, nothing billed


def test_a_stream_cut_mid_answer_is_not_repeated_in_the_attempt(model_url: str) -> None:
    """Three pieces went out: calling again would send them twice. The attempt fails
    (not finally) with its estimated usage; the run's next attempt starts with reset."""
    text = "handler [fault:cut]"
    items: list[Any] = []
    with pytest.raises(HandlerError, match="stopped mid-answer") as err:
        asyncio.run(collect(handler(model_url, call_policy=FAST), text, items))
    assert not isinstance(err.value, RunFailed)
    assert len(requests_for(text)) == 1
    assert [i for i in items if isinstance(i, str)] == PIECES[:3]
    assert items[-1] == Usage("m-1", 5, 3, estimated=True)


def test_a_connection_refused_is_retried_until_the_window_ends() -> None:
    policy = CallPolicy(window_s=1.0, base_s=0.05, cap_s=0.1)
    before = calls("m-1", "connection_error")
    with pytest.raises(HandlerError, match="still failing after .* tries in 1 s") as err:
        asyncio.run(collect(handler("http://127.0.0.1:9", call_policy=policy), "hi", []))
    assert not isinstance(err.value, RunFailed)
    assert calls("m-1", "connection_error") - before >= 3


def test_the_breaker_sends_calls_to_the_fallback_and_says_so(model_url: str) -> None:
    text = "handler fallback"
    h = handler(model_url, model=DOWN_MODEL, fallback_model="m-up", call_policy=FAST)

    async def two_runs() -> tuple[list[Any], list[Any]]:
        first: list[Any] = []
        second: list[Any] = []
        try:
            async for item in h.stream(RunContext("r-1", "u1", {"text": text}, 1)):
                first.append(item)
            async for item in h.stream(RunContext("r-2", "u1", {"text": text + " 2"}, 1)):
                second.append(item)
        finally:
            await h.aclose()
        return first, second

    first, second = asyncio.run(two_runs())
    statuses = [json.loads(i.content) for i in first if isinstance(i, Status)]
    assert statuses == [
        {"model": "m-up", "fallback": True, "reason": f"the primary model {DOWN_MODEL} is failing"}
    ]
    assert first.index(next(i for i in first if isinstance(i, Status))) < first.index(PIECES[0])
    assert [i.model for i in first if isinstance(i, Usage)] == ["m-up"]
    assert [r["model"] for r in requests_for(text)] == [DOWN_MODEL, DOWN_MODEL, "m-up"]
    # The breaker is open: the next run goes to the fallback at once, and says so too.
    assert [r["model"] for r in requests_for(text + " 2")] == ["m-up"]
    assert [json.loads(i.content)["model"] for i in second if isinstance(i, Status)] == ["m-up"]
    assert REGISTRY.get_sample_value("koda_model_breaker_open", {"model": DOWN_MODEL}) == 1


def test_a_fallback_that_is_the_primary_is_refused(model_url: str) -> None:
    from koda_runtime.errors import ConfigError

    with pytest.raises(ConfigError, match="KODA_FALLBACK_MODEL='m-1' is KODA_OPENAI_MODEL"):
        handler(model_url, fallback_model="m-1")


# -- runs through a worker ---------------------------------------------------------------

WORKER_ENV = {"KODA_HANDLER": "openai", "KODA_MEMORY": "false", "KODA_OPENAI_API_KEY": "sk-test"}


MAIN = "m-main"


@pytest.fixture(scope="module")
def worker(module_env: Settings, model_url: str) -> Iterator[WorkerProcess]:
    """A worker with the default retry settings (no fallback), on a priced model."""
    price(module_env, MAIN)
    env = {**WORKER_ENV, "KODA_OPENAI_BASE_URL": model_url, "KODA_OPENAI_MODEL": MAIN}
    w = WorkerProcess(module_env, "faults-w1", env).start()
    yield w
    w.stop()


def price(settings: Settings, model: str) -> None:
    """Prompt 1, cached prompt 0.25, completion 4, reasoning 8 USD per million tokens."""
    from koda_runtime.schemas.db import async_engine

    async def go() -> None:
        engine = async_engine(settings, pool_size=1)
        try:
            async with engine.begin() as conn:
                await set_price(
                    conn,
                    model,
                    Decimal(1),
                    Decimal(4),
                    None,
                    cached_prompt_usd_per_mtok=Decimal("0.25"),
                    reasoning_usd_per_mtok=Decimal(8),
                )
        finally:
            await engine.dispose()

    asyncio.run(go())


def ledger_of(submitter: Submitter, run_id: str) -> list[Any]:
    return submitter.query(
        "SELECT attempt, call_index, model, outcome, estimated, prompt_tokens,"
        " completion_tokens, cached_tokens, reasoning_tokens, cost_usd"
        " FROM ledger WHERE run_id = :r ORDER BY attempt, call_index",
        r=run_id,
    )


def run_row(submitter: Submitter, run_id: str) -> Any:
    (row,) = submitter.query(
        "SELECT status, attempt, failures, error FROM runs WHERE id = :r", r=run_id
    )
    return row


def dead_letters(settings: Settings, run_id: str) -> list[dict[str, Any]]:
    letters = [json.loads(m.value()) for m in read_topic(settings, settings.names.topic(RUNS_DLQ))]
    return [d for d in letters if d.get("run_id") == run_id]


def test_a_run_meeting_a_429_waits_and_is_done_in_one_attempt(
    module_env: Settings, module_submitter: Submitter, worker: WorkerProcess
) -> None:
    text = "worker [fault:429]"
    run_id = module_submitter.submit("rl", {"text": text})
    wait_terminal(module_submitter, [run_id], 90, worker)
    row = run_row(module_submitter, run_id)
    assert (row.status, row.attempt, row.failures or 0) == ("done", 1, 0)
    first, second = requests_for(text)
    assert second["at"] - first["at"] >= 1.9
    assert module_submitter.output(run_id) == "".join(PIECES)
    assert [(r.attempt, r.outcome, r.estimated) for r in ledger_of(module_submitter, run_id)] == [
        (1, "ok", False)
    ]


def test_a_15_second_outage_is_outlived_inside_one_attempt_and_priced_apart(
    module_env: Settings, module_submitter: Submitter, worker: WorkerProcess
) -> None:
    """500s for 15 s, the default backoff: the run ends done in its first attempt; its one
    answered call is billed with its cached input and reasoning tokens priced apart."""
    text = "worker [fault:outage15]"
    run_id = module_submitter.submit("outage", {"text": text})
    wait_terminal(module_submitter, [run_id], 120, worker)
    row = run_row(module_submitter, run_id)
    assert (row.status, row.attempt, row.failures or 0) == ("done", 1, 0), row.error
    seen = requests_for(text)
    failed = [r for r in seen if r["status"] == 500]
    assert len(failed) >= 4 and seen[-1]["status"] == 200
    assert seen[-1]["at"] - seen[0]["at"] >= OUTAGE_S
    kinds = [m.kind for m in module_submitter.messages(run_id)]
    assert "reset" not in kinds and kinds[-1] == "done"
    (call,) = ledger_of(module_submitter, run_id)
    assert (call.model, call.outcome, call.prompt_tokens, call.completion_tokens) == (
        MAIN,
        "ok",
        20,
        5,
    )
    # (20 - 8 cached) x 1 + 8 x 0.25 + (5 - 2 reasoning) x 4 + 2 x 8, per million tokens.
    expected = (Decimal(12) + Decimal(8) * Decimal("0.25") + 3 * 4 + 2 * 8) / MICRO
    assert (call.cached_tokens, call.reasoning_tokens, call.cost_usd) == (8, 2, expected)
    assert FAULTY_USAGE["prompt_tokens_details"] == {"cached_tokens": 8}
    result = koda(
        module_env, "usage", "report", "--by", "model", "--user", "outage", "--format", "json"
    )
    assert result.exit_code == 0, result.output
    (report,) = json.loads(result.output)["rows"]
    assert (report["model"], report["cached_tokens"], report["reasoning_tokens"]) == (MAIN, 8, 2)
    assert Decimal(report["cached_cost_usd"]) == Decimal(8) * Decimal("0.25") / MICRO
    assert Decimal(report["reasoning_cost_usd"]) == Decimal(2 * 8) / MICRO
    assert Decimal(report["cost_usd"]) == expected


def test_prices_take_cached_input_and_reasoning_rates(module_env: Settings) -> None:
    done = koda(
        module_env, "prices", "set", "m-cli", "--prompt", "2", "--completion", "8",
        "--cached-prompt", "0.5", "--reasoning", "12",
    )  # fmt: skip
    assert done.exit_code == 0, done.output
    assert "cached prompt 0.50000000 reasoning 12.00000000 USD/Mtok" in done.output
    listed = koda(module_env, "prices", "list", "--model", "m-cli", "--format", "json")
    (row,) = json.loads(listed.output)["prices"]
    assert (row["cached_prompt_usd_per_mtok"], row["reasoning_usd_per_mtok"]) == (
        "0.50000000",
        "12.00000000",
    )
    bad = koda(module_env, "prices", "set", "m-cli2", "--prompt", "1", "--completion", "1",
               "--reasoning", "-3")  # fmt: skip
    assert bad.exit_code == 2 and "--reasoning must be a finite amount >= 0" in bad.output
    assert json.loads(
        koda(module_env, "prices", "list", "--model", "m-cli2", "--format", "json").output
    ) == {"prices": []}


def test_a_401_fails_the_run_at_once_unbilled_and_not_dead_lettered(
    module_env: Settings, module_submitter: Submitter, worker: WorkerProcess
) -> None:
    text = "worker [fault:401]"
    run_id = module_submitter.submit("badkey", {"text": text})
    wait_terminal(module_submitter, [run_id], 90, worker)
    row = run_row(module_submitter, run_id)
    assert (row.status, row.attempt, row.failures) == ("failed", 1, 1)
    assert "HTTP 401" in row.error and "Incorrect API key provided" in row.error
    assert "sk-test" not in row.error
    assert len(requests_for(text)) == 1
    (end,) = [m for m in module_submitter.messages(run_id) if m.kind == "error"]
    assert "HTTP 401" in json.loads(end.content)["error"]
    assert ledger_of(module_submitter, run_id) == []
    assert dead_letters(module_env, run_id) == []


def test_a_stream_cut_mid_answer_reruns_the_attempt_after_a_reset(
    module_env: Settings, module_submitter: Submitter, worker: WorkerProcess
) -> None:
    text = "worker [fault:cut]"
    run_id = module_submitter.submit("cut", {"text": text})
    wait_terminal(module_submitter, [run_id], 90, worker)
    row = run_row(module_submitter, run_id)
    assert (row.status, row.attempt, row.failures) == ("done", 2, 1)
    kinds = [m.kind for m in module_submitter.messages(run_id)]
    assert kinds == ["chunk"] * 3 + ["reset"] + ["chunk"] * 5 + ["done"]
    assert module_submitter.output(run_id) == "".join(PIECES)  # once, after the reset
    got = [(r.attempt, r.outcome, r.estimated) for r in ledger_of(module_submitter, run_id)]
    assert got == [(1, "failed", True), (2, "ok", False)]


def test_a_primary_down_for_good_is_answered_by_the_fallback(
    module_env: Settings, module_submitter: Submitter, model_url: str, worker: WorkerProcess
) -> None:
    w = WorkerProcess(
        module_env,
        "faults-fallback",
        {
            **WORKER_ENV,
            "KODA_OPENAI_BASE_URL": model_url,
            "KODA_OPENAI_MODEL": DOWN_MODEL,
            "KODA_FALLBACK_MODEL": "m-backup",
            "KODA_MODEL_BREAKER_FAILURES": "2",
            "KODA_MODEL_RETRY_BASE": "0.1",
        },
    )
    worker.stop()  # hand the partitions to the new worker
    w.start()
    try:
        text = "worker primary down"
        run_id = module_submitter.submit("fb", {"text": text})
        wait_terminal(module_submitter, [run_id], 90, w)
    finally:
        w.stop()
    row = run_row(module_submitter, run_id)
    assert (row.status, row.attempt) == ("done", 1), row.error
    assert [r["model"] for r in requests_for(text)] == [DOWN_MODEL, DOWN_MODEL, "m-backup"]
    messages = module_submitter.messages(run_id)
    statuses = [json.loads(m.content) for m in messages if m.kind == "status"]
    assert [s["model"] for s in statuses] == ["m-backup"] and statuses[0]["fallback"] is True
    assert [m.kind for m in messages][0] == "status"  # before the fallback's first token
    assert module_submitter.output(run_id) == "".join(PIECES)
    assert [(r.model, r.outcome) for r in ledger_of(module_submitter, run_id)] == [
        ("m-backup", "ok")
    ]
