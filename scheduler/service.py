"""``koda scheduler``: fire every due (schedule, scheduled minute) exactly once, statelessly.

Each pass reads Postgres's clock and the schedules whose persisted ``next_fire_at`` is
not after it, plans each one with :func:`koda.scheduling.plan` (pure), fires the minutes
the plan says fire, oldest first, through :func:`gateway.scheduled.fire` (the gateway's
insert and publish), then moves ``next_fire_at`` on with a compare-and-set on the value
it read. Nothing is held between passes and nothing is locked:

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
from datetime import datetime

from gateway.publisher import Delivery, RunPublisher
from gateway.scheduled import Fired, ScheduleRow, ScheduleStore, fire
from gateway.store import RunStore
from koda import metrics
from koda.errors import DatabaseError, KodaError
from koda.scheduling import Outcome, Plan, ScheduleInvalid, days_of, due_minutes, plan

log = logging.getLogger(__name__)

# Wake this long after a minute boundary: Postgres's clock must have passed it.
BOUNDARY_SLACK_S = 0.02


@dataclass
class PassResult:
    """What one pass did (tests and the benchmark read it)."""

    schedules: int = 0
    fired: int = 0
    conflicts: int = 0
    skipped: int = 0
    missed: int = 0
    lags: list[float] = field(default_factory=list)


class Scheduler:
    """One replica; any number may run at once."""

    def __init__(
        self,
        schedules: ScheduleStore,
        runs: RunStore,
        publisher: RunPublisher,
        *,
        partitions: int,
        batch: int = 500,
        concurrency: int = 16,
        poll_s: float = 5.0,
        replica: str | None = None,
    ) -> None:
        self.schedules = schedules
        self.runs = runs
        self.publisher = publisher
        self.partitions = partitions
        self.batch = batch
        self.poll_s = poll_s
        self.salt = replica or os.urandom(8).hex()
        self._slots = asyncio.Semaphore(concurrency)
        # Postgres's clock minus ours, refreshed every pass (only used to time sleeps).
        self._skew_s = 0.0

    async def run_pass(self) -> PassResult:
        """Fire everything due now; returns when no schedule is due any more."""
        result = PassResult()
        while True:
            started = time.time()
            now, rows = await self.schedules.due(self.batch, self.salt)
            self._skew_s = now.timestamp() - (started + time.time()) / 2
            metrics.SCHEDULES_DUE.set(len(rows))
            if not rows:
                return result
            # One user's schedules go one after another: the daily cap counts the user's
            # runs across schedules, so each must see the runs the previous one fired.
            by_user: dict[str, list[ScheduleRow]] = {}
            for row in rows:
                by_user.setdefault(row.user_id, []).append(row)
            outcomes = [
                outcome
                for group in await asyncio.gather(
                    *(self._user(group, now, result) for group in by_user.values())
                )
                for outcome in group
            ]
            ordered = [row for group in by_user.values() for row in group]
            advanced = 0
            for row, outcome in zip(ordered, outcomes, strict=True):
                if isinstance(outcome, BaseException):
                    log.warning(
                        "event=schedule_failed schedule_id=%s user_id=%s error=%s",
                        row.id,
                        row.user_id,
                        outcome,
                    )
                elif outcome:
                    advanced += 1
            result.schedules += len(rows)
            if len(rows) < self.batch and advanced == 0:
                # Every row either failed or was advanced by another replica: do not spin.
                return result

    async def _user(
        self, rows: list[ScheduleRow], now: datetime, result: PassResult
    ) -> list[bool | BaseException]:
        outcomes: list[bool | BaseException] = []
        for row in rows:
            try:
                outcomes.append(await self._schedule(row, now, result))
            except Exception as exc:  # reported per schedule by the caller
                outcomes.append(exc)
        return outcomes

    async def _schedule(self, row: ScheduleRow, now: datetime, result: PassResult) -> bool:
        """Plan and fire one schedule; True when something moved (by us or another)."""
        if row.next_fire_at is None:
            return False
        async with self._slots:
            try:
                spec = row.spec
            except ScheduleInvalid as exc:  # a zone removed from tzdata since it was stored
                log.error("event=schedule_unreadable schedule_id=%s error=%s", row.id, exc)
                return False
            first = row.next_fire_at
            policy = row.policy
            due, _, _ = due_minutes(spec, first, now, policy.catchup_s, limit=self.batch)
            facts = await self.schedules.facts(row, days_of(spec, due), first)
            decided = plan(spec, policy, first, now, facts, limit=self.batch)
            fired = await self._fire_all(row, decided, result)
            last = max(fired) if fired else None
            won = await self.schedules.advance(row.id, first, decided.next_fire_at, last)
        if won:
            self._count(row, decided, result)
        return True

    async def _fire_all(
        self, row: ScheduleRow, decided: Plan, result: PassResult
    ) -> list[datetime]:
        """Create each fire's run oldest first (publishing as it goes), then await the acks."""
        created: list[tuple[datetime, Fired]] = []
        minutes = decided.fires
        for minute in minutes:
            outcome = await fire(self.runs, self.publisher, row, minute, partitions=self.partitions)
            if outcome.delivery is None:
                metrics.SCHEDULE_FIRE_CONFLICTS.inc()
                result.conflicts += 1
            else:
                metrics.SCHEDULE_FIRES.inc()
                result.fired += 1
                created.append((minute, outcome))
        delivered: list[str] = []
        for minute, outcome in created:
            assert outcome.delivery is not None
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
            lag = time.time() + self._skew_s - minute.timestamp()
            metrics.SCHEDULE_FIRE_LAG_SECONDS.observe(lag)
            result.lags.append(lag)
            delivered.append(outcome.run.run_id)
            log.info(
                "event=schedule_fired schedule_id=%s run_id=%s user_id=%s scheduled_for=%s "
                "partition=%d offset=%d lag_s=%.3f",
                row.id,
                outcome.run.run_id,
                row.user_id,
                minute.isoformat(),
                delivery.partition,
                delivery.offset,
                lag,
            )
        if delivered:
            try:
                await self.runs.mark_published(delivered)
            except DatabaseError as exc:  # harmless: the sweeper may publish them again
                log.warning("event=mark_published_failed runs=%d error=%s", len(delivered), exc)
        return minutes

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
            try:
                done = await self.run_pass()
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
                log.warning("event=scheduler_pass_failed error=%s", exc)
            except Exception:
                log.exception("event=scheduler_pass_failed")
            try:
                await asyncio.wait_for(stopping.wait(), self.seconds_to_wake())
            except TimeoutError:
                pass
