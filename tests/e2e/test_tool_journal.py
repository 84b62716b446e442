"""The journal of tool steps across a worker's death, a frozen worker's handoff and a
merge: a side effect happens once (processors/tools/). Slow: every test kills, freezes
or restarts worker processes and waits out a session timeout."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from koda_runtime.settings import Settings
from koda_runtime.topics.catalogue import partition_for_key
from tests.fixtures.processes import WorkerPool, WorkerProcess
from tests.fixtures.runs import Submitter
from tests.fixtures.tool_model import (
    Counting,
    answer_piece,
    calls_of,
    script,
    serve_counting,
    serve_tool_model,
)
from tests.sse_client import bearer
from tests.support import wait_until

BOOK = ("book", {"item": "dinner", "seats": 2})
# Slow enough to be cut mid-answer: 20 pieces 0.2 s apart.
SLOW: dict[str, Any] = {"pieces": 20, "delay_s": 0.2}


@pytest.fixture(scope="module")
def services() -> Iterator[dict[str, str]]:
    model_url, model = serve_tool_model()
    service_url, service = serve_counting()
    yield {
        "KODA_HANDLER": "openai",
        "KODA_OPENAI_BASE_URL": model_url,
        "KODA_MEMORY": "false",
        "KODA_TOOLS": "tests.fixtures.tools",
        "KODA_TEST_TOOL_SERVICE": service_url,
    }
    model.shutdown()
    service.shutdown()


@pytest.fixture
def pool(module_env: Settings) -> Iterator[WorkerPool]:
    with WorkerPool(module_env, kill_at_end=True) as p:
        yield p


def owners(sub: Submitter) -> dict[int, str]:
    return {r.partition: r.worker_id for r in sub.query(
        "SELECT partition, worker_id FROM partition_epochs")}  # fmt: skip


def holds_all(sub: Submitter, settings: Settings, *names: str) -> bool:
    o = owners(sub)
    return len(o) == settings.partitions and set(o.values()) == set(names)


def tool_results(sub: Submitter, run_id: str) -> list[dict[str, Any]]:
    events = [json.loads(m.content) for m in sub.messages(run_id) if m.kind == "tool"]
    return [e for e in events if "result" in e]


def step_row(sub: Submitter, run_id: str) -> Any:
    (row,) = sub.query("SELECT * FROM tool_steps WHERE run_id = :r", r=run_id)
    return row


def result_recorded(sub: Submitter, run_id: str) -> bool:
    """The tool returned, its result is journaled and the answer has begun."""
    kinds = [m.kind for m in sub.messages(run_id)]
    return "chunk" in kinds and bool(
        sub.query("SELECT 1 FROM tool_steps WHERE run_id = :r AND status = 'finished'", r=run_id)
    )


def run_row(sub: Submitter, run_id: str) -> Any:
    return sub.query("SELECT status, attempt, worker_id FROM runs WHERE id = :r", r=run_id)[0]


def answer() -> str:
    return "".join(answer_piece(n) for n in range(SLOW["pieces"]))


def start(pool: WorkerPool, name: str, services: dict[str, str]) -> WorkerProcess:
    return pool.start(name, **services)


def test_a_worker_killed_after_the_tool_returned_calls_it_once(
    module_env: Settings, module_submitter: Submitter, pool: WorkerPool, services: dict[str, str]
) -> None:
    sub = module_submitter
    a = start(pool, "kill-a", services)
    wait_until(lambda: holds_all(sub, module_env, "kill-a"), timeout=60, what="a holds all")
    run_id = sub.submit("kim", script(BOOK, **SLOW))
    wait_until(lambda: result_recorded(sub, run_id), timeout=60, what="tool returned on a")
    a.kill()  # kill -9 mid-answer
    b = start(pool, "kill-b", services)
    wait_until(lambda: sub.all_terminal([run_id]), timeout=90, what="run ended on b")
    assert run_row(sub, run_id).status == "done", b.log()[-3000:]
    assert run_row(sub, run_id).worker_id == "kill-b"
    assert calls_of(run_id) == 1  # the rerun replayed the journaled result
    first, second = tool_results(sub, run_id)
    assert first["result"] == second["result"] and second["replayed"] is True
    row = step_row(sub, run_id)
    assert (row.status, row.calls, row.attempt) == ("finished", 1, 1)
    assert sub.output(run_id) == answer()
    assert f"tool step replayed run_id={run_id} step=1 tool=book" in b.log()


def test_a_frozen_worker_handed_off_calls_it_once_and_writes_nothing_after(
    module_env: Settings, module_submitter: Submitter, pool: WorkerPool, services: dict[str, str]
) -> None:
    sub = module_submitter
    a = start(pool, "stop-a", services)
    start(pool, "stop-b", services)
    wait_until(lambda: holds_all(sub, module_env, "stop-a", "stop-b"), timeout=60, what="both hold")
    held = {p for p, w in owners(sub).items() if w == "stop-a"}
    user = next(
        u
        for u in (f"frozen-{i}" for i in range(1000))
        if partition_for_key(u.encode(), module_env.partitions) in held
    )
    run_id = sub.submit(user, script(BOOK, **SLOW))
    wait_until(lambda: result_recorded(sub, run_id), timeout=60, what="tool returned on a")
    a.signal(signal.SIGSTOP)
    wait_until(lambda: run_row(sub, run_id).attempt == 2, timeout=60, what="b claimed the run")
    frozen_rows = len([m for m in sub.messages(run_id) if m.attempt == 1])
    a.signal(signal.SIGCONT)
    wait_until(lambda: sub.all_terminal([run_id]), timeout=90, what="run ended on b")
    wait_until(
        lambda: "fenced out" in a.log() or "partition lost" in a.log(),
        timeout=30,
        what="a noticed it was fenced",
    )
    assert (run_row(sub, run_id).status, run_row(sub, run_id).worker_id) == ("done", "stop-b")
    assert calls_of(run_id) == 1
    row = step_row(sub, run_id)
    assert (row.status, row.calls, row.attempt) == ("finished", 1, 1)
    # Nothing of a's after it froze: not its answer, not a journal write.
    assert len([m for m in sub.messages(run_id) if m.attempt == 1]) == frozen_rows
    assert sub.output(run_id) == answer()
    assert tool_results(sub, run_id)[-1]["replayed"] is True


def post(url: str, user: str, inp: dict[str, Any], session: str) -> dict[str, Any]:
    r = httpx.post(
        f"{url}/v1/runs",
        json={"input": inp, "session_id": session},
        headers=bearer(user),
        timeout=30,
    )
    assert r.status_code == 202, r.text
    return dict(r.json())


def test_a_merge_after_a_tool_call_replays_it_or_records_a_new_step(
    module_env: Settings,
    module_submitter: Submitter,
    pool: WorkerPool,
    services: dict[str, str],
    gateway_url: str,
) -> None:
    """The same call after the merge is replayed (one booking); a different one leaves
    the journal: the old step is superseded and a new step, with its own key, runs."""
    sub = module_submitter
    w = start(pool, "merge-a", services)
    wait_until(lambda: holds_all(sub, module_env, "merge-a"), timeout=60, what="w holds all")
    wait_until(lambda: "run-control tail started" in w.log(), timeout=60, what="control tail")
    same = sub.submit("mia", script(BOOK, **SLOW))
    other = sub.submit("max", script(BOOK, **SLOW))
    for run_id in (same, other):
        wait_until(
            lambda r=run_id: result_recorded(sub, r),  # type: ignore[misc]
            timeout=60,
            what="tool returned",
        )
    assert post(gateway_url, "mia", {"text": "at eight, please"}, "s-mia")["merged"] is True
    lunch = script(("book", {"item": "lunch", "seats": 1}))
    assert post(gateway_url, "max", lunch, "s-max")["merged"] is True
    wait_until(lambda: sub.all_terminal([same, other]), timeout=90, what="merged runs ended")
    assert sub.statuses([same, other]) == {same: "done", other: "done"}, w.log()[-3000:]
    assert calls_of(same) == 1 and Counting.calls[f"{same}:1"] == 1
    assert tool_results(sub, same)[-1]["replayed"] is True
    assert sub.output(same) == answer()
    # The model asked something else: step 1 superseded, step 2 called once.
    assert (Counting.calls[f"{other}:1"], Counting.calls[f"{other}:2"]) == (1, 1)
    steps = sub.query(
        "SELECT step, position, status, superseded_at IS NOT NULL AS gone, arguments"
        " FROM tool_steps WHERE run_id = :r ORDER BY step",
        r=other,
    )
    assert [(s.step, s.position, s.status, s.gone) for s in steps] == [
        (1, 1, "finished", True),
        (2, 1, "finished", False),
    ]
    assert steps[1].arguments == '{"item":"lunch","seats":1}'


# --- a run that waits for a person, across a worker's death and a handoff ----------------

PAY = ("transfer", {"amount": 40, "to": "ana"})


def approve(url: str, user: str, run_id: str) -> None:
    r = httpx.post(f"{url}/v1/runs/{run_id}/approve", headers=bearer(user), timeout=30)
    assert r.status_code == 200, r.text


def still_waiting(w: WorkerProcess, run_id: str) -> bool:
    return f"run still waiting run_id={run_id}" in w.log()


def test_an_approval_given_while_the_worker_is_dead_is_acted_on_by_the_next(
    module_env: Settings,
    module_submitter: Submitter,
    pool: WorkerPool,
    services: dict[str, str],
    gateway_url: str,
) -> None:
    sub = module_submitter
    a = start(pool, "wait-a", services)
    wait_until(lambda: holds_all(sub, module_env, "wait-a"), timeout=60, what="a holds all")
    run_id = sub.submit("wes", script(PAY))
    wait_until(lambda: run_row(sub, run_id).status == "waiting", timeout=60, what="waiting")
    a.kill()  # kill -9 while the run waits
    b = start(pool, "wait-b", services)
    # b reads the record again (never acked) and finds the run waiting: it parks it.
    wait_until(lambda: still_waiting(b, run_id), timeout=60, what="b parked the run")
    assert (run_row(sub, run_id).status, run_row(sub, run_id).attempt) == ("waiting", 1)
    approve(gateway_url, "wes", run_id)
    wait_until(lambda: sub.all_terminal([run_id]), timeout=60, what="run ended on b")
    assert (run_row(sub, run_id).status, run_row(sub, run_id).worker_id) == ("done", "wait-b")
    assert calls_of(run_id) == 1
    assert [m.kind for m in sub.messages(run_id)].count("approval_required") == 1


def test_an_approval_after_a_handoff_while_waiting_is_acted_on_by_the_new_owner(
    module_env: Settings,
    module_submitter: Submitter,
    pool: WorkerPool,
    services: dict[str, str],
    gateway_url: str,
) -> None:
    sub = module_submitter
    a = start(pool, "hand-a", services)
    wait_until(lambda: holds_all(sub, module_env, "hand-a"), timeout=60, what="a holds all")
    run_id = sub.submit("hal", script(PAY))
    wait_until(lambda: run_row(sub, run_id).status == "waiting", timeout=60, what="waiting")
    b = start(pool, "hand-b", services)  # joins: the partitions are shared out
    wait_until(lambda: holds_all(sub, module_env, "hand-a", "hand-b"), timeout=60, what="b joined")
    assert a.stop() == 0  # leaves: its parked record is dropped unacked, not waited for
    wait_until(lambda: holds_all(sub, module_env, "hand-b"), timeout=60, what="b holds all")
    wait_until(lambda: still_waiting(b, run_id), timeout=60, what="b parked the run")
    approve(gateway_url, "hal", run_id)
    wait_until(lambda: sub.all_terminal([run_id]), timeout=60, what="run ended on b")
    assert (run_row(sub, run_id).status, run_row(sub, run_id).worker_id) == ("done", "hand-b")
    assert calls_of(run_id) == 1
