"""Bounded-pool drill 1: the handler's downstream is out, then heals by itself.

    python -m tests.chaos.drills --outage 60       # part of `make chaos`

For ``outage_s`` seconds the demo handler's "downstream" is out (its ``outage_until``
switch, keyed on wall time): runs of half the users fail at every chunk, runs of the
other half are slow (each chunk waits a second more). One worker with
``KODA_MAX_INFLIGHT`` slots serves more partitions than it has slots. Its ``/metrics``
(``KODA_WORKER_PORT``) is scraped every 0.2 s throughout. The drill asserts:

* in flight never exceeds the limit, and reaches it (the bound is what holds the load);
* retries rise but stay within their bound: every run has at most ``KODA_MAX_ATTEMPTS``
  attempts, ``koda_retries_total`` equals the failed attempts recorded in Postgres, and
  a run that used them all is ``failed`` with exactly one ``handler_failed`` dead letter;
* queue age rises during the outage (runs wait behind the slow ones);
* once the downstream heals, with nobody doing anything, every run ends and new runs
  go through at once (small queue age, ``done``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from koda_runtime.localstack import StackInfo, down, up
from koda_runtime.schemas.migrate import upgrade
from koda_runtime.settings import Settings
from koda_runtime.topics.admin import apply_topics
from koda_runtime.topics.catalogue import RUNS_DLQ
from tests.fixtures.namespaces import delete_topics, drop_schema, make_settings
from tests.fixtures.processes import WorkerProcess, free_port
from tests.fixtures.runs import Submitter, read_topic
from tests.support import wait_until


def scrape(url: str) -> dict[str, float]:
    """The unlabelled koda samples of a Prometheus text page (histograms' _sum/_count)."""
    out: dict[str, float] = {}
    for line in httpx.get(url, timeout=2).text.splitlines():
        if line.startswith("koda_") and "{" not in line:
            name, _, value = line.partition(" ")
            out[name] = float(value)
    return out


@dataclass
class Scraper:
    """Scrapes a worker's /metrics in a thread; keeps the series the drill checks."""

    url: str
    samples: list[tuple[float, dict[str, float]]] = field(default_factory=list)
    failures: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(0.2):
            try:
                self.samples.append((time.time(), scrape(self.url)))
            except httpx.HTTPError:
                self.failures += 1

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def max_of(self, name: str, since: float = 0.0, until: float = float("inf")) -> float:
        return max((s.get(name, 0.0) for t, s in self.samples if since <= t <= until), default=0.0)


@dataclass
class DrillResult:
    max_in_flight: float
    limit: int
    retries: float
    failed_attempts: int
    runs: int
    failed: int
    max_attempt: int
    queue_age_during_s: float
    queue_age_after_s: float
    recovered_s: float
    problems: list[str]

    def table(self) -> str:
        rows = [
            ("runs during the outage", f"{self.runs} ({self.failed} failed after every attempt)"),
            ("max in flight / limit", f"{self.max_in_flight:.0f} / {self.limit}"),
            (
                "retries (metric) / failed attempts (Postgres)",
                f"{self.retries:.0f} / {self.failed_attempts}",
            ),
            ("highest attempt", str(self.max_attempt)),
            (
                "max queue age during / after the outage",
                f"{self.queue_age_during_s:.1f}s / {self.queue_age_after_s:.1f}s",
            ),
            ("every run ended, seconds after healing", f"{self.recovered_s:.1f}s"),
            ("problems", str(len(self.problems))),
        ]
        width = max(len(k) for k, _ in rows) + 2
        return "\n".join(f"{k:<{width}}{v}" for k, v in rows)


def downstream_outage(
    settings: Settings, outage_s: float, *, limit: int = 3, users: int = 12, runs_per_user: int = 3
) -> DrillResult:
    """Run the drill against ``settings``' namespace (migrated, topics applied)."""
    sub = Submitter(settings)
    port = free_port()
    worker = WorkerProcess(
        settings,
        "drill",
        {
            "KODA_MAX_INFLIGHT": str(limit),
            "KODA_WORKER_PORT": str(port),
            "KODA_MAX_ATTEMPTS": "3",
            "KODA_RETRY_BASE": "0.5",
        },
    ).start()
    scraper = Scraper(f"http://127.0.0.1:{port}/metrics")
    problems: list[str] = []
    try:
        wait_until(lambda: _up(scraper.url), timeout=60, what="worker /metrics")
        wait_until(
            lambda: "assigned partitions" in worker.log(), timeout=60, what="worker assigned"
        )
        scraper.start()
        t0 = time.time()
        healed_at = t0 + outage_s
        ids: list[str] = []
        slow: set[str] = set()
        for i in range(runs_per_user):
            for u in range(users):
                mode = "slow" if u % 2 == 0 else "fail"
                inp = {
                    "text": f"drill {u} {i}",
                    "demo": {
                        "tokens": 3,
                        "delay_ms": 10,
                        "outage_until": healed_at,
                        "outage": mode,
                        "outage_delay_ms": 1000,
                    },
                }
                ids.append(sub.submit(f"drill-user-{u}", inp))
                if mode == "slow":
                    slow.add(ids[-1])
        # Keep the load on through the outage: a run per user every few seconds.
        while time.time() < healed_at - 2:
            time.sleep(min(3.0, max(0.0, healed_at - 2 - time.time())))  # the load's pace
            for u in range(0, users, 3):
                inp = {
                    "text": f"drill late {u} {time.time()}",
                    "demo": {
                        "tokens": 2,
                        "delay_ms": 10,
                        "outage_until": healed_at,
                        "outage": "slow",
                        "outage_delay_ms": 1000,
                    },
                }
                ids.append(sub.submit(f"drill-user-{u}", inp))
                slow.add(ids[-1])
        wait_until(
            lambda: sub.all_terminal(ids),
            timeout=outage_s + 180,
            interval=0.5,
            what="every drill run terminal",
        )
        recovered_s = time.time() - healed_at
        after = [
            sub.submit(
                f"drill-user-{u}", {"text": f"healed {u}", "demo": {"tokens": 2, "delay_ms": 5}}
            )
            for u in range(users)
        ]
        wait_until(lambda: sub.all_terminal(after), timeout=60, what="runs after healing")
        scraped = len(scraper.samples)
        wait_until(
            lambda: len(scraper.samples) > scraped + 1,
            timeout=10,
            what="a scrape with the final counters",
        )
        scraper.stop()
        rows = sub.query(
            "SELECT id, status, attempt, EXTRACT(EPOCH FROM started_at - created_at) AS age"
            " FROM runs WHERE id = ANY(:ids)",
            ids=ids + after,
        )
        by_id = {r.id: r for r in rows}
        during = [by_id[i] for i in ids]
        failed = [r for r in during if r.status == "failed"]
        failed_attempts = sum(r.attempt if r.status == "failed" else r.attempt - 1 for r in during)
        letters = [
            json.loads(m.value()) for m in read_topic(settings, settings.names.topic(RUNS_DLQ))
        ]
        retries = scraper.max_of("koda_retries_total")
        max_in_flight = scraper.max_of("koda_runs_in_flight")
        if max_in_flight > limit:
            problems.append(f"in flight reached {max_in_flight}, above the limit {limit}")
        if max_in_flight < limit:
            problems.append(f"in flight never reached the limit ({max_in_flight} < {limit})")
        if any(r.attempt > 3 for r in during):
            problems.append("a run had more than KODA_MAX_ATTEMPTS attempts")
        if retries != failed_attempts:
            problems.append(f"koda_retries_total {retries} != failed attempts {failed_attempts}")
        if retries == 0 or not failed:
            problems.append("the outage caused no retries or no exhausted run")
        dead = [d for d in letters if d["reason"] == "handler_failed"]
        if len(dead) != len(failed) or any(d["attempts"] != 3 for d in letters):
            problems.append(f"{len(letters)} dead letters for {len(failed)} failed runs")
        if any(by_id[i].status != "done" for i in after):
            problems.append("a run after healing did not end done")
        if any(r.status not in ("done", "failed") for r in during):
            problems.append("a run did not end")
        if any(by_id[i].status != "done" for i in slow):
            problems.append("a slow (not failing) run did not end done")
        age_during = max(float(r.age) for r in during)
        age_after = max(float(by_id[i].age) for i in after)
        if age_during < 2.0:
            problems.append(f"queue age did not rise during the outage ({age_during:.1f}s)")
        if age_after > 5.0:
            problems.append(f"queue age after healing still {age_after:.1f}s")
        if not worker.alive():
            problems.append("the worker died")
        return DrillResult(
            max_in_flight,
            limit,
            retries,
            failed_attempts,
            len(during),
            len(failed),
            max(r.attempt for r in during),
            age_during,
            age_after,
            recovered_s,
            problems,
        )
    finally:
        scraper.stop()
        worker.stop()
        sub.close()


def _up(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tests.chaos.drills",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--outage", type=float, default=60.0, help="outage length, seconds")
    p.add_argument("--limit", type=int, default=3, help="KODA_MAX_INFLIGHT of the worker")
    a = p.parse_args(argv)
    state = Path(tempfile.mkdtemp(prefix="koda-drill-", dir="/tmp"))
    try:
        info: StackInfo = up(state)
        settings = make_settings(info)
        upgrade(settings)
        apply_topics(settings)
        result = downstream_outage(settings, a.outage, limit=a.limit)
        delete_topics(settings)
        drop_schema(settings)
    finally:
        try:
            down(state)
        finally:
            shutil.rmtree(state, ignore_errors=True)
    print(f"downstream outage drill: {a.outage:.0f}s outage, KODA_MAX_INFLIGHT={a.limit}")
    print(result.table())
    for line in result.problems:
        print(f"  - {line}")
    return 1 if result.problems else 0


if __name__ == "__main__":
    sys.exit(main())
