"""PostgreSQL down at worker start-up and in the middle of a run.

Either way the worker stays alive (same process, no restart loop), says clearly in its
log what is wrong, retries at a bounded rate (capped exponential backoff, not a hot
loop), and finishes the run once PostgreSQL is back: contiguous seqs, one terminal
event, the full output, no partial rows. The gateway answers 503 with Retry-After
meanwhile and writes nothing.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import httpx
import pytest

from koda_runtime.localstack import pg_start, pg_stop
from koda_runtime.processors.handlers.demo import demo_tokens
from koda_runtime.schemas.migrate import upgrade
from koda_runtime.settings import Settings
from koda_runtime.topics.admin import apply_topics
from koda_runtime.topics.catalogue import RUN_CHUNKS
from tests.chaos.cluster import Stack
from tests.fixtures.namespaces import delete_topics, drop_schema, make_settings
from tests.fixtures.processes import GatewayProcess, WorkerProcess
from tests.fixtures.runs import Submitter, read_topic
from tests.support import wait_until

RETRY_LINE = re.compile(r"record failed, will retry in ~[0-9.]+s .* error=OperationalError")


@pytest.fixture
def env(stack_restored: Stack) -> Iterator[Settings]:
    settings = make_settings(stack_restored.info)
    upgrade(settings)
    apply_topics(settings)
    yield settings
    pg_start(stack_restored.state_dir)
    delete_topics(settings)
    drop_schema(settings)


def output(sub: Submitter, run_id: str) -> tuple[list[int], list[str], str]:
    rows = sub.messages(run_id)
    return [r.seq for r in rows], [r.kind for r in rows], sub.output(run_id)


def assert_whole(env: Settings, sub: Submitter, run_id: str, inp: dict) -> None:
    seqs, kinds, text = output(sub, run_id)
    assert sub.statuses([run_id])[run_id] == "done"
    assert seqs == list(range(len(seqs)))
    assert [k for k in kinds if k in ("done", "error", "cancelled")] == ["done"]
    assert kinds[-1] == "done"
    assert text == "".join(demo_tokens(inp))
    # Every chunk on the topic is a row in Postgres (nothing written half-way).
    rows = {(m.seq, m.kind, m.content) for m in sub.messages(run_id)}
    import json

    for rec in read_topic(env, env.names.topic(RUN_CHUNKS)):
        if rec.key().decode().startswith(run_id):
            v = json.loads(rec.value())
            assert (v["seq"], v["kind"], v["content"]) in rows


def test_postgres_down_at_worker_start_up(env: Settings, stack_restored: Stack) -> None:
    sub = Submitter(env)
    inp = {"text": "started without a database", "demo": {"tokens": 6, "delay_ms": 5}}
    run_id = sub.submit("pg-start-user", inp, publish=False)
    sub.engine.dispose()
    pg_stop(stack_restored.state_dir)
    worker = WorkerProcess(env, "pgless").start()
    try:
        sub.publish(run_id, "pg-start-user")
        wait_until(
            lambda: len(RETRY_LINE.findall(worker.log())) >= 5,
            timeout=60,
            what="the worker reporting the database error and retrying",
        )
        outage_started = time.monotonic()
        wait_until(lambda: time.monotonic() - outage_started > 5, timeout=20)
        log = worker.log()
        assert worker.alive(), log[-3000:]
        assert "Connection refused" in log or "connection failed" in log
        # Capped exponential backoff: a handful of retries in ~10 s, not a hot loop.
        assert len(RETRY_LINE.findall(log)) <= 12, log[-3000:]
        # Tracebacks twice (each chained: psycopg's and SQLAlchemy's): the epoch bump at
        # assignment and the record's first failure; every retry after is one line.
        assert log.count("Traceback") <= 4, log[-4000:]
        pid = worker.pid
        pg_start(stack_restored.state_dir)
        wait_until(lambda: sub.all_terminal([run_id]), timeout=60, what="run done after PG")
        assert worker.alive() and worker.pid == pid
        assert_whole(env, sub, run_id, inp)
    finally:
        pg_start(stack_restored.state_dir)
        worker.stop()
        sub.close()


def test_postgres_down_mid_run(env: Settings, stack_restored: Stack) -> None:
    sub = Submitter(env)
    gateway = GatewayProcess(env).start()
    worker = WorkerProcess(env, "midrun").start()
    inp = {"text": "survive the database", "demo": {"tokens": 40, "delay_ms": 100}}
    try:
        run_id = sub.submit("pg-mid-user", inp)
        wait_until(lambda: len(sub.messages(run_id)) >= 5, timeout=60, what="run streaming")
        sub.engine.dispose()
        pg_stop(stack_restored.state_dir)
        wait_until(
            lambda: RETRY_LINE.search(worker.log()),
            timeout=30,
            what="the worker reporting the database error",
        )
        resp = httpx.post(
            f"{gateway.url}/v1/runs",
            headers={"Authorization": "Bearer dev:pg-mid-user"},
            json={"input": {"text": "refused while down"}},
            timeout=30,
        )
        assert resp.status_code == 503, resp.text
        assert resp.headers.get("retry-after") and resp.json()["error"]
        assert httpx.get(f"{gateway.url}/livez").status_code == 200
        assert httpx.get(f"{gateway.url}/readyz", timeout=10).status_code == 503
        pg_start(stack_restored.state_dir)
        wait_until(lambda: sub.all_terminal([run_id]), timeout=90, what="run done after PG")
        assert worker.alive() and gateway.proc is not None and gateway.proc.poll() is None
        assert_whole(env, sub, run_id, inp)
        kinds = [m.kind for m in sub.messages(run_id)]
        assert kinds.count("reset") <= 1  # resumed once, after the cut, if it was cut
        # The refused request wrote nothing.
        assert sub.query("SELECT count(*) AS n FROM runs")[0].n == 1
        wait_until(
            lambda: httpx.get(f"{gateway.url}/readyz", timeout=10).status_code == 200,
            timeout=30,
            what="gateway ready again",
        )
    finally:
        pg_start(stack_restored.state_dir)
        worker.stop()
        gateway.stop()
        sub.close()
