"""What a chaos run must leave behind, checked from Postgres, the topics and the viewers.

Definitions used by the checks:

* **Accepted**: the gateway answered 202. **Lost**: accepted, and at the end not in
  Postgres or not terminal.
* **Exactly one terminal state**: the run's status is terminal, and among its messages
  exactly one has a terminal kind (done, error, cancelled), which is the last one and
  agrees with the status (done <-> done, failed <-> error).
* **Contiguous and unique**: the run's message seqs are exactly 0..n. Every record on
  the chunk topic equals the Postgres row of its ``<run_id>:<seq>`` key (a record that
  is not in Postgres, or differs, is a write that escaped the fence); the same record
  produced twice is an at-least-once re-send and is counted, not failed.
* **The topic holds every chunk Postgres holds**: after the repair delay (the harness
  runs the compactor's completeness pass once every run has ended, as the scheduled
  compactor would), every message of every run is on the chunk topic under its
  ``<run_id>:<seq>`` key. A message still absent is a violation. How many the workers
  had left for the pass is counted, not failed: a worker's mark that died with it makes
  the pass produce that run again, which is the pass's job.
* **A run's span** is ``[S, F]``: ``S = runs.started_at``, written by the *first*
  successful claim and kept by later ones (a run cut off at a handoff and resumed
  keeps the first claim's ``S``), and ``F = runs.finished_at``, the terminal write.
  An *attempt* starts at its claim (the ``transition to=running attempt=n`` event on
  ``<env>.koda.run-events``, written after the claim committed) and ends when the next
  attempt's claim or the terminal write happens, so every attempt, retries in place
  and resumptions included, lies inside the run's span. The checks confirm it: every
  message of the run was written inside ``[S, F]`` and every attempt's claim is inside
  ``[S, F]``.
* **Per-user order without overlap**: take a user's accepted runs in submission order
  r1..rn (the user submits the next only after the previous was answered). Then
  ``S(r1) < S(r2) < ...`` (started in submission order) and ``F(rk) <= S(rk+1)``
  (the next run's first claim happens only after the previous run's terminal write),
  and no attempt claim of ``rk+1`` precedes ``F(rk)``. Overlap is about effects: a
  worker frozen past its session may still be *computing* an attempt of ``rk`` while
  its successor has finished ``rk`` and started ``rk+1``, but none of that frozen
  attempt's writes can land (fencing); a landed write outside the span is a finding.
* **Committed offsets never ahead of completed work**: while the run goes on, an
  auditor reads the group's committed offset of each partition and *then* the status
  of every run whose record lies below it; a run that is not terminal at that later
  moment was not terminal when the offset was committed (terminal is absorbing).
* **Every cancelled run ends `cancelled` and never runs again**: a cancel the gateway
  took (202: recorded on a running run; 200 with status `cancelled`: a pending run
  ended at once) must leave the run `cancelled`, its terminal `cancelled` message the
  last, and no attempt claimed after the request was durable (a successor that claims
  a cancel-requested run ends it without running the handler and emits no `running`
  transition; one second of slack covers the event's own timestamp). A cancel answered
  200 with another terminal status came after the run ended: counted, and the run
  must end as planned.
* **Every merged message appears in its run's final input and answer**: a follow-up
  answered `"merged": true` names the run it joined; that run's final `runs.input`
  text contains the follow-up's text, and a run that ended `done` answered exactly
  what the demo model gives for that final input (its output after the last `reset`),
  so the answer was computed on both messages. A follow-up not merged is a run of its
  own and is checked like every other.
* **The ledger has no duplicate row and sums to the usage reports**: the demo model
  reports one call per attempt it completes, so no attempt has more than one
  non-estimated `ok` chat row (two would be one call billed twice: by its chunk batch
  and again by the attempt's end, or by a redelivered finish), and a `done` run's
  finishing attempt has exactly one. An earlier attempt may have one too: a call is
  billed `ok` as soon as its usage is written, so an attempt killed, cut or cancelled
  after it keeps it (the model was called). Estimated and `cancelled`/`failed` rows
  are what cut attempts streamed, billed once each. Then, per user, the gateway's usage report
  (`GET /admin/usage?group_by=user`) equals the ledger's own sums (calls, tokens,
  cost).
* **No memory is duplicated**: every run that ended `done` with a statement to
  remember has exactly one memory row of its user holding it, however many attempts
  (kills, cuts, resets) it took; runs retried before their end are counted.
* **Every due schedule minute gives exactly one run**: per-minute schedules (overlap
  `allow`, so no fire is skipped on purpose) fire while two schedulers run and one is
  killed and restarted; they are paused when the load ends. Every minute from a
  schedule's first fire until 20 s before the pause has exactly one run (idempotency
  key `sched:<id>:<minute>`), none has two, none fires after the pause, and every
  scheduled run ends `done`.
* **No budget is overshot beyond the in-flight runs**: a few users have a daily budget
  of one or two runs' cost. Take the moment ``t`` their ledger's running sum first reached
  the limit. Every run of theirs admitted (created) after ``t`` is a violation (the
  admission reads the spend in its own insert); what the ledger holds past the limit
  is then only what runs admitted before ``t`` went on to spend (in flight), the
  bound the design states. A 402 before ``t`` is a refusal with budget left, also a
  violation. Half a second of slack covers a finish committed just as the next run
  was admitted (the ledger's ``created_at`` is its transaction's start).
* **The DLQ holds only the injected poison**: every dead letter is either one of the
  records written as poison (matched by partition and offset) or the trigger of a run
  whose handler always fails; each injected poison appears. Repeats of the same
  letter (at-least-once) are counted, not failed.
"""

from __future__ import annotations

import base64
import json
import statistics
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from koda_runtime.kafka import consumer_config
from koda_runtime.lifecycle.ids import uuid7
from koda_runtime.processors.handlers.demo import demo_tokens
from koda_runtime.settings import Settings
from koda_runtime.topics.catalogue import RUN_CHUNKS, RUN_EVENTS, RUNS, RUNS_DLQ
from tests.chaos.cluster import QUIET, CommitMonitor, Postgres
from tests.chaos.load import InjectedPoison, PlannedRun, Viewer
from tests.fixtures.runs import position, read_topic

TERMINAL = ("done", "failed", "cancelled")
TERMINAL_KINDS = ("done", "error", "cancelled")
# How runs.error starts for a run stopped after the call that spent its budget.
BUDGET_STOP = "budget_exceeded:"
KIND_OF_STATUS = {"done": "done", "failed": "error", "cancelled": "cancelled"}


@dataclass
class Findings:
    """Counts for the table and one line per violation."""

    accepted: int = 0
    refused: int = 0
    done: int = 0
    failed: int = 0
    lost: int = 0
    poison_runs: int = 0
    duplicate_chunks_db: int = 0
    duplicate_chunks_viewers: int = 0
    chunk_resends_topic: int = 0
    chunks_missing_on_topic: int = 0
    chunks_left_for_pass: int = 0
    runs_completed_by_pass: int = 0
    order_violations: int = 0
    # Runs that started while another user's run of the same partition was running:
    # the order check above covers users interleaved on one partition.
    interleaved_starts: int = 0
    viewers: int = 0
    viewer_mismatches: int = 0
    viewer_reconnects: int = 0
    dead_letters: int = 0
    dead_letter_repeats: int = 0
    offset_audits: int = 0
    offsets_ahead: int = 0
    resumed_runs: int = 0
    max_attempt: int = 0
    cancels: int = 0
    cancels_took: int = 0
    cancels_after_end: int = 0
    cancel_violations: int = 0
    follow_ups: int = 0
    merged: int = 0
    merge_violations: int = 0
    ledger_rows: int = 0
    ledger_duplicates: int = 0
    ledger_report_mismatches: int = 0
    memory_runs: int = 0
    memory_runs_retried: int = 0
    memory_duplicates: int = 0
    memory_missing: int = 0
    schedules: int = 0
    schedule_minutes: int = 0
    scheduled_runs: int = 0
    schedule_violations: int = 0
    budget_users: int = 0
    budget_refusals: int = 0
    budget_overshoot_usd: Decimal = Decimal(0)
    budget_max_spend_usd: Decimal = Decimal(0)
    budget_violations: int = 0
    budget_stops: int = 0  # runs stopped mid-way for money (budget_exceeded)
    violations: list[str] = field(default_factory=list)

    def violate(self, message: str) -> None:
        self.violations.append(message)


class OffsetAuditor:
    """Checks, during the run, that no committed offset passes unfinished work."""

    def __init__(self, settings: Settings, db: Postgres, monitor: CommitMonitor) -> None:
        self.settings, self.db, self.monitor = settings, db, monitor
        self.topic = settings.names.topic(RUNS)
        self.records: dict[int, dict[int, str | None]] = defaultdict(dict)
        self.verified: dict[int, int] = defaultdict(int)
        self.audits = 0
        self.ahead: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._tail, name="runs-tail", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _tail(self) -> None:
        consumer = Consumer(
            consumer_config(self.settings, "chaos-tail", None)
            | QUIET
            | {"group.id": "chaos-unused"}
        )
        consumer.assign(
            [
                TopicPartition(self.topic, p, OFFSET_BEGINNING)
                for p in range(self.settings.partitions)
            ]
        )
        try:
            while not self._stop.is_set():
                msg = consumer.poll(0.5)
                if msg is None or msg.error():
                    continue
                run_id: str | None = None
                try:
                    obj = json.loads(msg.value() or b"")  # a tombstone: no run
                    run_id = obj.get("run_id") if isinstance(obj, dict) else None
                except (ValueError, TypeError):
                    pass
                partition, offset = position(msg)
                self.records[partition][offset] = run_id
        finally:
            consumer.close()

    def audit(self) -> None:
        """One pass: committed offsets first, then the statuses of the runs below them."""
        committed = dict(self.monitor.latest)
        below: dict[str, tuple[int, int]] = {}
        reach: dict[int, int] = {}
        for p, c in committed.items():
            known = self.records.get(p, {})
            start = self.verified[p]
            end = start
            for off in range(start, max(start, c)):
                if off not in known:
                    break  # the tail has not read it yet: check next time
                run_id = known[off]
                if run_id is not None:
                    below[run_id] = (p, off)
                end = off + 1
            reach[p] = end
        if not below:
            self.verified.update(reach)
            return
        try:
            rows = self.db.query(
                "SELECT id, status FROM runs WHERE id = ANY(:ids)", ids=list(below)
            )
        except Exception:  # noqa: BLE001 - Postgres may be down on purpose: try later
            return
        status = {r.id: r.status for r in rows}
        self.audits += 1
        for run_id, (p, off) in below.items():
            s = status.get(run_id)
            if s is not None and s not in TERMINAL:
                self.ahead.append(
                    f"committed offset of partition {p} passed offset {off} "
                    f"while run {run_id} was {s}"
                )
        self.verified.update(reach)


def _ts(iso: str) -> float:
    return datetime.fromisoformat(iso).timestamp()


def _decode_json(raw: bytes | None) -> Any:
    try:
        return json.loads(raw) if raw is not None else None
    except (ValueError, TypeError):
        return None


def check_all(
    settings: Settings,
    db: Postgres,
    plan: dict[str, list[PlannedRun]],
    viewers: list[Viewer],
    poison: list[InjectedPoison],
    auditor: OffsetAuditor,
    usage_report: list[dict[str, Any]] | None = None,
    schedules: list[ChaosSchedule] | None = None,
    budgets: dict[str, Decimal] | None = None,
) -> Findings:
    """Every check of the module docstring; returns counts and violations."""
    f = Findings()
    planned = {
        r.run_id: r for runs in plan.values() for r in runs if r.run_id is not None and not r.merged
    }
    f.accepted = len(planned)
    for runs in plan.values():
        for r in runs:
            if r.run_id is None and not (r.over_budget_at and r.user in (budgets or {})):
                f.refused += 1
                f.violate(f"{r.user} run #{r.index} never accepted: {r.refused}")
    rows = {
        r.id: r
        for r in db.query(
            "SELECT id, user_id, status, attempt, failures, error, created_at, started_at,"
            " finished_at, input, cancel_requested_at, schedule_id, scheduled_for, partition"
            " FROM runs"
        )
    }
    messages: dict[str, list[Any]] = defaultdict(list)
    for m in db.query(
        "SELECT run_id, seq, kind, content, attempt, created_at FROM messages ORDER BY run_id, seq"
    ):
        messages[m.run_id].append(m)
    extra = {i for i, r in rows.items() if r.schedule_id is None} - set(planned)
    if extra:
        f.violate(f"{len(extra)} runs in Postgres that no answered request created")

    claims: dict[str, list[tuple[int, float, str]]] = defaultdict(list)
    for rec in read_topic(settings, settings.names.topic(RUN_EVENTS), timeout=180):
        ev = _decode_json(rec.value())
        if isinstance(ev, dict) and ev.get("event") == "transition" and ev.get("to") == "running":
            claims[ev["run_id"]].append(
                (int(ev.get("attempt", 0)), _ts(ev["at"]), str(ev.get("worker_id")))
            )

    for run_id, plan_run in planned.items():
        _check_run(f, plan_run, rows.get(run_id), messages.get(run_id, []), claims[run_id])
    _check_order(f, plan, rows, claims)
    _check_cancels(f, planned, rows, claims)
    _check_merges(f, plan, rows)
    _check_ledger(f, db, planned, rows, usage_report)
    _check_schedules(f, rows, schedules or [])
    _check_budgets(f, db, plan, rows, budgets or {})
    _check_memories(f, db, planned, rows, messages)
    _check_topic(f, settings, planned, messages)
    _check_viewers(f, viewers, messages)
    _check_dlq(f, settings, planned, poison)
    f.offset_audits = auditor.audits
    f.offsets_ahead = len(auditor.ahead)
    for line in auditor.ahead[:20]:
        f.violate(line)
    return f


def _check_run(
    f: Findings,
    plan: PlannedRun,
    row: Any,
    msgs: list[Any],
    claims: list[tuple[int, float, str]],
) -> None:
    run_id = plan.run_id
    if row is None:
        f.lost += 1
        f.violate(f"run {run_id} was accepted but is not in Postgres")
        return
    if row.status not in TERMINAL:
        f.lost += 1
        f.violate(f"run {run_id} ({plan.user} #{plan.index}) still {row.status}")
        return
    f.done += row.status == "done"
    f.failed += row.status == "failed"
    f.poison_runs += plan.poison
    f.max_attempt = max(f.max_attempt, row.attempt)
    expected = "failed" if plan.poison else "done"
    if plan.cancel is not None and plan.cancel.took:
        expected = "cancelled"
    elif expected == "done" and (row.error or "").startswith(BUDGET_STOP):
        # Stopped after the call that spent its user's budget: _check_budgets holds it
        # to a spent day's budget.
        expected = "failed"
    if row.status != expected:
        history = ", ".join(f"#{a} on {w}" for a, _, w in sorted(claims))
        f.violate(
            f"run {run_id} ended {row.status}, expected {expected}: {row.error} "
            f"(attempt {row.attempt}, failures {row.failures}; claims: {history})"
        )
    seqs = [m.seq for m in msgs]
    if seqs != list(range(len(seqs))):
        f.duplicate_chunks_db += len(seqs) - len(set(seqs))
        f.violate(f"run {run_id}: message seqs are not 0..n: {seqs[:50]}")
    kinds = [m.kind for m in msgs]
    ends = [k for k in kinds if k in TERMINAL_KINDS]
    if len(ends) != 1 or not kinds or kinds[-1] != KIND_OF_STATUS[row.status]:
        f.violate(f"run {run_id} ({row.status}): terminal messages {ends}, last {kinds[-1:]}")
    if "reset" in kinds:
        f.resumed_runs += 1
    if row.status == "done":
        last_reset = max((m.seq for m in msgs if m.kind == "reset"), default=-1)
        got = "".join(m.content for m in msgs if m.kind == "chunk" and m.seq > last_reset)
        # The final input: the submitted one, or that and the messages merged into it.
        if got != "".join(demo_tokens(row.input)):
            f.violate(f"run {run_id}: output differs from the demo model's for its input")
    if row.status == "cancelled" and row.started_at is None:
        return  # cancelled while pending: it never started
    if row.started_at is None or row.finished_at is None:
        f.violate(f"run {run_id} is {row.status} without started_at/finished_at")
        return
    s, e = row.started_at.timestamp(), row.finished_at.timestamp()
    outside = [m.seq for m in msgs if not s <= m.created_at.timestamp() <= e]
    if outside:
        f.order_violations += 1
        f.violate(f"run {run_id}: messages {outside[:10]} written outside its span")
    late = [a for a, at, _ in claims if not s <= at <= e + 0.001]
    if late:
        f.order_violations += 1
        f.violate(f"run {run_id}: attempt claims {late} outside its span [S, F]")


def _check_order(
    f: Findings,
    plan: dict[str, list[PlannedRun]],
    rows: dict[str, Any],
    claims: dict[str, list[tuple[int, float, str]]],
) -> None:
    f.interleaved_starts = _interleaved_starts(rows)
    for user, runs in plan.items():
        # A merged follow-up is part of the run it joined, not a run of its own.
        seq = [rows[r.run_id] for r in runs if r.run_id in rows and not r.merged]
        seq = [r for r in seq if r.started_at is not None and r.finished_at is not None]
        for prev, nxt in zip(seq, seq[1:], strict=False):
            if nxt.created_at < prev.created_at:
                f.order_violations += 1
                f.violate(f"{user}: run {nxt.id} was created before {prev.id}")
            if nxt.started_at <= prev.started_at:
                f.order_violations += 1
                f.violate(f"{user}: run {nxt.id} started before {prev.id} (submitted earlier)")
            elif nxt.started_at < prev.finished_at:
                f.order_violations += 1
                f.violate(
                    f"{user}: run {nxt.id} started {prev.finished_at - nxt.started_at} before "
                    f"{prev.id} finished"
                )
            early = [a for a, at, _ in claims.get(nxt.id, []) if at < prev.finished_at.timestamp()]
            if early:
                f.order_violations += 1
                f.violate(f"{user}: attempts {early} of {nxt.id} claimed before {prev.id} ended")


def _interleaved_starts(rows: dict[str, Any]) -> int:
    """Runs whose start fell inside the span of another user's run on the same partition."""
    spans: dict[int, list[tuple[Any, Any, str]]] = {}
    for r in rows.values():
        if r.partition is not None and r.started_at is not None and r.finished_at is not None:
            spans.setdefault(r.partition, []).append((r.started_at, r.finished_at, r.user_id))
    count = 0
    for runs in spans.values():
        runs.sort()
        open_: list[tuple[Any, str]] = []  # (finished_at, user) of runs started so far
        for started, finished, user in runs:
            open_ = [(end, u) for end, u in open_ if end > started]
            if any(u != user for _, u in open_):
                count += 1
            open_.append((finished, user))
    return count


def _check_cancels(
    f: Findings,
    planned: dict[str, PlannedRun],
    rows: dict[str, Any],
    claims: dict[str, list[tuple[int, float, str]]],
) -> None:
    for run_id, p in planned.items():
        answer = p.cancel
        if answer is None:
            continue
        f.cancels += 1
        row = rows.get(run_id)
        if answer.code is None:
            f.cancel_violations += 1
            f.violate(f"cancel of run {run_id} never answered: {answer.problem}")
            continue
        if not answer.took:
            f.cancels_after_end += answer.code == 200
            if answer.code != 200:
                f.cancel_violations += 1
                f.violate(f"cancel of run {run_id} answered {answer.code}: {answer.problem}")
            continue
        f.cancels_took += 1
        if row is None or row.status != "cancelled":
            f.cancel_violations += 1
            f.violate(
                f"run {run_id} was cancelled ({answer.code}) but ended "
                f"{None if row is None else row.status}"
            )
            continue
        requested = row.cancel_requested_at or row.finished_at
        if requested is None:
            f.cancel_violations += 1
            f.violate(f"run {run_id} is cancelled with neither cancel_requested_at nor finished_at")
            continue
        again = [a for a, at, _ in claims.get(run_id, []) if at > requested.timestamp() + 1.0]
        if again:
            f.cancel_violations += 1
            f.violate(f"run {run_id} ran again after its cancel: attempts {again} claimed")


def _check_merges(f: Findings, plan: dict[str, list[PlannedRun]], rows: dict[str, Any]) -> None:
    for runs in plan.values():
        for r in runs:
            if not r.follow_up or r.run_id is None:
                continue
            f.follow_ups += 1
            if not r.merged:
                continue
            f.merged += 1
            row = rows.get(r.run_id)
            text = row.input.get("text") if row is not None else None
            if not isinstance(text, str) or r.input["text"] not in text:
                f.merge_violations += 1
                f.violate(f"message merged into run {r.run_id} is not in its final input")
            # A done run's answer equals the demo model's for that final input
            # (_check_run), so it was computed on the merged message too.


def _check_ledger(
    f: Findings,
    db: Postgres,
    planned: dict[str, PlannedRun],
    rows: dict[str, Any],
    usage_report: list[dict[str, Any]] | None,
) -> None:
    # Completed (ok, not estimated) chat calls per run and attempt.
    completed: dict[str, dict[int, int]] = defaultdict(dict)
    f.ledger_rows = 0
    for r in db.query(
        "SELECT run_id, attempt, count(*) AS n, count(*) FILTER (WHERE kind = 'chat'"
        " AND outcome = 'ok' AND NOT estimated) AS ok_calls FROM ledger"
        " WHERE run_id IS NOT NULL GROUP BY run_id, attempt"
    ):
        f.ledger_rows += r.n
        completed[r.run_id][r.attempt] = r.ok_calls
    for run_id in planned:
        row = rows.get(run_id)
        if row is None:
            continue
        by_attempt = completed.get(run_id, {})
        twice = sorted(a for a, n in by_attempt.items() if n > 1)
        if twice:
            f.ledger_duplicates += 1
            f.violate(f"run {run_id}: attempts {twice} have their one chat call billed twice")
        finishing = by_attempt.get(row.attempt, 0)
        if row.status == "done" and finishing != 1:
            f.ledger_duplicates += 1
            f.violate(
                f"run {run_id} (done) has {finishing} completed chat calls of its finishing "
                f"attempt {row.attempt} in the ledger, expected 1"
            )
    if usage_report is None:
        return
    sums = {
        r.user_id: r
        for r in db.query(
            "SELECT user_id, count(*) AS calls, sum(prompt_tokens) AS prompt,"
            " sum(completion_tokens) AS completion, sum(cost_usd) AS cost"
            " FROM ledger GROUP BY user_id"
        )
    }
    reported = {r["user_id"]: r for r in usage_report}
    for user in set(sums) | set(reported):
        mine, theirs = sums.get(user), reported.get(user)
        if mine is None or theirs is None:
            f.ledger_report_mismatches += 1
            f.violate(f"usage of {user}: in the ledger {mine is not None}, reported {theirs}")
            continue
        got = (
            int(theirs["calls"]),
            int(theirs["prompt_tokens"]),
            int(theirs["completion_tokens"]),
            Decimal(theirs["cost_usd"]),
        )
        if got != (int(mine.calls), int(mine.prompt), int(mine.completion), Decimal(mine.cost)):
            f.ledger_report_mismatches += 1
            f.violate(f"usage report of {user} {got} differs from the ledger's sums {mine}")


def _check_memories(
    f: Findings,
    db: Postgres,
    planned: dict[str, PlannedRun],
    rows: dict[str, Any],
    messages: dict[str, list[Any]],
) -> None:
    memories: dict[str, list[str]] = defaultdict(list)
    for m in db.query("SELECT user_id, text FROM memories"):
        memories[m.user_id].append(m.text)
    for run_id, p in planned.items():
        row = rows.get(run_id)
        if p.memory is None or row is None or row.status != "done":
            continue
        f.memory_runs += 1
        kinds = [m.kind for m in messages.get(run_id, [])]
        f.memory_runs_retried += row.attempt > 1 or "reset" in kinds
        held = sum(p.memory in text for text in memories.get(p.user, []))
        if held != 1:
            f.memory_duplicates += held > 1
            f.memory_missing += held == 0
            f.violate(f"run {run_id}: its memory {p.memory!r} is stored {held} times")


@dataclass
class ChaosSchedule:
    """A per-minute schedule of the chaos run: its first due minute, when it was paused."""

    id: str
    user: str
    first: datetime
    paused_at: datetime | None = None


# A due minute is checked once it is this much older than the pause: the scheduler
# fires a minute within its tick, and a pause just after the minute may beat it.
SCHEDULE_GRACE_S = 20

SCHEDULED_INPUT = {"text": "chaos tick", "demo": {"tokens": 3, "delay_ms": 20}}


def create_schedules(db: Postgres, n: int, tag: str) -> list[ChaosSchedule]:
    """``n`` schedules firing every minute from the next one, for users of their own."""
    out = []
    for i in range(n):
        sid = uuid7()
        rows = db.query(
            "INSERT INTO schedules (id, user_id, cron, timezone, input, overlap, next_fire_at)"
            " VALUES (:id, :u, '* * * * *', 'UTC', CAST(:inp AS jsonb), 'allow',"
            " date_trunc('minute', now()) + interval '1 minute') RETURNING next_fire_at",
            id=sid,
            u=f"sched{i}-{tag}",
            inp=json.dumps(SCHEDULED_INPUT),
            commit=True,
        )
        out.append(ChaosSchedule(sid, f"sched{i}-{tag}", rows[0].next_fire_at))
    return out


def pause_schedules(db: Postgres, schedules: list[ChaosSchedule]) -> None:
    rows = db.query(
        "UPDATE schedules SET enabled = false WHERE id = ANY(:ids) RETURNING now() AS at",
        ids=[s.id for s in schedules],
        commit=True,
    )
    for s in schedules:
        s.paused_at = rows[0].at


def _check_schedules(f: Findings, rows: dict[str, Any], schedules: list[ChaosSchedule]) -> None:
    f.schedules = len(schedules)
    fired: dict[str, Counter[datetime]] = defaultdict(Counter)
    for r in rows.values():
        if r.schedule_id is not None:
            fired[r.schedule_id][r.scheduled_for] += 1
            f.scheduled_runs += 1
            if r.status != "done":
                f.schedule_violations += 1
                f.violate(f"scheduled run {r.id} ended {r.status}")
    for s in schedules:
        assert s.paused_at is not None
        minutes = fired[s.id]
        for minute, n in minutes.items():
            if n > 1:
                f.schedule_violations += 1
                f.violate(f"schedule {s.id} minute {minute:%H:%M} has {n} runs")
            if minute > s.paused_at:
                f.schedule_violations += 1
                f.violate(f"schedule {s.id} fired minute {minute:%H:%M} after its pause")
        due = s.first
        while due <= s.paused_at - timedelta(seconds=SCHEDULE_GRACE_S):
            f.schedule_minutes += 1
            if minutes[due] != 1:
                f.schedule_violations += 1
                f.violate(f"schedule {s.id} due minute {due:%H:%M} has {minutes[due]} runs")
            due += timedelta(minutes=1)


def _check_budgets(
    f: Findings,
    db: Postgres,
    plan: dict[str, list[PlannedRun]],
    rows: dict[str, Any],
    budgets: dict[str, Decimal],
) -> None:
    """Each budget is a day budget: spend restarts at midnight UTC (the period koda's
    spend rows and admission use), so a run admitted on a new day is not past the
    budget of the day before. A run stopped for money (``budget_exceeded``, the rule
    that a run stops after the call that spends its user's budget) must have been
    stopped when its day's spend had reached the limit."""
    f.budget_users = len(budgets)
    slack = 0.5

    def day(ts: float) -> Any:
        return datetime.fromtimestamp(ts, UTC).date()

    for user, limit in budgets.items():
        spent: dict[Any, Decimal] = defaultdict(Decimal)
        reached: dict[Any, float] = {}
        for r in db.query(
            "SELECT cost_usd, created_at FROM ledger WHERE user_id = :u ORDER BY created_at, id",
            u=user,
        ):
            d = day(r.created_at.timestamp())
            spent[d] += r.cost_usd
            if d not in reached and spent[d] >= limit:
                reached[d] = r.created_at.timestamp()
        for total in spent.values():
            f.budget_overshoot_usd = max(f.budget_overshoot_usd, total - limit)
            f.budget_max_spend_usd = max(f.budget_max_spend_usd, total)
        for p in plan.get(user, []):
            if p.over_budget_at is not None and p.run_id is None:
                f.budget_refusals += 1
                at = reached.get(day(p.over_budget_at))
                if at is None or p.over_budget_at < at - slack:
                    f.budget_violations += 1
                    f.violate(f"{user} run #{p.index} refused 402 with budget left")
            row = rows.get(p.run_id) if p.run_id is not None and not p.merged else None
            if row is None:
                continue
            at = reached.get(day(row.created_at.timestamp()))
            if at is not None and row.created_at.timestamp() > at + slack:
                f.budget_violations += 1
                f.violate(
                    f"{user} run {row.id} admitted "
                    f"{row.created_at.timestamp() - at:.1f}s after the budget was spent"
                )
    for row in rows.values():
        if row.status != "failed" or not (row.error or "").startswith(BUDGET_STOP):
            continue
        f.budget_stops += 1
        day_limit = budgets.get(row.user_id)
        end = row.finished_at.timestamp() if row.finished_at is not None else None
        spent_then = Decimal(0)
        if day_limit is not None and end is not None:
            for r in db.query(
                "SELECT cost_usd FROM ledger WHERE user_id = :u AND created_at >= :d"
                " AND created_at <= :t",
                u=row.user_id,
                d=datetime.combine(day(end), datetime.min.time(), UTC),
                t=datetime.fromtimestamp(end + slack, UTC),
            ):
                spent_then += r.cost_usd
        if day_limit is None or spent_then < day_limit:
            f.budget_violations += 1
            f.violate(f"run {row.id} stopped for money with its day's budget left: {row.error}")


def _check_topic(
    f: Findings,
    settings: Settings,
    planned: dict[str, PlannedRun],
    messages: dict[str, list[Any]],
) -> None:
    seen: Counter[str] = Counter()
    by_key = {f"{run_id}:{m.seq:010d}": m for run_id, ms in messages.items() for m in ms}
    for rec in read_topic(settings, settings.names.topic(RUN_CHUNKS), timeout=300):
        key = rec.key().decode()
        seen[key] += 1
        value = _decode_json(rec.value())
        row = by_key.get(key)
        if row is None or not isinstance(value, dict):
            f.violate(f"chunk record {key} on the topic has no Postgres row")
            continue
        if (value.get("kind"), value.get("content"), value.get("attempt")) != (
            row.kind,
            row.content,
            row.attempt,
        ):
            f.violate(f"chunk record {key} differs from its Postgres row")
    f.chunk_resends_topic = sum(n - 1 for n in seen.values() if n > 1)
    absent = [
        f"{run_id}:{m.seq:010d}"
        for run_id in planned
        for m in messages.get(run_id, [])
        if f"{run_id}:{m.seq:010d}" not in seen
    ]
    f.chunks_missing_on_topic = len(absent)
    if absent:
        f.violate(
            f"{len(absent)} chunks in Postgres are not on the topic after the completeness "
            f"pass: {', '.join(absent[:10])}"
        )


def _check_viewers(f: Findings, viewers: list[Viewer], messages: dict[str, list[Any]]) -> None:
    f.viewers = len(viewers)
    for v in viewers:
        f.viewer_reconnects += max(0, v.connections - 1)
        seqs = [s for s, _, _ in v.events]
        f.duplicate_chunks_viewers += len(seqs) - len(set(seqs))
        want = [(m.seq, m.kind, m.content) for m in messages.get(v.run_id, [])]
        got = [(s, k, d.get("content")) for s, k, d in v.events]
        problem = v.problem
        if problem is None and seqs != list(range(len(seqs))):
            problem = f"seqs not 0..n: {seqs[:40]}"
        if problem is None and got != want:
            problem = f"received {len(got)} events, Postgres has {len(want)}; they differ"
        if problem is not None:
            f.viewer_mismatches += 1
            f.violate(f"viewer of {v.run_id}: {problem}")


def _check_dlq(
    f: Findings,
    settings: Settings,
    planned: dict[str, PlannedRun],
    poison: list[InjectedPoison],
) -> None:
    letters = [
        _decode_json(m.value())
        for m in read_topic(settings, settings.names.topic(RUNS_DLQ), timeout=60)
    ]
    f.dead_letters = len(letters)
    poison_runs = {r for r, p in planned.items() if p.poison}
    at = {(p.partition, p.offset): p for p in poison if p.offset is not None}
    unplaced = Counter(p.kind for p in poison if p.offset is None)
    sources: Counter[Any] = Counter()
    for letter in letters:
        if not isinstance(letter, dict):
            f.violate("a dead letter is not JSON")
            continue
        reason: Any = letter.get("reason")
        if reason == "handler_failed":
            original = _decode_json(base64.b64decode(letter.get("original_value") or ""))
            run_id = original.get("run_id") if isinstance(original, dict) else None
            sources[("run", run_id)] += 1
            if run_id not in poison_runs:
                f.violate(f"dead letter for run {run_id}, which is not poison")
            continue
        source: tuple[Any, Any] = (letter.get("partition"), letter.get("offset"))
        sources[source] += 1
        item = at.get(source)
        if item is not None and item.kind == reason:
            continue
        if item is None and unplaced[reason] > 0 and sources[source] == 1:
            unplaced[reason] -= 1
            continue
        if item is None and sources[source] > 1:
            continue  # a repeat of a letter already matched
        f.violate(f"unexpected dead letter reason={reason} source={source}")
    f.dead_letter_repeats = sum(n - 1 for n in sources.values() if n > 1)
    for run_id in poison_runs:
        if sources[("run", run_id)] == 0:
            f.violate(f"poison run {run_id} has no dead letter")
    for (p, o), item in at.items():
        if sources[(p, o)] == 0:
            f.violate(f"injected {item.kind} record at {p}/{o} has no dead letter")


def wait_all_committed(settings: Settings, monitor: CommitMonitor, timeout: float) -> list[str]:
    """At the end every partition's committed offset must reach its end offset."""
    consumer = Consumer(consumer_config(settings, "chaos-ends", None) | {"group.id": "x"})
    topic = settings.names.topic(RUNS)
    ends = {
        p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
        for p in range(settings.partitions)
    }
    consumer.close()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        latest = monitor.latest
        behind = {
            p: (latest.get(p, -1), e) for p, e in ends.items() if e > 0 and latest.get(p, -1) < e
        }
        if not behind:
            return []
        time.sleep(0.5)
    return [f"partition {p}: committed {c} < end {e} after the run" for p, (c, e) in behind.items()]


def median_max(values: list[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    return statistics.median(values), max(values)
