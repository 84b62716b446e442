"""Memories are distilled after the run is done, off the path of the user's next run:
worker processes, Kafka and PostgreSQL, the demo handler's distillation slowed or
failed on purpose (its ``distil_pause_ms`` and ``distil_fail_tries`` switches)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from koda_runtime.settings import Settings
from tests.fixtures.processes import WorkerProcess
from tests.fixtures.runs import Submitter
from tests.support import wait_until

FAST = {"tokens": 3, "delay_ms": 0}
ENV = {"KODA_HANDLER": "demo", "KODA_MEMORY_DISTIL_LEASE_S": "2"}


@pytest.fixture
def started(module_env: Settings) -> Iterator[list[WorkerProcess]]:
    workers: list[WorkerProcess] = []
    yield workers
    for w in workers:
        w.kill()


def worker(module_env: Settings, started: list[WorkerProcess], name: str) -> WorkerProcess:
    started.append(WorkerProcess(module_env, name, ENV).start())
    return started[-1]


def done(submitter: Submitter, run_id: str, w: WorkerProcess) -> None:
    def terminal() -> bool:
        assert w.alive(), w.log()[-3000:]
        return submitter.all_terminal([run_id])

    wait_until(terminal, timeout=90, interval=0.1, what=f"run {run_id} terminal")
    assert submitter.statuses([run_id])[run_id] == "done", w.log()[-3000:]


def memories(submitter: Submitter, user: str) -> dict[str, str | None]:
    """The user's memories: text -> the id of the memory that superseded it."""
    rows = submitter.query("SELECT text, superseded_by FROM memories WHERE user_id = :u", u=user)
    return {r.text: r.superseded_by for r in rows}


def marker(submitter: Submitter, run_id: str) -> object | None:
    rows = submitter.query(
        "SELECT tries, last_error, gave_up_at FROM memory_distillations WHERE run_id = :r",
        r=run_id,
    )
    return rows[0] if rows else None


def test_the_next_run_does_not_wait_and_a_kill_before_distilling_loses_nothing(
    module_env: Settings, module_submitter: Submitter, started: list[WorkerProcess]
) -> None:
    s = module_submitter
    w1 = worker(module_env, started, "distil-w1")
    first = s.submit(
        "lia", {"text": "I live in Lisbon.", "demo": {**FAST, "distil_pause_ms": 600000}}
    )
    done(s, first, w1)
    wait_until(
        lambda: f"demo distil pause run_id={first} try=1" in w1.log(),
        timeout=60,
        what="the first run's distillation under way",
    )
    # The user's next run starts and ends while the first one's memory is still being
    # distilled: it waits for nothing.
    second = s.submit("lia", {"text": "What is the weather like?", "demo": FAST})
    done(s, second, w1)
    assert memories(s, "lia") == {}
    taken = marker(s, first)
    assert taken is not None and taken.tries == 1  # type: ignore[attr-defined]
    # kill -9 while distilling: the marker survives, a new worker takes it again once
    # the dead one's lease has passed, and the memory appears.
    w1.kill()
    # An idle worker (no record submitted to it) takes the marker: its distiller starts
    # with the worker, not with its first record.
    w2 = worker(module_env, started, "distil-w2")
    wait_until(
        lambda: memories(s, "lia") == {"I live in Lisbon.": None},
        timeout=60,
        interval=0.2,
        what="the first run's memory after the restart",
    )
    assert marker(s, first) is None
    assert f"event=memory_distilled run_id={first} try=2" in w2.log()
    # Later, the user moves: the newer statement supersedes, search keeps Berlin only.
    third = s.submit("lia", {"text": "I moved to Berlin.", "demo": FAST})
    done(s, third, w2)
    wait_until(
        lambda: len(memories(s, "lia")) == 2, timeout=60, interval=0.2, what="Berlin remembered"
    )
    (berlin_id,) = s.query(
        "SELECT id FROM memories WHERE user_id = 'lia' AND text = 'I moved to Berlin.'"
    )
    assert memories(s, "lia") == {"I live in Lisbon.": berlin_id.id, "I moved to Berlin.": None}


def test_a_failed_distillation_is_tried_again(
    module_env: Settings, module_submitter: Submitter, started: list[WorkerProcess]
) -> None:
    s = module_submitter
    w = worker(module_env, started, "distil-w3")
    run_id = s.submit(
        "max", {"text": "I am a nurse. I have two dogs.", "demo": {**FAST, "distil_fail_tries": 2}}
    )
    done(s, run_id, w)
    wait_until(lambda: len(memories(s, "max")) == 2, timeout=60, interval=0.2, what="the memories")
    assert marker(s, run_id) is None
    log = w.log()
    for tries in (1, 2):
        assert f"event=memory_distil_failed run_id={run_id} try={tries}" in log
    assert f"event=memory_distilled run_id={run_id} try=3" in log
    # The embedding call of the try that stored them is billed to the run, once.
    rows = s.query(
        "SELECT model, outcome FROM ledger WHERE run_id = :r AND kind = 'embedding'", r=run_id
    )
    assert [(r.model, r.outcome) for r in rows] == [("embedding:wordllama-l2-supercat-256", "ok")]
