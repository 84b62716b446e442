"""A run that waits for a person, against Kafka, a worker process, PostgreSQL and the
gateway's approve/reject routes: approve, reject, the timeout, a cancel while waiting,
per-user order with no slot held, and the refusals."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from koda_runtime.processors.tools.toolbox import REJECTED, TIMED_OUT
from koda_runtime.settings import Settings
from tests.fixtures.processes import WorkerProcess
from tests.fixtures.runs import Submitter
from tests.fixtures.tool_model import (
    answer_piece,
    calls_of,
    script,
    serve_counting,
    serve_tool_model,
)
from tests.sse_client import bearer
from tests.support import wait_until

TIMEOUT_S = 6  # the worker's KODA_APPROVAL_TIMEOUT_S
PAY = ("transfer", {"amount": 40, "to": "ana"})
APPROVAL = "approval_required"


@pytest.fixture(scope="module")
def worker(module_env: Settings) -> Iterator[WorkerProcess]:
    model_url, model = serve_tool_model()
    service_url, service = serve_counting()
    env = {
        "KODA_HANDLER": "openai",
        "KODA_OPENAI_BASE_URL": model_url,
        "KODA_MEMORY": "false",
        "KODA_TOOLS": "tests.fixtures.tools",
        "KODA_TEST_TOOL_SERVICE": service_url,
        "KODA_APPROVAL_TIMEOUT_S": str(TIMEOUT_S),
        "KODA_MAX_INFLIGHT": "1",  # a waiting run must not hold the only slot
    }
    w = WorkerProcess(module_env, "approvals-w1", env).start()
    wait_until(lambda: "run-control tail started" in w.log(), timeout=60, what="control tail")
    yield w
    w.stop()
    model.shutdown()
    service.shutdown()


def status(sub: Submitter, run_id: str) -> str:
    return sub.statuses([run_id])[run_id]


def reaches(sub: Submitter, w: WorkerProcess, run_id: str, *wanted: str) -> str:
    def there() -> bool:
        assert w.alive(), w.log()[-3000:]
        return status(sub, run_id) in wanted

    wait_until(there, timeout=60, interval=0.1, what=f"run {run_id} {'/'.join(wanted)}")
    return status(sub, run_id)


def decide(url: str, user: str, run_id: str, what: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/runs/{run_id}/{what}", headers=bearer(user), timeout=30)


def sse_kinds_until(url: str, user: str, run_id: str, last: str) -> list[str]:
    """The event kinds a viewer of the run's SSE stream gets, up to ``last``."""
    seen: list[str] = []
    with httpx.stream(
        "GET", f"{url}/v1/runs/{run_id}/events", headers=bearer(user), timeout=30
    ) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("event:"):
                seen.append(line[6:].strip())
                if seen[-1] == last:
                    break
    return seen


def kinds(sub: Submitter, run_id: str) -> list[str]:
    return [m.kind for m in sub.messages(run_id)]


def results(sub: Submitter, run_id: str) -> list[str]:
    events = [json.loads(m.content) for m in sub.messages(run_id) if m.kind == "tool"]
    return [str(e["result"]) for e in events if "result" in e]


def step(sub: Submitter, run_id: str) -> Any:
    (row,) = sub.query("SELECT * FROM tool_steps WHERE run_id = :r", r=run_id)
    return row


def test_an_approved_call_runs_once_after_the_wait(
    module_submitter: Submitter, worker: WorkerProcess, gateway_url: str
) -> None:
    sub = module_submitter
    run_id = sub.submit("ana", script(PAY))
    assert reaches(sub, worker, run_id, "waiting") == "waiting"
    (asked,) = [
        json.loads(m.content) for m in sub.messages(run_id) if m.kind == "approval_required"
    ]
    assert asked["name"] == "transfer" and asked["arguments"] == {"amount": 40, "to": "ana"}
    assert asked["step"] == 1 and asked["call_id"] == "call_0_0"
    assert calls_of(run_id) == 0  # nothing is sent before a person says so
    assert sse_kinds_until(gateway_url, "ana", run_id, APPROVAL)[-2:] == ["tool", APPROVAL]
    answer = decide(gateway_url, "ana", run_id, "approve")
    assert answer.status_code == 200, answer.text
    assert answer.json() == {
        "run_id": run_id, "step": 1, "tool": "transfer", "decision": "approved",
        "status": "waiting",
    }  # fmt: skip
    assert reaches(sub, worker, run_id, "done", "failed", "cancelled") == "done"
    assert calls_of(run_id) == 1
    assert json.loads(results(sub, run_id)[-1])["booked"] == "transfer to ana"
    row = step(sub, run_id)
    assert (row.status, row.decision, row.decided_by, row.calls) == (
        "finished", "approved", "user:ana", 1,
    )  # fmt: skip
    assert sub.output(run_id) == "".join(answer_piece(n) for n in range(3))
    # Idempotent: the same answer again is 200; the other one is 409.
    assert decide(gateway_url, "ana", run_id, "approve").status_code == 200
    late = decide(gateway_url, "ana", run_id, "reject")
    assert late.status_code == 409 and "already approved" in late.text
    assert calls_of(run_id) == 1


def test_a_rejected_call_is_not_made_and_the_model_is_told(
    module_submitter: Submitter, worker: WorkerProcess, gateway_url: str
) -> None:
    sub = module_submitter
    run_id = sub.submit("ben", script(PAY))
    reaches(sub, worker, run_id, "waiting")
    assert decide(gateway_url, "ben", run_id, "reject").status_code == 200
    assert reaches(sub, worker, run_id, "done", "failed", "cancelled") == "done"
    assert calls_of(run_id) == 0
    assert results(sub, run_id)[-1] == REJECTED
    assert (step(sub, run_id).decision, step(sub, run_id).decided_by) == ("rejected", "user:ben")


def test_nobody_answering_rejects_it_after_the_timeout(
    module_submitter: Submitter, worker: WorkerProcess
) -> None:
    sub = module_submitter
    run_id = sub.submit("cyd", script(PAY))
    reaches(sub, worker, run_id, "waiting")
    wait_until(
        lambda: status(sub, run_id) == "done", timeout=TIMEOUT_S + 30, what="timed out, done"
    )
    assert calls_of(run_id) == 0 and results(sub, run_id)[-1] == TIMED_OUT
    assert (step(sub, run_id).decision, step(sub, run_id).decided_by) == ("rejected", "timeout")


def test_a_cancel_while_waiting_ends_it_cancelled(
    module_submitter: Submitter, worker: WorkerProcess, gateway_url: str
) -> None:
    sub = module_submitter
    run_id = sub.submit("dee", script(PAY))
    reaches(sub, worker, run_id, "waiting")
    r = httpx.post(f"{gateway_url}/v1/runs/{run_id}/cancel", headers=bearer("dee"), timeout=30)
    assert r.status_code == 202, r.text
    assert reaches(sub, worker, run_id, "done", "failed", "cancelled") == "cancelled"
    assert kinds(sub, run_id)[-1] == "cancelled" and calls_of(run_id) == 0
    late = decide(gateway_url, "dee", run_id, "approve")
    assert late.status_code == 409 and "not waiting" in late.text


def test_the_users_next_run_waits_behind_it_while_others_run(
    module_submitter: Submitter, worker: WorkerProcess, gateway_url: str
) -> None:
    """One slot (KODA_MAX_INFLIGHT=1): another user's run finishing while this one waits
    shows the wait holds no slot; the same user's next run waits for it."""
    sub = module_submitter
    first = sub.submit("eve", script(PAY))
    reaches(sub, worker, first, "waiting")
    second = sub.submit("eve", script())  # calls nothing (its own script, not the first's)
    other = sub.submit("fay", {"text": "hello"})
    assert reaches(sub, worker, other, "done", "failed") == "done"
    assert status(sub, second) == "pending"  # behind the waiting run
    assert decide(gateway_url, "eve", first, "approve").status_code == 200
    assert reaches(sub, worker, second, "done", "failed") == "done"
    assert status(sub, first) == "done"
    assert (step(sub, first).decision, step(sub, first).decided_by) == ("approved", "user:eve")
    (a, b) = sub.query(
        "SELECT finished_at FROM runs WHERE id IN (:a, :b) ORDER BY created_at", a=first, b=second
    )
    assert a.finished_at <= b.finished_at


def test_deciding_a_run_that_does_not_wait_is_refused(
    module_submitter: Submitter, worker: WorkerProcess, gateway_url: str
) -> None:
    sub = module_submitter
    done = sub.submit("gus", {"text": "hi"})
    reaches(sub, worker, done, "done")
    for what in ("approve", "reject"):
        r = decide(gateway_url, "gus", done, what)
        assert r.status_code == 409 and "not waiting for an approval (status done)" in r.text
    pending = sub.submit("gus", {"text": "not published"}, publish=False)
    assert decide(gateway_url, "gus", pending, "approve").status_code == 409
    assert decide(gateway_url, "mallory", done, "approve").status_code == 404  # not theirs
    assert decide(gateway_url, "gus", "no-such-run", "approve").status_code == 404
    with sub.engine.begin() as conn:  # leave nothing pending behind for gus
        from sqlalchemy import text

        conn.execute(text("UPDATE runs SET status = 'cancelled' WHERE id = :r"), {"r": pending})
