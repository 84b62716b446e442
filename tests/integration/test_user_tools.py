"""Tools users add, against Kafka, a worker process and PostgreSQL: a side effect
called once and journaled, every kind of failing call answered to the model, the
journal's fence, and a worker that refuses a bad tools module."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import pytest
from sqlalchemy import text

from koda_runtime.processors.fences import FencedOut
from koda_runtime.processors.tools.journal import Journal
from koda_runtime.schemas.db import async_engine
from koda_runtime.schemas.epochs import Fence
from koda_runtime.settings import Settings
from tests.fixtures.processes import WorkerProcess
from tests.fixtures.runs import Submitter
from tests.fixtures.tool_model import (
    Counting,
    ToolModel,
    answer_piece,
    calls_of,
    script,
    serve_counting,
    serve_tool_model,
)
from tests.support import wait_until


@pytest.fixture(scope="module")
def services() -> Iterator[tuple[str, str]]:
    model_url, model = serve_tool_model()
    service_url, service = serve_counting()
    yield model_url, service_url
    model.shutdown()
    service.shutdown()


def tool_worker_env(model_url: str, service_url: str, **extra: str) -> dict[str, str]:
    return {
        "KODA_HANDLER": "openai",
        "KODA_OPENAI_BASE_URL": model_url,
        "KODA_MEMORY": "false",
        "KODA_TOOLS": "tests.fixtures.tools",
        "KODA_TEST_TOOL_SERVICE": service_url,
        **extra,
    }


@pytest.fixture(scope="module")
def worker(module_env: Settings, services: tuple[str, str]) -> Iterator[WorkerProcess]:
    w = WorkerProcess(module_env, "tools-user-w1", tool_worker_env(*services)).start()
    yield w
    w.stop()


def finished(sub: Submitter, run_id: str, w: WorkerProcess, timeout: float = 90) -> str:
    def terminal() -> bool:
        assert w.alive(), w.log()[-3000:]
        return sub.all_terminal([run_id])

    wait_until(terminal, timeout=timeout, interval=0.2, what=f"run {run_id} terminal")
    return sub.statuses([run_id])[run_id]


def tool_events(sub: Submitter, run_id: str) -> list[dict[str, object]]:
    return [json.loads(m.content) for m in sub.messages(run_id) if m.kind == "tool"]


def test_a_side_effect_is_called_once_journaled_and_shown(
    module_submitter: Submitter, worker: WorkerProcess
) -> None:
    sub = module_submitter
    run_id = sub.submit("ana", script(("book", {"item": "dinner", "seats": 2})))
    assert finished(sub, run_id, worker) == "done", worker.log()[-3000:]
    assert calls_of(run_id) == 1
    assert Counting.calls[f"{run_id}:1"] == 1  # the idempotency key is run id + step
    events = tool_events(sub, run_id)
    assert [("arguments" in e, e["name"]) for e in events] == [(True, "book"), (False, "book")]
    result = json.loads(str(events[1]["result"]))
    assert result == {"booked": "dinner", "seats": 2, "key": f"{run_id}:1"}
    (step,) = sub.query("SELECT * FROM tool_steps WHERE run_id = :r", r=run_id)
    assert (step.step, step.position, step.tool, step.status, step.calls, step.attempt) == (
        1, 1, "book", "finished", 1, 1,
    )  # fmt: skip
    assert step.arguments == '{"item":"dinner","seats":2}' and json.loads(step.result) == result
    assert sub.output(run_id) == "".join(answer_piece(n) for n in range(3))
    # The model was offered every tool with its schema, and given the result.
    last = ToolModel.seen[-1]
    offered = {t["function"]["name"]: t["function"] for t in last["tools"]}
    assert set(offered) == {"book", "weather", "stuck", "broken", "odd", "transfer"}
    assert offered["book"]["parameters"]["required"] == ["item", "seats"]
    assert "ctx" not in offered["book"]["parameters"]["properties"]


def test_every_failing_call_is_an_error_result_and_the_run_goes_on(
    module_submitter: Submitter, worker: WorkerProcess
) -> None:
    sub = module_submitter
    run_id = sub.submit(
        "ben",
        script(
            [
                ("book", {"item": "x", "seats": "many"}),
                ("book", "{not json"),
                ("stuck", {"note": "n"}),
                ("broken", {"note": "n"}),
                ("odd", {"note": "n"}),
                ("weather", {"city": "Porto", "days": 2}),
                ("nope", {}),
            ]
        ),
    )
    assert finished(sub, run_id, worker) == "done", worker.log()[-3000:]
    results = [str(e["result"]) for e in tool_events(sub, run_id) if "result" in e]
    assert results[0].startswith("error: book arguments are invalid: seats: Input should be")
    assert results[1].startswith("error: book arguments are not valid JSON")
    assert results[2] == "error: tool 'stuck' did not answer within 0.3 s"
    assert results[3] == "error: tool 'broken' failed: RuntimeError: the backend is down (n)"
    assert results[4].startswith("error: tool 'odd' returned a value that is not JSON")
    assert results[5] == "sunny in Porto for 2 day(s)"
    assert results[6] == "error: there is no tool named 'nope'"
    assert calls_of(run_id) == 0  # the refused bookings never reached the service
    # Only the side effect that ran is journaled (its error is its result).
    steps = sub.query("SELECT tool, status, result FROM tool_steps WHERE run_id = :r", r=run_id)
    assert [(s.tool, s.status, s.result) for s in steps] == [("stuck", "finished", results[2])]


RUNNING = "UPDATE runs SET status = 'running', fence = 5 WHERE id = :r"
BUMPED = "UPDATE partition_epochs SET epoch = 6 WHERE topic = :t"
RECLAIMED = "UPDATE runs SET fence = 6, attempt = 2 WHERE id = :r"


def test_a_journal_write_under_a_lost_fence_is_refused(
    module_env: Settings, module_submitter: Submitter
) -> None:
    """The old owner's writes fail once the partition's epoch moved; the new owner calls
    the unfinished step again under its own fence."""
    sub = module_submitter
    run_id = sub.submit("cyd", {"text": "never published"}, publish=False)
    topic = "journal-fence-test"
    with sub.engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO partition_epochs (topic, partition, epoch, worker_id)"
                " VALUES (:t, 0, 5, 'old')"
            ),
            {"t": topic},
        )
        conn.execute(
            text("UPDATE runs SET status = 'running', fence = 5 WHERE id = :r"), {"r": run_id}
        )
    old, new = Fence(topic, 0, 5), Fence(topic, 0, 6)

    async def scenario() -> list[str]:
        engine = async_engine(module_env, pool_size=1)
        journal = Journal(engine)
        seen = []
        try:
            await journal.initiate(
                old, run_id, step=1, position=1, tool="book", arguments="{}", attempt=1
            )
            with sub.engine.begin() as conn:  # a new owner takes the partition and the run
                conn.execute(
                    text("UPDATE partition_epochs SET epoch = 6 WHERE topic = :t"), {"t": topic}
                )
                conn.execute(
                    text("UPDATE runs SET fence = 6, attempt = 2 WHERE id = :r"), {"r": run_id}
                )
            with pytest.raises(FencedOut, match="tool journal finish of step 1 fenced out"):
                await journal.finish(old, run_id, step=1, result="zombie's")
            with pytest.raises(FencedOut, match="tool journal initiate of step 2 fenced out"):
                await journal.initiate(
                    old, run_id, step=2, position=2, tool="book", arguments="{}", attempt=1
                )
            loaded = await journal.load(run_id)
            seen.append(f"{[(s.step, s.status) for s in loaded.steps]}")
            await journal.call_again(new, run_id, step=1, attempt=2)
            await journal.finish(new, run_id, step=1, result="owner's")
            loaded = await journal.load(run_id)
            seen.append(f"{[(s.step, s.status, s.result, s.calls) for s in loaded.steps]}")
        finally:
            await engine.dispose()
        return seen

    assert asyncio.run(scenario()) == [
        "[(1, 'initiated')]",
        "[(1, 'finished', \"owner's\", 2)]",
    ]


def test_a_worker_refuses_to_start_with_a_bad_tools_module(
    module_env: Settings, services: tuple[str, str]
) -> None:
    for module, says in [
        ("tests.fixtures.bad_tools", "tool 'erase'"),
        ("tests.fixtures.no_such_tools", "does not import"),
    ]:
        env = tool_worker_env(*services, KODA_TOOLS=module)
        w = WorkerProcess(module_env, "tools-bad", env)
        w.start()
        try:
            assert w.proc is not None and w.proc.wait(60) != 0
            assert module in w.log() and says in w.log(), w.log()[-2000:]
        finally:
            w.kill()
