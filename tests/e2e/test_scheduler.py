"""Scheduler processes on the real stack, in real time (about 3-4 minutes in all).

Two scenarios overlap in time, each in its own namespace (own tables and topics, own
scheduler processes and worker), so the suite pays for the minutes once:

* ``steady``: two schedulers and per-minute schedules for 3+ minutes; one scheduler is
  killed with SIGKILL in the middle of firing a minute, as soon as that minute's first
  runs exist. They fire in batches of 5 schedules (one insert transaction each), so the
  kill usually lands between two of its batches, with the minute partly written. Every
  due minute of every schedule has exactly one run, and every run reaches ``done`` (a
  worker runs them).
* ``downtime``: two schedulers fire the first minute, both stop for two minutes, then
  one starts: the minutes missed while down fire once each, oldest first; a schedule
  whose catch-up window is shorter than the outage counts the older minute as missed
  and never runs it late.
"""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import text

from koda_runtime.lifecycle.ids import uuid7
from koda_runtime.schemas.db import sync_engine
from koda_runtime.schemas.migrate import upgrade
from koda_runtime.schemas.schedules import fire_key
from koda_runtime.topics.admin import apply_topics
from tests.fixtures.namespaces import delete_topics, drop_schema, make_settings
from tests.fixtures.processes import SchedulerProcess, WorkerProcess
from tests.support import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(480)]

STEADY_SCHEDULES = 30
QUICK_RUN = {"text": "tick", "demo": {"tokens": 2, "delay_ms": 1}}


# Sweeps and passes every second: the production cadence, compressed.
FAST_PASSES = {"KODA_SWEEP_AFTER": "3", "KODA_SWEEP_INTERVAL": "1", "KODA_SCHEDULER_POLL": "1"}


class Namespace:
    """One scenario's tables, topics, schedules and processes."""

    def __init__(self, stack) -> None:
        self.settings = make_settings(stack, max_inflight=8)
        apply_topics(self.settings)
        upgrade(self.settings)
        self.engine = sync_engine(self.settings)
        self.schedulers: list[SchedulerProcess] = []
        self.worker = WorkerProcess(self.settings, f"w-{self.settings.namespace}")

    def schedule(self, user: str, first: datetime, *, catchup_s: int = 900) -> str:
        sid = uuid7()
        with self.engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO schedules (id, user_id, cron, timezone, input, overlap, "
                    "catchup_s, next_fire_at) VALUES (:id, :u, '* * * * *', 'UTC', "
                    "CAST(:inp AS jsonb), 'allow', :c, :n)"
                ),
                {"id": sid, "u": user, "inp": json.dumps(QUICK_RUN), "c": catchup_s, "n": first},
            )
        return sid

    def scheduler(self, name: str, **env: str) -> SchedulerProcess:
        proc = SchedulerProcess(
            self.settings, f"{self.settings.namespace}-{name}", {**FAST_PASSES, **env}
        )
        proc.start()
        self.schedulers.append(proc)
        return proc

    def runs(self) -> list[tuple[str, datetime, str, str]]:
        with self.engine.connect() as conn:
            rows = conn.execute(
                text(
                    "SELECT schedule_id, scheduled_for, status, idempotency_key FROM runs "
                    "WHERE schedule_id IS NOT NULL ORDER BY scheduled_for"
                )
            ).all()
        return [(r.schedule_id, r.scheduled_for, r.status, r.idempotency_key) for r in rows]

    def count_for(self, minute: datetime) -> int:
        with self.engine.connect() as conn:
            return int(
                conn.execute(
                    text("SELECT count(*) FROM runs WHERE scheduled_for = :m"), {"m": minute}
                ).scalar_one()
            )

    def close(self) -> None:
        for proc in self.schedulers:
            proc.kill()
        self.worker.kill()
        self.engine.dispose()
        delete_topics(self.settings)
        drop_schema(self.settings)


def _minute(t: datetime) -> datetime:
    return t.replace(second=0, microsecond=0)


def _wait_for(instant: datetime, what: str) -> None:
    wait_until(
        lambda: datetime.now(UTC) >= instant,
        timeout=max(1.0, (instant - datetime.now(UTC)).total_seconds() + 5),
        interval=0.01,
        what=what,
    )


def _fire_log_order(proc: SchedulerProcess, schedule_id: str) -> list[str]:
    return [
        line.split("scheduled_for=")[1].split()[0]
        for line in proc.log().splitlines()
        if "event=schedule_fired" in line and f"schedule_id={schedule_id}" in line
    ]


def test_schedulers_fire_every_due_minute_once_through_a_kill_and_a_downtime(stack) -> None:
    steady, downtime = Namespace(stack), Namespace(stack)
    try:
        # Begin early in a minute: the "short" schedule's 60 s window must still cover
        # the first minute once the schedulers are up (they take seconds to start here).
        wait_until(lambda: datetime.now(UTC).second < 25, timeout=40, what="an early second")
        start = _minute(datetime.now(UTC))  # already due: fires as soon as a scheduler runs
        steady_ids = [steady.schedule(f"u{i}", start) for i in range(STEADY_SCHEDULES)]
        long_ids = [downtime.schedule(f"b{i}", start, catchup_s=600) for i in range(2)]
        short_id = downtime.schedule("short", start, catchup_s=60)
        steady.worker.start()
        downtime.worker.start()
        # Small batches: a minute of the steady schedules takes several inserts per replica.
        first_pair = [steady.scheduler(n, KODA_SCHEDULER_BATCH="5") for n in ("s1", "s2")]
        down_pair = [downtime.scheduler("d1"), downtime.scheduler("d2")]

        # downtime: both fire the first minute, then both stop.
        wait_until(
            lambda: downtime.count_for(start) == 3, timeout=60, what="the first minute fired"
        )
        for p in down_pair:
            wait_until(lambda: "event=scheduler_started" in p.log(), what=f"{p.name} up")  # noqa: B023
        assert [p.stop() for p in down_pair] == [0, 0]
        stopped_at = datetime.now(UTC)

        # steady: SIGKILL s1 while the schedulers are firing the second boundary's minute.
        target = start + timedelta(minutes=2)
        _wait_for(target, "the kill minute")
        wait_until(
            lambda: steady.count_for(target) > 0,
            timeout=30,
            interval=0.005,
            what="firing of the kill minute to begin",
        )
        partial = steady.count_for(target)
        first_pair[0].kill()

        # downtime: one scheduler comes back two minutes later, not near a minute's edge
        # (so which minutes fall outside the 60 s window is unambiguous).
        restart = stopped_at + timedelta(minutes=2)
        if not 10 <= restart.second <= 50:
            restart += timedelta(seconds=20)
        _wait_for(restart, "the end of the downtime")
        restarted_at = datetime.now(UTC)
        survivor = downtime.scheduler("d3")

        last = start + timedelta(minutes=3)
        _wait_for(last, "the last minute")
        expected_steady = {start + timedelta(minutes=i) for i in range(4)}

        def steady_done() -> bool:
            runs = steady.runs()
            return len(runs) >= len(expected_steady) * STEADY_SCHEDULES and all(
                r[2] == "done" for r in runs
            )

        wait_until(steady_done, timeout=90, interval=0.5, what="every steady run done")
        long_minutes = {start + timedelta(minutes=i) for i in range(4)}
        wait_until(
            lambda: (
                len(downtime.runs()) >= 2 * len(long_minutes)
                and all(r[2] == "done" for r in downtime.runs())
            ),
            timeout=90,
            interval=0.5,
            what="every downtime run done",
        )
        # Both schedulers stay up a little past the last minute: nothing more appears.
        end = _minute(datetime.now(UTC))

        runs = steady.runs()
        keys = [r[3] for r in runs]
        assert len(keys) == len(set(keys))
        per_schedule: dict[str, list[datetime]] = {}
        for sid, minute, status, key in runs:
            per_schedule.setdefault(sid, []).append(minute)
            assert status == "done"
            assert key == fire_key(sid, minute)
        assert set(per_schedule) == set(steady_ids)
        for minutes in per_schedule.values():
            assert len(minutes) == len(set(minutes)), "a minute fired twice"
            assert set(minutes) >= expected_steady, "a minute was lost"
            assert set(minutes) <= {start + timedelta(minutes=i) for i in range(6)}
            assert max(minutes) <= end
        assert first_pair[1].alive(), first_pair[1].log()[-3000:]
        # s1 was at work before dying: it planned and inserted fires. Which replica's
        # inserts win each minute is a race (s1 may have lost all of them), so this asks
        # for its batches, not for runs it created.
        batches = re.findall(
            r"event=scheduler_batch schedules=\d+ fires=(\d+)", first_pair[0].log()
        )
        assert any(int(n) > 0 for n in batches), first_pair[0].log()[-3000:]
        print(f"s1 was killed with {partial}/{STEADY_SCHEDULES} of the minute's runs written")

        drun = downtime.runs()
        by_schedule: dict[str, list[datetime]] = {}
        for sid, minute, status, _ in drun:
            by_schedule.setdefault(sid, []).append(minute)
            assert status == "done"
        for sid in long_ids:
            assert len(by_schedule[sid]) == len(set(by_schedule[sid]))
            assert set(by_schedule[sid]) >= long_minutes
            # Replayed oldest first by the one scheduler that came back.
            replayed = _fire_log_order(survivor, sid)
            assert replayed == sorted(replayed) and len(replayed) >= 2
        # The short window: minutes older than 60 s at the restart are missed, never late.
        window_start = restarted_at - timedelta(seconds=60)
        during = [
            m
            for m in (start + timedelta(minutes=i) for i in range(1, 4))
            if stopped_at < m + timedelta(seconds=1) and m < restarted_at
        ]
        missed = [m for m in during if m < window_start - timedelta(seconds=2)]
        kept = [m for m in during if m > window_start + timedelta(seconds=2)]
        assert missed, (stopped_at, restarted_at)
        short = set(by_schedule[short_id])
        assert start in short
        assert not short & set(missed), "a minute outside the catch-up window ran late"
        assert set(kept) <= short
        assert "event=schedule_missed" in survivor.log()
    finally:
        logs = "\n".join(p.log()[-1500:] for p in steady.schedulers + downtime.schedulers)
        steady.close()
        downtime.close()
        print(logs)
