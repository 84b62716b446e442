"""One populated stack shared by the replay tests: a few hundred real runs (some retried,
some failed, some dead-lettered, some compacted) made by real worker processes from
records the gateway and the test wrote, plus what Postgres says about them."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

import duckdb
import httpx
from sqlalchemy import text

from koda_runtime.lifecycle.chunks import visible_output
from koda_runtime.lifecycle.ids import uuid7
from koda_runtime.processors.compactor import ChunkCompactor
from koda_runtime.schemas.db import sync_engine
from koda_runtime.schemas.migrate import upgrade
from koda_runtime.settings import Settings
from koda_runtime.topics.admin import apply_topics
from koda_runtime.topics.catalogue import RUNS_DLQ
from koda_runtime.topics.records.codec import RUN_REQUESTED, RunRequested, headers_for
from koda_runtime.topics.replay import tables as t
from tests.fixtures.namespaces import delete_topics, drop_schema, make_settings
from tests.fixtures.processes import ROOT, GatewayProcess, WorkerProcess, settings_env
from tests.fixtures.runs import Submitter, read_topic
from tests.support import wait_until

END_KIND = {"done": "done", "failed": "error", "cancelled": "cancelled"}


@dataclass
class Populated:
    """The stack, what was submitted, and where the waves split."""

    settings: Settings
    sub: Submitter
    workers: list[WorkerProcess]
    tmp: Path
    wave_a: list[str] = field(default_factory=list)
    wave_b: list[str] = field(default_factory=list)
    compacted: set[str] = field(default_factory=set)
    via_gateway: set[str] = field(default_factory=set)
    fixable: tuple[str, str] = ("", "")  # (run_id, user) of a trigger for a missing run
    boundary_ms: int = 0  # every wave A record is older, every wave B record newer
    poison_without_header: int = 0
    late: set[str] = field(default_factory=set)  # runs republished after the boundary

    @property
    def env(self) -> dict[str, str]:
        return settings_env(self.settings)

    @property
    def runs(self) -> list[str]:
        return self.wave_a + self.wave_b


def demo_input(tag: str, i: int) -> dict[str, Any]:
    demo: dict[str, Any] = {"tokens": 3 + i % 5, "delay_ms": 0}
    if i % 9 == 4:
        demo["fail_attempts"] = 1  # retried once, then done (output after a reset)
    if i % 13 == 7:
        demo["fail_attempts"] = 99  # failed after its attempts: dead-lettered
    return {"text": f"{tag} run {i}", "demo": demo}


def wait_terminal(p: Populated, ids: list[str], what: str) -> None:
    def done() -> bool:
        for w in p.workers:
            assert w.alive(), f"worker {w.worker_id} died:\n{w.log()[-3000:]}"
        return p.sub.all_terminal(ids)

    wait_until(done, timeout=120, interval=0.25, what=what)


def populate(stack: Any) -> Iterator[Populated]:
    settings = make_settings(stack, max_inflight=16)
    upgrade(settings)
    apply_topics(settings)
    tmp = Path(tempfile.mkdtemp(prefix="koda-replay-", dir="/tmp"))
    sub = Submitter(settings)
    workers = [WorkerProcess(settings, f"rw{i}").start() for i in range(2)]
    gateway = GatewayProcess(settings, {"KODA_RATE_PER_S": "100000", "KODA_RATE_BURST": "100000"})
    p = Populated(settings, sub, workers, tmp)
    try:
        gateway.start()
        with httpx.Client(base_url=gateway.url, timeout=30) as client:
            for i in range(30):
                user = f"gw-user-{i % 6}"
                body = {"input": demo_input("gateway", i)}
                r = client.post(
                    "/v1/runs", json=body, headers={"Authorization": f"Bearer dev:{user}"}
                )
                assert r.status_code == 202, r.text
                p.via_gateway.add(r.json()["run_id"])
        first = [p.sub.submit(f"user-{i % 25}", demo_input("first", i)) for i in range(120)]
        p.wave_a += [*p.via_gateway, *first]
        # Poison: garbage and a future schema version (no run), and a trigger for a run that
        # Postgres does not have yet (unknown_run), which a test later fixes and replays.
        p.sub.produce_raw(b"user-1", b"\x00\xff not a record")
        p.poison_without_header += 1
        future = json.dumps({"run_id": uuid7(), "user_id": "user-2", "session_id": "s"}).encode()
        p.sub.produce_raw(b"user-2", future, [("schema", b"run.requested/9")])
        fixable = uuid7()
        p.fixable = (fixable, "fix-user")
        trigger = RunRequested(fixable, "fix-user", "s-fix-user", "").encode()
        p.sub.produce_raw(b"fix-user", trigger, headers_for(RUN_REQUESTED))
        wait_terminal(p, p.wave_a, "first runs terminal")
        compactor = ChunkCompactor(settings)
        try:
            # The claim skips rows another transaction holds (SKIP LOCKED): a worker's
            # published mark for a run just ended may still hold one. Passes add up.
            compacted = [0]

            def every_run_compacted() -> bool:
                compacted[0] += compactor.compact_once(older_than_s=0, batch=200).runs
                return compacted[0] >= len(p.wave_a)

            wait_until(every_run_compacted, timeout=30, interval=0.2, what="first runs compacted")
            assert compacted[0] == len(p.wave_a)
        finally:
            compactor.close()
        p.compacted = set(p.wave_a)
        second = [p.sub.submit(f"user-{i % 25}", demo_input("second", i)) for i in range(130)]
        p.wave_a += second
        wait_terminal(p, p.wave_a, "second runs terminal")
        # Every letter of wave A (its failed runs and the three poison records) is written
        # before the boundary, so a replay from it sees only wave B's.
        failed = sum(1 for s in p.sub.statuses(p.wave_a).values() if s == "failed")
        dlq = settings.names.topic(RUNS_DLQ)
        wait_until(lambda: len(read_topic(settings, dlq)) >= failed + 3, what="dead letters")
        p.boundary_ms = int(time.time() * 1000) + 1
        wait_until(lambda: time.time() * 1000 > p.boundary_ms, timeout=5, interval=0.001)
        p.wave_b = [p.sub.submit(f"late-user-{i % 5}", demo_input("late", i)) for i in range(20)]
        wait_terminal(p, p.runs, "late runs terminal")
        yield p
    finally:
        gateway.stop()
        for w in workers:
            w.stop()
        sub.close()
        engine = sync_engine(settings)
        with engine.begin() as conn:
            schema = settings.names.warehouse_schema()
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        engine.dispose()
        delete_topics(settings)
        drop_schema(settings)
        shutil.rmtree(tmp, ignore_errors=True)


def koda(p: Populated, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``python -m koda_runtime.cli ARGS`` as a user runs it; fails the test on a non-zero exit."""
    done = subprocess.run(  # noqa: S603
        [sys.executable, "-m", "koda_runtime.cli", *args],
        env=p.env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, f"koda {' '.join(args)}:\n{done.stdout}\n{done.stderr}"
    return done


def duck_tables(path: Path) -> dict[str, list[tuple[Any, ...]]]:
    """Every warehouse table of a DuckDB file, rows sorted (JSON parsed, for comparisons)."""
    conn = duckdb.connect(str(path), read_only=True)
    try:
        out = {}
        for table in t.TABLES:
            rows = conn.execute(f"SELECT {', '.join(table.names)} FROM {table.name}").fetchall()
            out[table.name] = sorted(normal(table, r) for r in rows)
        return out
    finally:
        conn.close()


def normal(table: t.Table, row: tuple[Any, ...]) -> tuple[Any, ...]:
    """One row in a form every sink's driver agrees on (JSON parsed, then dumped sorted)."""
    out = []
    for column, value in zip(table.columns, row, strict=True):
        if column.type == "json" and value is not None:
            value = json.dumps(json.loads(value) if isinstance(value, str) else value)
        out.append(value)
    return tuple(out)


def postgres_truth(p: Populated) -> dict[str, Any]:
    """Statuses, claim counts, visible outputs and usage, as koda's Postgres holds them."""
    runs = {r.id: (r.status, r.attempt, r.created_at) for r in p.sub.query("SELECT * FROM runs")}
    events: dict[str, list[tuple[int, str, str]]] = {}
    for m in p.sub.query("SELECT run_id, seq, kind, content FROM messages"):
        events.setdefault(m.run_id, []).append((m.seq, m.kind, m.content))
    usage = {
        (u.run_id, u.call_index): (
            u.model,
            u.prompt_tokens,
            u.completion_tokens,
            Decimal(u.cost_usd),
        )
        for u in p.sub.query("SELECT * FROM usage")
    }
    ledger = {
        (c.run_id, c.attempt, c.call_index): (
            c.user_id,
            c.model,
            c.kind,
            c.prompt_tokens,
            c.completion_tokens,
            Decimal(c.cost_usd),
            c.price_id,
            c.outcome,
            c.estimated,
        )
        for c in p.sub.query("SELECT * FROM ledger")
    }
    return {
        "runs": runs,
        "outputs": {r: visible_output(e) for r, e in events.items()},
        "usage": usage,
        "ledger": ledger,
    }
