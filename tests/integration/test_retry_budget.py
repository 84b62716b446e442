"""The retry budget counts handler failures, not claims (found by the chaos run).

A run cut off at three handoffs in a row had been claimed four times and was failed with
"attempts exhausted" although its handler never failed. Now ``runs.failures`` carries
the handler failures across workers: resumptions are free up to a larger bound on claims
(KODA_MAX_ATTEMPTS x 3), failures still stop at KODA_MAX_ATTEMPTS.
"""

from __future__ import annotations

import json

from koda_runtime.processors.handlers.demo import demo_tokens
from koda_runtime.settings import Settings
from koda_runtime.topics.catalogue import RUNS_DLQ
from tests.fixtures.processes import WorkerProcess
from tests.fixtures.runs import Submitter, read_topic
from tests.support import wait_until


def as_if_claimed(sub: Submitter, run_id: str, *, attempt: int, failures: int | None) -> None:
    """The state a run is left in after ``attempt`` claims that wrote a first chunk."""
    with sub.engine.begin() as conn:
        from sqlalchemy import text

        conn.execute(
            text(
                "UPDATE runs SET status = 'streaming', attempt = :a, failures = :f,"
                " started_at = now(), first_chunk_at = now() WHERE id = :id"
            ),
            {"a": attempt, "f": failures, "id": run_id},
        )
        conn.execute(
            text(
                "INSERT INTO messages (run_id, seq, kind, content, attempt)"
                " VALUES (:id, 0, 'chunk', 'partial ', :a)"
            ),
            {"id": run_id, "a": attempt},
        )


def test_resumptions_do_not_use_up_the_retry_budget(env: Settings) -> None:
    sub = Submitter(env)
    worker = WorkerProcess(env, "budget").start()
    try:
        inp = {"text": "cut off three times", "demo": {"tokens": 4, "delay_ms": 1}}
        resumed = sub.submit("budget-a", inp, publish=False)
        as_if_claimed(sub, resumed, attempt=3, failures=None)  # three cut-offs, no failure
        failed_twice = sub.submit(
            "budget-b",
            {"text": "failed twice", "demo": {"tokens": 4, "delay_ms": 1, "fail_attempts": 99}},
            publish=False,
        )
        as_if_claimed(sub, failed_twice, attempt=2, failures=2)
        spent = sub.submit("budget-c", {"text": "all failed", "demo": {"tokens": 4}}, publish=False)
        as_if_claimed(sub, spent, attempt=3, failures=3)  # died before writing `failed`
        looping = sub.submit("budget-d", {"text": "kills its worker"}, publish=False)
        as_if_claimed(sub, looping, attempt=9, failures=0)
        for run_id, user in (
            (resumed, "budget-a"),
            (failed_twice, "budget-b"),
            (spent, "budget-c"),
            (looping, "budget-d"),
        ):
            sub.publish(run_id, user)
        ids = [resumed, failed_twice, spent, looping]
        wait_until(lambda: sub.all_terminal(ids), timeout=60, what="runs terminal")
        rows = {
            r.id: r
            for r in sub.query(
                "SELECT id, status, attempt, failures, error FROM runs WHERE id = ANY(:i)", i=ids
            )
        }
        assert (rows[resumed].status, rows[resumed].attempt) == ("done", 4)
        msgs = sub.messages(resumed)
        assert [m.kind for m in msgs][:2] == ["chunk", "reset"]
        text = "".join(m.content for m in msgs if m.kind == "chunk" and m.seq > 1)
        assert text == "".join(demo_tokens(inp))
        # One more real failure uses the budget up: the third.
        assert (rows[failed_twice].status, rows[failed_twice].failures) == ("failed", 3)
        assert "fail_attempts" in rows[failed_twice].error
        # Budget already spent: given up at once, the handler not run again.
        assert (rows[spent].status, rows[spent].error) == ("failed", "attempts exhausted")
        assert [m.kind for m in sub.messages(spent)] == ["chunk", "error"]
        assert rows[looping].status == "failed" and "claimed 9 times" in rows[looping].error
        dead = sorted(
            json.loads(m.value())["reason"] for m in read_topic(env, env.names.topic(RUNS_DLQ))
        )
        assert dead == ["handler_failed"] * 3
    finally:
        worker.stop()
        sub.close()
