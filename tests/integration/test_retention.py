"""Retention against the real stack: chunks collapse into the output, old runs and ledger
months go, and nothing not ended is touched (processors/retention.py).

One namespace, gateway (in-process) and worker serve the module; each test's runs are
its own. Ages are set by moving timestamps back in SQL, never by waiting.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from sqlalchemy import text

from koda_runtime.gateway.app import create_app
from koda_runtime.lifecycle.chunks import visible_output
from koda_runtime.localstack import StackInfo
from koda_runtime.processors.retention import RetentionSweeper, SweepReport
from koda_runtime.settings import Settings
from tests.fixtures.gateway import serve_app
from tests.fixtures.namespaces import make_settings, prepared_namespace
from tests.fixtures.processes import ROOT, WorkerProcess, settings_env
from tests.fixtures.runs import Submitter
from tests.sse_client import bearer, contents, read_stream
from tests.support import wait_until

DAY = 86400.0


@dataclass
class Stack:
    settings: Settings
    url: str
    worker: WorkerProcess
    submitter: Submitter

    def sql(self, sql: str, **params: Any) -> list[Any]:
        with self.submitter.engine.begin() as conn:
            result = conn.execute(text(sql), params)
            return list(result.all()) if result.returns_rows else []

    def sweeper(self, **retention: Any) -> RetentionSweeper:
        """A sweeper with these settings over the module's (nothing else expires)."""
        base = {"chunk_retention_s": 0.0, "run_retention_s": 0.0, "ledger_retention_s": 0.0}
        return RetentionSweeper(self.settings.with_(**(base | retention)))

    def sweep(self, **retention: Any) -> SweepReport:
        sweeper = self.sweeper(**retention)
        try:
            return sweeper.sweep_once()
        finally:
            sweeper.close()

    def finished_run(self, user: str, inp: dict[str, Any]) -> str:
        run_id = self.submitter.submit(user, inp)
        wait_until(lambda: self.submitter.all_terminal([run_id]), timeout=60, what="run ended")
        return run_id

    def age(self, run_id: str, days: float, *, compacted: bool = True) -> None:
        """The run ended ``days`` ago (and was compacted)."""
        self.sql(
            "UPDATE runs SET created_at = now() - make_interval(days => :d + 1),"
            " finished_at = now() - make_interval(secs => :s),"
            " compacted_at = CASE WHEN :c THEN now() ELSE NULL END WHERE id = :r",
            d=int(days),
            s=days * DAY,
            c=compacted,
            r=run_id,
        )

    def get(self, run_id: str, user: str) -> httpx.Response:
        return httpx.get(f"{self.url}/v1/runs/{run_id}", headers=bearer(user), timeout=30)

    def stream(self, run_id: str, user: str, last_event_id: int | None = None) -> Any:
        async def read() -> Any:
            async with httpx.AsyncClient(base_url=self.url, timeout=30) as client:
                return await read_stream(
                    client, run_id, headers=bearer(user), last_event_id=last_event_id
                )

        return asyncio.run(read())


@pytest.fixture(scope="module")
def live(stack: StackInfo) -> Iterator[Stack]:
    settings = make_settings(stack, rate_per_s=1000.0, rate_burst=1000, retention_batch=10)
    with prepared_namespace(settings):
        worker = WorkerProcess(settings, "retention-w1").start()
        submitter = Submitter(settings)
        try:
            with serve_app(create_app(settings)) as url:
                yield Stack(settings, url, worker, submitter)
        finally:
            submitter.close()
            worker.stop()


def text_of(run: Stack, run_id: str) -> str:
    rows = run.submitter.messages(run_id)
    return visible_output((r.seq, r.kind, r.content) for r in rows)


def test_an_expired_run_keeps_its_output_and_streams_it_as_one_event(live: Stack) -> None:
    user = f"u-{uuid.uuid4().hex[:8]}"
    # A retried run: a reset in the middle, 40 chunks in all, more than a batch (10).
    run_id = live.finished_run(
        user, {"text": "expire me", "demo": {"tokens": 20, "delay_ms": 1, "fail_attempts": 1}}
    )
    before = live.submitter.messages(run_id)
    output = text_of(live, run_id)
    terminal = before[-1]
    assert terminal.kind == "done" and len(before) > 20 and output
    assert live.get(run_id, user).json()["output"] == output

    live.age(run_id, 8)
    report = live.sweep(chunk_retention_s=7 * DAY)
    assert report.collapsed >= 1

    rows = live.submitter.messages(run_id)
    assert [(r.seq, r.kind) for r in rows] == [(terminal.seq - 1, "chunk"), (terminal.seq, "done")]
    assert rows[0].content == output
    assert report.deleted["messages"] >= len(before) - 2
    assert live.get(run_id, user).json()["output"] == output

    fresh = live.stream(run_id, user)
    assert fresh.status == 200 and fresh.closed_by_server
    assert contents(fresh.events) == [
        (terminal.seq - 1, "chunk", output),
        (terminal.seq, "done", terminal.content),
    ]
    # Resuming: inside the old chunks -> a reset first; after the output -> the end only;
    # after the end -> 204, as for any ended run.
    inside = live.stream(run_id, user, last_event_id=3)
    assert [(e.id, e.event) for e in inside.events] == [
        (None, "reset"),
        (str(terminal.seq - 1), "chunk"),
        (str(terminal.seq), "done"),
    ]
    assert inside.events[1].json()["content"] == output
    after_output = live.stream(run_id, user, last_event_id=terminal.seq - 1)
    assert [e.event for e in after_output.events] == ["done"]
    assert live.stream(run_id, user, last_event_id=terminal.seq).status == 204

    # A second pass has nothing left to do for it.
    again = live.sweep(chunk_retention_s=7 * DAY)
    assert live.submitter.messages(run_id) == rows
    assert again.collapsed == 0


def test_a_pass_cut_after_the_collapse_is_finished_by_the_next(live: Stack) -> None:
    user = f"u-{uuid.uuid4().hex[:8]}"
    run_id = live.finished_run(user, {"text": "cut", "demo": {"tokens": 30, "delay_ms": 1}})
    output = text_of(live, run_id)
    live.age(run_id, 10)
    sweeper = live.sweeper(chunk_retention_s=7 * DAY)
    try:
        report = SweepReport()
        sweeper._collapse_all(report)  # the process dies here: rows not yet deleted
        assert report.collapsed >= 1
        rows = live.submitter.messages(run_id)
        assert len(rows) > 3 and rows[-3].kind == "reset"
        # Every reader already gets the output once, from the leftover rows too.
        assert text_of(live, run_id) == output
        assert live.get(run_id, user).json()["output"] == output
        streamed = live.stream(run_id, user)
        assert (
            visible_output((s, k, c) for s, k, c in contents(streamed.events) if s is not None)
            == output
        )

        sweeper.sweep_once()
    finally:
        sweeper.close()
    rows = live.submitter.messages(run_id)
    assert [r.kind for r in rows] == ["chunk", "done"] and rows[0].content == output
    assert live.sql("SELECT expire_through FROM runs WHERE id = :r", r=run_id)[0][0] is None


def insert_run(
    live: Stack,
    user: str,
    *,
    status: str,
    ended_days_ago: float | None,
    chunks: int = 5,
    created_days_ago: float = 400,
) -> str:
    """A run written straight into Postgres with ``chunks`` chunks (and a terminal event
    when it ended), created long ago."""
    run_id = str(uuid.uuid4())
    session = f"s-{user}"
    live.sql(
        "INSERT INTO sessions (id, user_id) VALUES (:s, :u) ON CONFLICT DO NOTHING",
        s=session,
        u=user,
    )
    live.sql(
        "INSERT INTO runs (id, session_id, user_id, idempotency_key, input, status, attempt,"
        " created_at, started_at, finished_at, compacted_at)"
        " VALUES (:r, :s, :u, :k, '{}', :st, 1,"
        " now() - make_interval(days => :c), now() - make_interval(days => :c),"
        " CASE WHEN :e < 0 THEN NULL ELSE now() - make_interval(secs => :e) END,"
        " now() - make_interval(days => :c))",
        r=run_id,
        s=session,
        u=user,
        k=f"retention:{run_id}",
        st=status,
        c=int(created_days_ago),
        e=-1.0 if ended_days_ago is None else ended_days_ago * DAY,
    )
    live.sql(
        "INSERT INTO messages (run_id, seq, kind, content, attempt, created_at)"
        " SELECT :r, g, 'chunk', 'w' || g || ' ', 1, now() - make_interval(days => :c)"
        "   FROM generate_series(0, :n - 1) g",
        r=run_id,
        n=chunks,
        c=int(created_days_ago),
    )
    if ended_days_ago is not None:
        live.sql(
            "INSERT INTO messages (run_id, seq, kind, content, attempt) VALUES (:r, :n, :k, '', 1)",
            r=run_id,
            n=chunks,
            k={"done": "done", "failed": "error", "cancelled": "cancelled"}[status],
        )
    return run_id


def test_a_run_not_ended_is_never_swept_whatever_its_age(live: Stack) -> None:
    user = f"u-{uuid.uuid4().hex[:8]}"
    open_runs = [
        insert_run(live, user, status=status, ended_days_ago=None, created_days_ago=900)
        for status in ("pending", "running", "streaming")
    ]
    # Even with an end time and a compaction mark it must not have: not terminal.
    live.sql(
        "UPDATE runs SET finished_at = now() - interval '900 days' WHERE id = :r",
        r=open_runs[2],
    )
    before = {r: live.submitter.messages(r) for r in open_runs}
    live.sweep(chunk_retention_s=DAY, run_retention_s=DAY)
    assert {r: live.submitter.messages(r) for r in open_runs} == before
    statuses = live.submitter.statuses(open_runs)
    assert sorted(statuses.values()) == ["pending", "running", "streaming"]


def test_runs_past_run_retention_vanish_with_their_children_and_nothing_else(
    live: Stack,
) -> None:
    user, other = f"u-{uuid.uuid4().hex[:8]}", f"u-{uuid.uuid4().hex[:8]}"
    old = insert_run(live, user, status="done", ended_days_ago=40, chunks=25)
    old_failed = insert_run(live, user, status="failed", ended_days_ago=35, chunks=3)
    young = insert_run(live, user, status="done", ended_days_ago=20)
    others = insert_run(live, other, status="cancelled", ended_days_ago=10)
    for run_id in (old, young):
        live.sql(
            "INSERT INTO usage (run_id, call_index, model, prompt_tokens, completion_tokens,"
            " cost_usd) VALUES (:r, 0, 'demo-1', 3, 4, 0.001)",
            r=run_id,
        )
        live.sql(
            "INSERT INTO run_merges (idempotency_key, run_id, user_id, input_version, input)"
            " VALUES (:k, :r, :u, 1, '{}')",
            k=f"merge:{run_id}",
            r=run_id,
            u=user,
        )
        live.sql(
            "INSERT INTO ledger (user_id, run_id, attempt, call_index, model, kind,"
            " prompt_tokens, completion_tokens, cost_usd, outcome)"
            " VALUES (:u, :r, 1, 0, 'demo-1', 'chat', 3, 4, 0.001, 'ok')",
            u=user,
            r=run_id,
        )
    ledger_before = live.sql("SELECT id, run_id FROM ledger WHERE user_id = :u ORDER BY id", u=user)

    report = live.sweep(run_retention_s=30 * DAY)

    def count(table: str, run_id: str) -> int:
        column = "id" if table == "runs" else "run_id"
        return int(live.sql(f"SELECT count(*) FROM {table} WHERE {column} = :r", r=run_id)[0][0])

    for gone in (old, old_failed):
        assert [count(t, gone) for t in ("runs", "messages", "usage", "run_merges")] == [0] * 4
    assert [count(t, young) for t in ("runs", "messages", "usage", "run_merges")] == [1, 6, 1, 1]
    assert count("runs", others) == 1 and count("messages", others) == 6
    # The ledger keeps its rows by its own rule, with the ids of the runs they billed.
    assert live.sql("SELECT id, run_id FROM ledger WHERE user_id = :u ORDER BY id", u=user) == (
        ledger_before
    )
    assert live.sql("SELECT count(*) FROM sessions WHERE user_id = :u", u=user)[0][0] == 1
    assert report.deleted["runs"] >= 2 and report.deleted["messages"] >= 26 + 4
    assert report.deleted["usage"] >= 1 and report.deleted["run_merges"] >= 1
    assert report.deleted["ledger"] == 0


def test_ledger_rows_go_by_whole_months_past_ledger_retention_only(live: Stack) -> None:
    user = f"u-{uuid.uuid4().hex[:8]}"
    for days in (0, 40, 400):
        live.sql(
            "INSERT INTO ledger (user_id, run_id, attempt, call_index, model, kind,"
            " prompt_tokens, completion_tokens, cost_usd, outcome, created_at)"
            " VALUES (:u, NULL, 0, :d, 'demo-1', 'embedding', 1, 0, 0.001, 'ok',"
            " now() - make_interval(days => :d))",
            u=user,
            d=days,
        )

    def ages() -> list[int]:
        rows = live.sql("SELECT call_index FROM ledger WHERE user_id = :u ORDER BY 1", u=user)
        return [r[0] for r in rows]

    live.sweep(chunk_retention_s=DAY, run_retention_s=DAY)  # the ledger's rule is its own
    assert ages() == [0, 40, 400]
    live.sweep(ledger_retention_s=90 * DAY)
    assert ages() == [0, 40]


def test_the_sweep_does_not_hold_up_a_run_streaming_beside_it(live: Stack) -> None:
    user = f"u-{uuid.uuid4().hex[:8]}"
    # Old runs with 3,000 rows for the sweep to collapse and delete, 10 rows a statement.
    doomed = [
        insert_run(live, f"{user}-old", status="done", ended_days_ago=9, chunks=150)
        for _ in range(20)
    ]
    streaming = live.submitter.submit(
        user, {"text": "beside", "demo": {"tokens": 300, "delay_ms": 2}}
    )
    wait_until(
        lambda: live.submitter.statuses([streaming])[streaming] == "streaming",
        timeout=60,
        what="the run streaming",
    )
    reports: list[SweepReport] = []
    errors: list[BaseException] = []

    def sweep() -> None:
        try:
            reports.append(live.sweep(chunk_retention_s=7 * DAY, run_retention_s=365 * DAY))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    thread = threading.Thread(target=sweep)
    thread.start()
    wait_until(lambda: live.submitter.all_terminal([streaming]), timeout=90, what="run ended")
    thread.join(120)
    assert not thread.is_alive() and errors == []
    assert live.submitter.statuses([streaming])[streaming] == "done"
    rows = live.submitter.messages(streaming)
    assert [r.seq for r in rows] == list(range(len(rows)))
    assert len([r for r in rows if r.kind == "chunk"]) >= 300
    assert reports[0].collapsed >= len(doomed)
    for run_id in doomed:
        assert [r.kind for r in live.submitter.messages(run_id)] == ["chunk", "done"]
    live.worker.check()
    assert "Traceback" not in live.worker.log()


def test_dry_run_counts_and_writes_nothing(live: Stack) -> None:
    user = f"u-{uuid.uuid4().hex[:8]}"
    run_id = insert_run(live, user, status="done", ended_days_ago=9, chunks=12)
    sweeper = live.sweeper(chunk_retention_s=7 * DAY)
    try:
        dry = sweeper.sweep_once(dry_run=True)
    finally:
        sweeper.close()
    assert dry.dry_run and dry.collapsed >= 1
    assert len(live.submitter.messages(run_id)) == 13
    assert live.sql("SELECT chunks_expired_at FROM runs WHERE id = :r", r=run_id)[0][0] is None
    json.dumps(dry.deleted)  # printable as the CLI prints it


def test_the_command_counts_then_sweeps(live: Stack) -> None:
    user = f"u-{uuid.uuid4().hex[:8]}"
    run_id = insert_run(live, user, status="done", ended_days_ago=30, chunks=12)
    env = settings_env(live.settings, KODA_CHUNK_RETENTION="20d", KODA_RETENTION_BATCH="10")

    def koda(*args: str) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "koda_runtime.cli", "retention", "sweep", *args]
        return subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)

    dry = koda("--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.startswith("would collapse ") and "rows to delete: messages " in dry.stdout
    assert len(live.submitter.messages(run_id)) == 13
    done = koda()
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("collapsed ") and "rows deleted: messages " in done.stdout
    assert [r.kind for r in live.submitter.messages(run_id)] == ["chunk", "done"]
    bad = koda("--every", "5", "--dry-run")
    assert bad.returncode == 2 and "--dry-run counts one pass" in bad.stderr
