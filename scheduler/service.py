"""``koda scheduler``: fire every due (schedule, scheduled minute) exactly once, statelessly.

Each pass reads Postgres's clock and, in batches, the schedules whose persisted
``next_fire_at`` is not after it, plans each one with :func:`koda_runtime.scheduling.plan`
(pure), fires the minutes the plan says fire, oldest first, through
:func:`koda_runtime.topics.scheduled.fire_many` (admission's one insert, batched, and the publish),
then moves ``next_fire_at`` on with a compare-and-set on the value it read. Nothing is
held between passes and nothing is locked:

* Two replicas planning the same schedule fire the same minutes under the same keys;
  ``INSERT ... ON CONFLICT DO NOTHING`` lets exactly one create each run, and only the
  creator publishes. The compare-and-set lets one of them advance; the other's fails
  and changes nothing. Skips and misses are counted by the replica whose advance won.
* A replica killed at any point leaves either no run (the next pass, its own or the
  other replica's, fires the minute: ``next_fire_at`` was not advanced) or a run that is
  pending: published, or not yet, in which case the sweeper (run here too, and in every
  gateway) publishes it. Nothing is fired twice and nothing is lost.
* After downtime the persisted ``next_fire_at`` is in the past: the plan replays the
  minutes inside the catch-up window, oldest first, and counts older ones as missed.
* The time is Postgres's ``now()``, one clock for every replica: a replica whose own
  clock is wrong neither fires early nor late.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass, field
from datetime import date, datetime

from koda_runtime import metrics, tracing
from koda_runtime.errors import DatabaseError, KodaError
from koda_runtime.scheduling import (
    CronSpec,
    Facts,
    Outcome,
    Plan,
    ScheduleInvalid,
    days_of,
    due_minutes,
    plan,
)
from koda_runtime.schemas.runs.admission import NewRun, RunAdmission
from koda_runtime.schemas.schedules import Advance, ScheduleRow, ScheduleStore
from koda_runtime.topics.kafka.publisher import Delivery, RunPublisher
from koda_runtime.topics.scheduled import Fired, fire_many, scheduled_run

log = logging.getLogger(__name__)

# Wake this long after a minute boundary: Postgres's clock must have passed it.
BOUNDARY_SLACK_S = 0.02
# Runs per insert transaction (and per published_at update).
INSERT_CHUNK = 1000


@dataclass
class PassResult:
    """What one pass did (tests and the benchmark read it)."""

    schedules: int = 0
    fired: int = 0
    conflicts: int = 0
    skipped: int = 0
    missed: int = 0
    lags: list[float] = field(default_factory=list)


def _fire(row: ScheduleRow, minute: datetime, partitions: int) -> NewRun:
    """The run of one fire, made in the fire's span (koda/tracing.py): the run's trace
    starts here and goes on through its record to the worker."""
    if not tracing.ON:
        return scheduled_run(row, minute, partitions=partitions)
    attributes = {"koda.schedule_id": row.id, "koda.scheduled_for": minute.isoformat()}
    with tracing.span("koda.schedule.fire", attributes=attributes) as span:
        new = scheduled_run(row, minute, partitions=partitions)
        span.set_attribute("koda.run_id", new.run_id)
        return new


class Scheduler:
    """One replica; any number may run at once."""

    def __init__(
        self,
        schedules: ScheduleStore,
        runs: RunAdmission,
        publisher: RunPublisher,
        *,
        partitions: int,
        batch: int = 500,
        poll_s: float = 5.0,
        replica: str | None = None,
        budgets: bool = True,
    ) -> None:
        self.schedules = schedules
        self.budgets = budgets
        self.runs = runs
        self.publisher = publisher
        self.partitions = partitions
        self.batch = batch
        self.poll_s = poll_s
        self.salt = replica or os.urandom(8).hex()
        # Postgres's clock minus ours, refreshed every pass (only used to time sleeps).
        self._skew_s = 0.0
        # For /livez and /readyz (scheduler/bootstrap.py): the loop's last sign of progress, the
        # passes completed, and why the last pass failed (None once one completes).
        self.last_progress = time.monotonic()
        self.passes = 0
        self.last_error: str | None = None

    async def run_pass(self) -> PassResult:
        """Fire everything due now; returns when no schedule is due any more."""
        result = PassResult()
        # A batch's acks are awaited while the next batch is planned and inserted.
        settling: list[asyncio.Task[None]] = []
        try:
            while True:
                started = time.time()
                now, rows = await self.schedules.due(self.batch, self.salt)
                self._skew_s = now.timestamp() - (started + time.time()) / 2
                metrics.SCHEDULES_DUE.set(len(rows))
                if not rows:
                    return result
                result.schedules += len(rows)
                moved = await self._batch(rows, now, result, settling)
                if not moved:
                    # Nothing moved (another replica advanced every row meanwhile, or the
                    # writes failed): the next pass looks again rather than spin here.
                    return result
        finally:
            await asyncio.gather(*settling, return_exceptions=True)

    async def _batch(
        self,
        rows: list[ScheduleRow],
        now: datetime,
        result: PassResult,
        settling: list[asyncio.Task[None]],
    ) -> bool:
        """Plan, fire and advance ``rows``; True when at least one schedule moved on."""
        began = time.perf_counter()
        self.last_progress = time.monotonic()
        work: list[tuple[ScheduleRow, CronSpec, list[datetime]]] = []
        moves: list[Advance] = []
        for row in rows:
            assert row.next_fire_at is not None
            try:
                spec = row.spec
            except ScheduleInvalid as exc:  # e.g. a zone removed from tzdata since
                log.error("event=schedule_unreadable schedule_id=%s error=%s", row.id, exc)
                moves.append(Advance(row.id, row.next_fire_at, None, None))
                continue
            due, _, _ = due_minutes(spec, row.next_fire_at, now, row.catchup_s, limit=self.batch)
            work.append((row, spec, due))
        plans = await self._plan(work, now)
        planned = time.perf_counter()
        fires: list[tuple[ScheduleRow, NewRun]] = []
        for (row, _spec, _due), decided in zip(work, plans, strict=True):
            minutes = decided.fires
            fires += [(row, _fire(row, m, self.partitions)) for m in minutes]
            assert row.next_fire_at is not None
            moves.append(
                Advance(row.id, row.next_fire_at, decided.next_fire_at, max(minutes, default=None))
            )
        created: list[tuple[ScheduleRow, NewRun, Fired]] = []
        for i in range(0, len(fires), INSERT_CHUNK):
            chunk = fires[i : i + INSERT_CHUNK]
            outcomes = await fire_many(self.runs, self.publisher, [new for _, new in chunk])
            for (row, new), outcome in zip(chunk, outcomes, strict=True):
                if outcome is None:
                    result.conflicts += 1
                    metrics.SCHEDULE_FIRE_CONFLICTS.inc()
                else:
                    result.fired += 1
                    metrics.SCHEDULE_FIRES.inc()
                    created.append((row, new, outcome))
        inserted = time.perf_counter()
        won = await self.schedules.advance_many(moves)
        for (row, _spec, _due), decided in zip(work, plans, strict=True):
            if row.id in won:
                self._count(row, decided, result)
        settling.append(asyncio.create_task(self._settle(created, result)))
        log.info(
            "event=scheduler_batch schedules=%d fires=%d created=%d advanced=%d plan_ms=%.0f "
            "insert_ms=%.0f advance_ms=%.0f",
            len(rows),
            len(fires),
            len(created),
            len(won),
            (planned - began) * 1000,
            (inserted - planned) * 1000,
            (time.perf_counter() - inserted) * 1000,
        )
        return bool(won) or bool(created)

    async def _plan(
        self, work: list[tuple[ScheduleRow, CronSpec, list[datetime]]], now: datetime
    ) -> list[Plan]:
        """Each schedule's plan, with its facts read from Postgres in two statements.

        One user's schedules are planned one after another, each seeing the fires of the
        ones before it: the daily cap counts the user's runs across schedules."""
        spans: list[tuple[str, datetime, datetime]] = []
        span_of: list[list[tuple[date, int]]] = []
        for row, spec, due in work:
            mine = []
            for day in days_of(spec, due):
                start, end = spec.day_bounds(day)
                mine.append((day, len(spans)))
                spans.append((row.user_id, start, end))
            span_of.append(mine)
        counts = await self.schedules.scheduled_counts(spans)
        skip = [i for i, (row, _, due) in enumerate(work) if due and row.overlap == "skip"]
        active_list = await self.schedules.latest_active(
            [(work[i][0].id, work[i][2][0]) for i in skip]
        )
        active = dict(zip(skip, active_list, strict=True))
        # A spent budget refuses a scheduled run as it refuses any new run (read without a
        # lock, like admission: replicas firing at once overshoot by at most those runs).
        spent = (
            await self.schedules.over_budget(sorted({row.user_id for row, _, due in work if due}))
            if self.budgets
            else set()
        )
        fired_by_user: dict[str, list[datetime]] = {}
        plans: list[Plan] = []
        for i, (row, spec, _due) in enumerate(work):
            assert row.next_fire_at is not None
            earlier = fired_by_user.setdefault(row.user_id, [])
            per_day = {}
            for day, index in span_of[i]:
                _user, start, end = spans[index]
                per_day[day] = counts[index] + sum(1 for m in earlier if start <= m < end)
            facts = Facts(
                runs_per_day=per_day,
                previous_active=active.get(i, False),
                over_budget=row.user_id in spent,
            )
            decided = plan(spec, row.policy, row.next_fire_at, now, facts, limit=self.batch)
            earlier += decided.fires
            plans.append(decided)
        return plans

    async def _settle(
        self, created: list[tuple[ScheduleRow, NewRun, Fired]], result: PassResult
    ) -> None:
        """Await every created run's ack: the lag metric, a log line, ``published_at``."""
        delivered: list[str] = []
        for row, new, outcome in created:
            assert outcome.delivery is not None and new.scheduled_for is not None
            try:
                delivery: Delivery = await outcome.delivery
            except KodaError as exc:
                log.warning(
                    "event=scheduled_publish_failed schedule_id=%s run_id=%s error=%s "
                    "(the sweeper publishes it)",
                    row.id,
                    outcome.run.run_id,
                    exc,
                )
                continue
            lag = time.time() + self._skew_s - new.scheduled_for.timestamp()
            metrics.SCHEDULE_FIRE_LAG_SECONDS.observe(lag)
            result.lags.append(lag)
            delivered.append(outcome.run.run_id)
            log.info(
                "event=schedule_fired schedule_id=%s run_id=%s user_id=%s scheduled_for=%s "
                "partition=%d offset=%d lag_s=%.3f",
                row.id,
                outcome.run.run_id,
                row.user_id,
                new.scheduled_for.isoformat(),
                delivery.partition,
                delivery.offset,
                lag,
            )
        for i in range(0, len(delivered), INSERT_CHUNK):
            try:
                await self.runs.mark_published(delivered[i : i + INSERT_CHUNK])
            except DatabaseError as exc:  # harmless: the sweeper may publish them again
                log.warning("event=mark_published_failed runs=%d error=%s", len(delivered), exc)

    def _count(self, row: ScheduleRow, decided: Plan, result: PassResult) -> None:
        for d in decided.decisions:
            if d.outcome is Outcome.SKIP and d.reason is not None:
                metrics.SCHEDULE_SKIPS.labels(reason=d.reason.value).inc()
                result.skipped += 1
                log.info(
                    "event=schedule_skipped schedule_id=%s user_id=%s scheduled_for=%s reason=%s",
                    row.id,
                    row.user_id,
                    d.minute.isoformat(),
                    d.reason.value,
                )
        if decided.missed:
            metrics.SCHEDULE_MISSED.inc(decided.missed)
            result.missed += decided.missed
            log.warning(
                "event=schedule_missed schedule_id=%s user_id=%s missed=%d%s catchup_s=%d",
                row.id,
                row.user_id,
                decided.missed,
                "+" if decided.missed_truncated else "",
                row.catchup_s,
            )

    def seconds_to_wake(self) -> float:
        """Until just after the next minute boundary (Postgres's clock), at most ``poll_s``."""
        now = time.time() + self._skew_s
        to_boundary = 60.0 - (now % 60.0) + BOUNDARY_SLACK_S
        return max(0.0, min(self.poll_s, to_boundary))

    async def run_forever(self, stopping: asyncio.Event) -> None:
        """Pass, sleep until the next minute (or ``poll_s``), repeat until ``stopping``."""
        while not stopping.is_set():
            self.last_progress = time.monotonic()
            try:
                done = await self.run_pass()
                self.passes += 1
                self.last_error = None
                if done.fired or done.skipped or done.missed:
                    log.info(
                        "event=scheduler_pass schedules=%d fired=%d conflicts=%d skipped=%d "
                        "missed=%d",
                        done.schedules,
                        done.fired,
                        done.conflicts,
                        done.skipped,
                        done.missed,
                    )
            except KodaError as exc:
                self.last_error = str(exc)
                log.warning("event=scheduler_pass_failed error=%s", exc)
            except Exception as exc:
                self.last_error = type(exc).__name__
                log.exception("event=scheduler_pass_failed")
            self.last_progress = time.monotonic()
            try:
                await asyncio.wait_for(stopping.wait(), self.seconds_to_wake())
            except TimeoutError:
                pass
