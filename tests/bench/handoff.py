"""Handoff benchmark: planned (SIGTERM) versus crash (kill -9).

For each of a worker's partitions a 3-second run is in flight and a short run
waits behind it. The worker is stopped; we measure how long the successor takes
to start the waiting runs. Prints median, min and max over the repetitions.

    make bench-handoff            # 3 repetitions each
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import tempfile
import time
from pathlib import Path

from koda_runtime.localstack import StackInfo, down, up
from koda_runtime.schemas.migrate import upgrade
from koda_runtime.topics.admin import apply_topics
from koda_runtime.topics.catalogue import partition_for_key
from tests.fixtures.namespaces import delete_topics, drop_schema, make_settings
from tests.fixtures.processes import WorkerProcess
from tests.fixtures.runs import Submitter
from tests.support import wait_until


def owners(sub: Submitter) -> dict[int, str]:
    return {
        r.partition: r.worker_id
        for r in sub.query("SELECT partition, worker_id FROM partition_epochs")
    }


def one_round(
    settings, sub: Submitter, victim: WorkerProcess, how: str, tag: str
) -> tuple[float, float]:
    held = sorted(p for p, w in owners(sub).items() if w == victim.worker_id)
    users = {}
    for i in range(10_000):
        u = f"{tag}-{i}"
        p = partition_for_key(u.encode(), settings.partitions)
        if p in held and p not in users:
            users[p] = u
        if len(users) == len(held):
            break
    long_ids = [
        sub.submit(u, {"text": "long", "demo": {"tokens": 15, "delay_ms": 200}})
        for u in users.values()
    ]
    wait_until(lambda: all(s == "streaming" for s in sub.statuses(long_ids).values()), timeout=60)
    next_ids = [
        sub.submit(u, {"text": "next", "demo": {"tokens": 1, "delay_ms": 1}})
        for u in users.values()
    ]
    t0 = time.time()
    if how == "sigterm":
        victim.signal(signal.SIGTERM)
    else:
        victim.signal(signal.SIGKILL)
    assert victim.proc is not None
    victim.proc.wait(60)
    t_exit = time.time()
    wait_until(lambda: sub.all_terminal(next_ids), timeout=120)
    started = sub.query(
        "SELECT max(extract(epoch FROM started_at)) AS latest FROM runs WHERE id = ANY(:i)",
        i=next_ids,
    )[0].latest
    return t_exit - t0, float(started) - t_exit


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    state: Path | None = None
    if os.environ.get("KODA_KAFKA_BOOTSTRAP") and os.environ.get("KODA_DATABASE_URL"):
        info = StackInfo(os.environ["KODA_KAFKA_BOOTSTRAP"], os.environ["KODA_DATABASE_URL"], 1)
    else:
        state = Path(tempfile.mkdtemp(prefix="koda-bench-", dir="/tmp"))
        info = up(state)
    settings = make_settings(info)
    upgrade(settings)
    apply_topics(settings)
    sub = Submitter(settings)
    results: dict[str, list[tuple[float, float]]] = {"sigterm": [], "kill -9": []}
    survivor = WorkerProcess(settings, "survivor").start()
    try:
        n = 0
        for how in ["sigterm", "kill -9"] * args.repeat:
            n += 1
            victim = WorkerProcess(settings, f"victim-{n}").start()
            expected = {"survivor", victim.worker_id}

            def owned_by(e: set[str | None] = expected) -> bool:
                return set(owners(sub).values()) == e

            wait_until(owned_by, timeout=90)
            results[how].append(
                one_round(settings, sub, victim, "sigterm" if how == "sigterm" else "kill", f"r{n}")
            )
        print(
            f"handoff: session timeout {settings.session_timeout_s:.0f} s, heartbeat "
            f"{settings.heartbeat_interval_s:.0f} s, ceiling {settings.handoff_ceiling_s:.0f} s, "
            f"3 s runs in flight, cores={os.cpu_count()}"
        )
        print(f"{'stop':10} {'drain (stop->exit) s':>28} {'successor starts after exit s':>34}")
        for how, rows in results.items():
            drains = [r[0] for r in rows]
            starts = [r[1] for r in rows]
            print(
                f"{how:10} {statistics.median(drains):10.2f} "
                f"[{min(drains):.2f}-{max(drains):.2f}]      "
                f"{statistics.median(starts):14.2f} [{min(starts):.2f}-{max(starts):.2f}]"
            )
    finally:
        survivor.stop()
        sub.close()
        delete_topics(settings)
        drop_schema(settings)
        if state is not None:
            down(state)
            shutil.rmtree(state, ignore_errors=True)


if __name__ == "__main__":
    main()
