"""Many schedules due in the same minute, two schedulers: how late is the last run?

The bench writes ``--schedules`` per-minute schedules (one user each, overlap allow) whose
``next_fire_at`` is the same minute boundary M, starts two ``koda scheduler`` processes
(as a user starts them) well before M, and waits until every schedule has its run for M.
It prints:

* fire lag, the time from M to the broker's acknowledgement of each run's record (what
  ``koda_schedule_fire_lag_seconds`` measures), p50 / p99 / max over every run, read
  from the schedulers' ``event=schedule_fired`` lines; also the last record's broker
  timestamp minus M (the produce time of the last record, as the topic saw it);
* duplicates: (schedule, minute) pairs with more than one run in Postgres (must be 0),
  and run-requested records on the topic beyond one per run;
* each scheduler's CPU seconds from before M until the last run was published, how many
  runs it created and how many it found already created by the other.

Goal: every run published within 10 s of the minute on this machine.

    make bench-schedules                              # 10,000 schedules
    python -m tests.bench.schedules --schedules 2000  # a quicker look
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from datetime import UTC, datetime, timedelta

from sqlalchemy import text

from koda_runtime.lifecycle.ids import uuid7
from koda_runtime.schemas.db import sync_engine
from koda_runtime.settings import Settings
from koda_runtime.topics.catalogue import RUNS
from tests.bench.common import Table, cpu_seconds, namespace, percentile, services
from tests.fixtures.processes import SchedulerProcess
from tests.fixtures.runs import read_topic

GOAL_S = 10.0
LEAD_S = 25.0  # schedulers are up and idle this long before M
_LAG = re.compile(r"event=schedule_fired .*scheduled_for=(\S+) .*lag_s=([0-9.]+)")
_BATCH = re.compile(
    r"ts=(\S+ \S+) .*event=scheduler_batch .*plan_ms=(\d+) insert_ms=(\d+) advance_ms=(\d+)"
)
_PASS = re.compile(r"event=scheduler_pass schedules=\d+ fired=(\d+) conflicts=(\d+)")


def insert(settings: Settings, count: int, minute: datetime) -> None:
    engine = sync_engine(settings)
    rows = [
        {
            "id": uuid7(),
            "u": f"u{i:05d}",
            "inp": json.dumps({"text": f"tick {i}", "demo": {"tokens": 1, "delay_ms": 0}}),
            "n": minute,
        }
        for i in range(count)
    ]
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO schedules (id, user_id, cron, timezone, input, overlap, next_fire_at)"
                " VALUES (:id, :u, '* * * * *', 'UTC', CAST(:inp AS jsonb), 'allow', :n)"
            ),
            rows,
        )
    engine.dispose()


def scheduler(settings: Settings, name: str, batch: int) -> SchedulerProcess:
    return SchedulerProcess(settings, name, {"KODA_SCHEDULER_BATCH": str(batch)}).start()


def count_runs(settings: Settings, minute: datetime) -> tuple[int, int, int]:
    """(runs for ``minute``, of them published, duplicate (schedule, minute) pairs)."""
    engine = sync_engine(settings)
    with engine.connect() as conn:
        row = conn.execute(
            text(
                "SELECT count(*), count(published_at), "
                "(SELECT count(*) FROM (SELECT schedule_id FROM runs WHERE scheduled_for = :m "
                "GROUP BY schedule_id, scheduled_for HAVING count(*) > 1) d) "
                "FROM runs WHERE scheduled_for = :m"
            ),
            {"m": minute},
        ).one()
    engine.dispose()
    return int(row[0]), int(row[1]), int(row[2])


def measure(settings: Settings, count: int, batch: int) -> Table:
    now = datetime.now(UTC)
    minute = now.replace(second=0, microsecond=0) + timedelta(minutes=1)
    if (minute - now).total_seconds() < LEAD_S:
        minute += timedelta(minutes=1)
    insert(settings, count, minute)
    procs = [scheduler(settings, "scheduler-a", batch), scheduler(settings, "scheduler-b", batch)]
    try:
        while datetime.now(UTC) < minute - timedelta(seconds=2):
            for p in procs:
                p.check()
            time.sleep(0.2)  # a countdown to a wall-clock instant, not a wait for a condition
        cpu_before = [cpu_seconds(p.pid) for p in procs]
        deadline = time.monotonic() + 180
        published = 0
        while time.monotonic() < deadline:
            runs, published, _ = count_runs(settings, minute)
            if published >= count:
                break
            time.sleep(0.2)
        cpu_after = [cpu_seconds(p.pid) for p in procs]
        runs, published, duplicates = count_runs(settings, minute)
    finally:
        for p in procs:
            p.stop()
    logs = [p.log() for p in procs]
    target = minute.isoformat()
    lags = [float(m[2]) for log in logs for m in _LAG.finditer(log) if m[1] == target]
    created = [sum(int(m[1]) for m in _PASS.finditer(log)) for log in logs]
    conflicts = [sum(int(m[2]) for m in _PASS.finditer(log)) for log in logs]
    records = [
        r
        for r in read_topic(settings, settings.names.topic(RUNS), timeout=60)
        if json.loads(r.value()).get("scheduled_for") == target
    ]
    per_run: dict[str, int] = {}
    for r in records:
        run_id = json.loads(r.value())["run_id"]
        per_run[run_id] = per_run.get(run_id, 0) + 1
    last_ts = max((r.timestamp()[1] for r in records), default=0) / 1000
    table = Table(
        f"{count:,} schedules due at {minute:%H:%M} UTC, two `koda scheduler` processes"
        f" (KODA_SCHEDULER_BATCH={batch})",
        ["measure", "value"],
    )
    table.add("runs created for the minute", f"{runs:,} of {count:,} (published {published:,})")
    table.add("duplicate runs (schedule, minute)", str(duplicates))
    table.add("extra records on the runs topic", str(sum(per_run.values()) - len(per_run)))
    table.add("fire lag p50 (s)", f"{percentile(lags, 0.5):.2f}")
    table.add("fire lag p99 (s)", f"{percentile(lags, 0.99):.2f}")
    table.add("fire lag max (s)", f"{max(lags, default=float('nan')):.2f}")
    table.add("last record's broker timestamp - M (s)", f"{last_ts - minute.timestamp():.2f}")
    for name, log in zip(("a", "b"), logs, strict=True):
        batches = [
            m
            for m in _BATCH.finditer(log)
            if datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f").replace(tzinfo=UTC) >= minute
        ]
        if batches:
            first = datetime.strptime(batches[0][1], "%Y-%m-%d %H:%M:%S,%f").replace(tzinfo=UTC)
            plan_s, insert_s, advance_s = (
                sum(int(m[i]) for m in batches) / 1000 for i in (2, 3, 4)
            )
            table.add(
                f"scheduler {name}: batches / first ends at M+ / plan, insert, advance s",
                f"{len(batches)} / {(first - minute).total_seconds():.2f} s / "
                f"{plan_s:.2f}, {insert_s:.2f}, {advance_s:.2f}",
            )
    for name, before, after, made, lost in zip(
        ("a", "b"), cpu_before, cpu_after, created, conflicts, strict=True
    ):
        table.add(
            f"scheduler {name}: CPU s / created / found created",
            f"{after - before:.1f} / {made:,} / {lost:,}",
        )
    ok = published == count and duplicates == 0 and lags and max(lags) <= GOAL_S
    table.notes.append(
        f"goal: every run published within {GOAL_S:.0f} s of the minute: "
        + ("met" if ok else "NOT met")
    )
    table.notes.append(
        "lag = broker ack of the run's record - the scheduled minute; CPU over the minute's "
        "pass (from 2 s before M until the last run was published); one user per schedule"
    )
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedules", type=int, default=10_000)
    parser.add_argument("--batch", type=int, default=Settings.scheduler_batch)
    args = parser.parse_args()
    with services() as stack, namespace(stack, partitions=32) as settings:
        print(measure(settings, args.schedules, args.batch).render())
        print(f"load average (1, 5, 15 min) at the end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
