"""Retention: Postgres keeps what a run left only as long as the settings say.

``koda retention sweep [--every S] [--dry-run]``, and a thread of the chunk-upkeep role
(``koda chunks compact --every S``, ROLE=compactor) every S seconds. One pass:

1. **Chunks** (``KODA_CHUNK_RETENTION``, 7d). A run that ended (terminal status) that
   long ago and whose topic records are compacted (``runs.compacted_at``) is
   *collapsed*, a few runs per short transaction holding their run rows ``FOR UPDATE
   SKIP LOCKED``: the row before its terminal event becomes one ``chunk`` holding the
   run's whole output (the text after its last reset, as every reader computes it),
   the row before that a ``reset``, and ``runs.chunks_expired_at``, ``output_seq`` and
   ``expire_through`` are set. The terminal event keeps its row. From then on every
   reader (``GET /v1/runs/{id}``, SSE, a session's turns, the console) gets the output
   unchanged: rows before the reset are dropped by the reset itself.
2. **Leftover rows**: the rows below the reset go in statements of at most
   ``KODA_RETENTION_BATCH`` rows, each its own transaction, in any order; the reset
   itself goes last, with ``expire_through`` set back to NULL, once nothing is below
   it. A viewer then gets the output as one event and the terminal event.
3. **Runs** (``KODA_RUN_RETENTION``, off by default). Runs that ended that long ago and
   are compacted lose their messages (in batches as above), then, a batch of runs per
   transaction, their merges, usage rows and the run rows themselves. Sessions stay.
4. **Ledger** (``KODA_LEDGER_RETENTION``, off by default): rows are deleted by whole
   UTC calendar months, once a month ended that long ago (at least 31 days): the
   month in progress, which the monthly budgets are about, is never touched, and a
   report of a month finds it whole or not at all. ``spend_periods`` are kept.

A run not ended is never touched, whatever its age. Every statement that deletes or
locks takes rows ``SKIP LOCKED`` under a short ``lock_timeout``: the sweep never waits
on a worker's writes and a worker never waits on it for longer than one small batch.
Every step is driven by what the rows say (a collapsed run has ``chunks_expired_at``;
leftovers are found by ``expire_through``), so a pass killed anywhere is finished by
the next one. ``--dry-run`` counts what a pass would do and writes nothing.

Metrics: ``koda_retention_rows_deleted_total{table}``,
``koda_retention_runs_collapsed_total``, ``koda_retention_last_pass_timestamp_seconds``;
one log line per pass (``event=retention_pass``).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import Counter, Gauge
from sqlalchemy import Engine
from sqlalchemy.exc import IntegrityError, OperationalError

from koda_runtime import metrics
from koda_runtime.errors import KodaError
from koda_runtime.lifecycle.chunks import TERMINAL_KINDS, ChunkKind, visible_output
from koda_runtime.schemas import retention as rows_of
from koda_runtime.schemas.db import sync_engine
from koda_runtime.settings import Settings

log = logging.getLogger(__name__)

TABLES = ("messages", "usage", "run_merges", "runs", "ledger")
# A statement of the sweep waits at most this long for a lock; past it the statement
# fails and the batch is tried again at the next pass (schemas/retention.py).
LOCK_TIMEOUT_MS = rows_of.LOCK_TIMEOUT_MS
# How long stopping the loop's thread waits for the pass in progress.
STOP_WAIT_S = 30.0
_TERMINAL_KINDS = frozenset(k.value for k in TERMINAL_KINDS)

ROWS_DELETED = Counter(
    "koda_retention_rows_deleted_total",
    "Rows the retention sweep deleted, by table.",
    ["table"],
    registry=metrics.REGISTRY,
)
RUNS_COLLAPSED = Counter(
    "koda_retention_runs_collapsed_total",
    "Runs whose chunk rows were collapsed into their final output (KODA_CHUNK_RETENTION).",
    registry=metrics.REGISTRY,
)
LAST_PASS = Gauge(
    "koda_retention_last_pass_timestamp_seconds",
    "Unix time the retention sweep last completed a pass without error; 0 until its first.",
    registry=metrics.REGISTRY,
)


class RetentionError(KodaError):
    """A retention pass could not finish (Postgres refused or was unreachable)."""


@dataclass
class SweepReport:
    """What one pass did (or, dry, would do): runs collapsed, rows deleted per table."""

    collapsed: int = 0
    deleted: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TABLES, 0))
    dry_run: bool = False
    blocked: int = 0  # runs another table's foreign key kept (logged)

    def line(self) -> str:
        rows = " ".join(f"{t}={n}" for t, n in self.deleted.items())
        return f"collapsed={self.collapsed} {rows} blocked={self.blocked}"


@dataclass(frozen=True)
class _Collapse:
    run_id: str
    output_seq: int | None
    through: int | None
    rows: list[tuple[int, str, str, int]]  # (seq, kind, content, attempt) to upsert


def collapse_plan(run_id: str, messages: list[Any]) -> _Collapse:
    """How one run's rows (seq order) collapse: the row before the terminal event (the
    last row, when the run ended without one) holds the output, the row before that a
    reset; rows up to the reset are to go."""
    if not messages:
        return _Collapse(run_id, None, None, [])
    last = messages[-1]
    output_seq = last.seq - 1 if last.kind in _TERMINAL_KINDS else last.seq
    if output_seq < 0:
        return _Collapse(run_id, None, None, [])
    before = [m for m in messages if m.seq <= output_seq]
    attempt = int(before[-1].attempt) if before else int(last.attempt)
    output = visible_output((m.seq, m.kind, m.content) for m in before)
    rows = [(output_seq, ChunkKind.CHUNK.value, output, attempt)]
    through = output_seq - 1 if output_seq >= 1 else None
    if through is not None:
        reset = json.dumps({"attempt": attempt, "reason": "expired"})
        rows.append((through, ChunkKind.RESET.value, reset, attempt))
    return _Collapse(run_id, output_seq, through, rows)


class RetentionSweeper:
    """Runs retention passes; ``engine`` is built from settings if omitted."""

    def __init__(self, settings: Settings, *, engine: Engine | None = None) -> None:
        self.settings = settings
        self.batch = settings.retention_batch
        # Runs per transaction: a run's rows are read whole when it is collapsed.
        self.runs_per_batch = max(1, self.batch // 50)
        self._own_engine = engine is None
        self.engine = engine if engine is not None else sync_engine(settings)
        self.passes = 0
        self.last_error: str | None = None

    def close(self) -> None:
        if self._own_engine:
            self.engine.dispose()

    # -- one pass -------------------------------------------------------------------------

    def sweep_once(self, *, dry_run: bool = False) -> SweepReport:
        """One pass over every rule; with ``dry_run``, count what it would do."""
        report = SweepReport(dry_run=dry_run)
        try:
            if dry_run:
                self._count(report)
            else:
                self._collapse_all(report)
                self._delete_leftovers(report)
                self._delete_old_runs(report)
                self._delete_ledger(report)
        except OperationalError as exc:
            raise RetentionError(f"retention pass failed: {_reason(exc)}") from exc
        return report

    def _collapse_all(self, report: SweepReport) -> None:
        keep = self.settings.chunk_retention_s
        if not keep:
            return
        while True:
            with self._begin() as conn:
                ids = rows_of.claim_expirable(conn, keep_s=keep, runs=self.runs_per_batch)
                if not ids:
                    return
                by_run: dict[str, list[Any]] = {i: [] for i in ids}
                for m in rows_of.run_messages(conn, ids):
                    by_run[m.run_id].append(m)
                plans = [collapse_plan(i, by_run[i]) for i in ids]
                rows = [(p.run_id, *row) for p in plans for row in p.rows]
                if rows:
                    rows_of.upsert_messages(conn, rows)
                rows_of.mark_expired(
                    conn, ids, [p.output_seq for p in plans], [p.through for p in plans]
                )
            report.collapsed += len(ids)
            RUNS_COLLAPSED.inc(len(ids))
            if len(ids) < self.runs_per_batch:
                return

    def _delete_leftovers(self, report: SweepReport) -> None:
        while True:
            with self._begin() as conn:
                n = rows_of.delete_leftovers(conn, batch=self.batch)
            self._deleted(report, "messages", n)
            if n < self.batch:
                break
        while True:
            with self._begin() as conn:
                deleted, done = rows_of.finish_leftovers(conn, runs=self.batch)
            self._deleted(report, "messages", deleted)
            if done < self.batch:
                return

    def _delete_old_runs(self, report: SweepReport) -> None:
        keep = self.settings.run_retention_s
        if not keep:
            return
        after: tuple[Any, str] | None = None
        runs_per_batch = max(1, self.batch // 10)
        while True:
            with self.engine.connect() as conn:
                found = rows_of.old_runs(conn, keep_s=keep, after=after, runs=runs_per_batch)
            if not found:
                return
            ids = [r.id for r in found]
            while True:
                with self._begin() as conn:
                    n = rows_of.delete_run_messages(conn, ids, batch=self.batch)
                self._deleted(report, "messages", n)
                if n < self.batch:
                    break
            try:
                with self._begin() as conn:
                    counts = rows_of.delete_runs(conn, ids)
            except IntegrityError as exc:
                # A table added later references these runs: keep them and say which.
                report.blocked += len(ids)
                log.warning("event=retention_blocked runs=%d reason=%s", len(ids), _reason(exc))
            else:
                for table, n in counts.items():
                    self._deleted(report, table, n)
            after = (found[-1].finished_at, found[-1].id)
            if len(found) < runs_per_batch:
                return

    def _delete_ledger(self, report: SweepReport) -> None:
        keep = self.settings.ledger_retention_s
        if not keep:
            return
        while True:
            with self._begin() as conn:
                n = rows_of.delete_ledger(conn, keep_s=keep, batch=self.batch)
            self._deleted(report, "ledger", n)
            if n < self.batch:
                return

    def _count(self, report: SweepReport) -> None:
        s = self.settings
        with self.engine.connect() as conn:
            if s.chunk_retention_s:
                report.collapsed = rows_of.count_expirable(conn, keep_s=s.chunk_retention_s)
            report.deleted["messages"] = rows_of.count_leftovers(conn)
            if s.run_retention_s:
                runs, messages = rows_of.count_old(conn, keep_s=s.run_retention_s)
                report.deleted["runs"] = runs
                report.deleted["messages"] += messages
            if s.ledger_retention_s:
                report.deleted["ledger"] = rows_of.count_ledger(conn, keep_s=s.ledger_retention_s)

    def _begin(self) -> Any:
        return rows_of.short_transaction(self.engine)

    def _deleted(self, report: SweepReport, table: str, n: int) -> None:
        if n > 0:
            report.deleted[table] += n
            ROWS_DELETED.labels(table=table).inc(n)

    # -- the loop -------------------------------------------------------------------------

    def pass_logged(self) -> SweepReport | None:
        """One pass, its log line and metrics; errors are logged, not raised."""
        started = time.monotonic()
        try:
            report = self.sweep_once()
        except KodaError as exc:
            self.last_error = str(exc)
            log.warning("event=retention_failed error=%s", exc)
            return None
        self.passes += 1
        self.last_error = None
        LAST_PASS.set_to_current_time()
        log.info("event=retention_pass %s seconds=%.3f", report.line(), time.monotonic() - started)
        return report

    def run_forever(self, every_s: float, should_stop: Callable[[], bool] = lambda: False) -> None:
        """A pass every ``every_s`` seconds until ``should_stop()``."""
        while not should_stop():
            self.pass_logged()
            deadline = time.monotonic() + every_s
            while time.monotonic() < deadline and not should_stop():
                time.sleep(min(1.0, every_s))

    def start(self, every_s: float) -> Callable[[], None]:
        """Run :meth:`run_forever` in a daemon thread; returns the function that stops it
        after the pass in progress, waiting up to ``STOP_WAIT_S`` (a pass cut by the
        process's exit is finished by the next one)."""
        stop = threading.Event()
        thread = threading.Thread(
            target=self.run_forever, args=(every_s, stop.is_set), name="koda-retention", daemon=True
        )
        thread.start()

        def stopper() -> None:
            stop.set()
            thread.join(STOP_WAIT_S)

        return stopper


def _reason(exc: Exception) -> str:
    """The first line of Postgres's message, without the statement or parameters."""
    orig = getattr(exc, "orig", None) or exc
    return str(orig).strip().splitlines()[0][:300] if str(orig).strip() else type(exc).__name__
