"""Pipeline benchmark: N runs x M chunks through the gateway to two workers.

Prints runs/s, chunks/s and submit-to-done p50/p99 (created_at -> finished_at in
Postgres). Not a test: it asserts nothing about speed.

    make bench-pipeline            # 1000 runs x 20 chunks, 2 workers, 100 users
    python -m tests.bench.pipeline --runs 200 --chunks 20 --workers 2
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from koda_runtime.localstack import StackInfo, down, up
from koda_runtime.schemas.migrate import upgrade
from koda_runtime.topics.admin import apply_topics
from tests.fixtures.namespaces import delete_topics, drop_schema, make_settings
from tests.fixtures.processes import GatewayProcess, WorkerProcess
from tests.fixtures.runs import Submitter
from tests.support import wait_until


async def submit_all(url: str, runs: int, chunks: int, users: int, concurrency: int) -> list[str]:
    sem = asyncio.Semaphore(concurrency)
    ids: list[str] = []
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:

        async def one(i: int) -> None:
            user = f"bench-{i % users}"
            body = {
                "input": {
                    "text": f"run {i}",
                    "demo": {"tokens": chunks, "delay_ms": 0, "token_bytes": 8},
                }
            }
            async with sem:
                r = await client.post(
                    "/v1/runs", json=body, headers={"Authorization": f"Bearer dev:{user}"}
                )
            r.raise_for_status()
            ids.append(r.json()["run_id"])

        await asyncio.gather(*(one(i) for i in range(runs)))
    return ids


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=1000)
    ap.add_argument("--chunks", type=int, default=20)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--users", type=int, default=100)
    ap.add_argument("--concurrency", type=int, default=32)
    args = ap.parse_args()

    state: Path | None = None
    if os.environ.get("KODA_KAFKA_BOOTSTRAP") and os.environ.get("KODA_DATABASE_URL"):
        info = StackInfo(os.environ["KODA_KAFKA_BOOTSTRAP"], os.environ["KODA_DATABASE_URL"], 1)
    else:
        state = Path(tempfile.mkdtemp(prefix="koda-bench-", dir="/tmp"))
        info = up(state)
    settings = make_settings(info, chunk_batch_ms=10)
    upgrade(settings)
    apply_topics(settings)
    sub = Submitter(settings)
    gw = GatewayProcess(
        settings,
        {
            "KODA_RATE_PER_S": "100000",
            "KODA_RATE_BURST": "100000",
            "KODA_MAX_ACTIVE_RUNS_PER_USER": "1000000",
        },
    )
    workers = [WorkerProcess(settings, f"bench-w{i}") for i in range(args.workers)]
    try:
        gw.start()
        for w in workers:
            w.start()
        # Warm up: the group must have assigned every partition before timing starts.
        warm = asyncio.run(submit_all(gw.url, 16, 1, 16, 16))
        wait_until(lambda: sub.all_terminal(warm), timeout=120, what="warm-up runs")
        t0 = time.monotonic()
        ids = asyncio.run(submit_all(gw.url, args.runs, args.chunks, args.users, args.concurrency))
        t_submitted = time.monotonic()
        wait_until(lambda: sub.all_terminal(ids), timeout=1800, interval=0.25, what="bench runs")
        t_done = time.monotonic()
        rows = sub.query(
            "SELECT status, extract(epoch FROM finished_at - created_at) AS latency"
            " FROM runs WHERE id = ANY(:ids)",
            ids=ids,
        )
        latencies = [float(r.latency) for r in rows]
        done = sum(1 for r in rows if r.status == "done")
        chunk_rows = sub.query(
            "SELECT count(*) AS n FROM messages WHERE run_id = ANY(:ids) AND kind = 'chunk'",
            ids=ids,
        )[0].n
        wall = t_done - t0
        print(
            f"pipeline: {args.runs} runs x {args.chunks} chunks, {args.workers} workers, "
            f"{args.users} users, cores={os.cpu_count()}"
        )
        submit_s = t_submitted - t0
        print(f"  submit phase         {submit_s:8.2f} s ({args.runs / submit_s:.0f} POST/s)")
        print(f"  wall (first POST -> last done) {wall:8.2f} s")
        print(f"  runs/s               {args.runs / wall:8.1f}")
        print(f"  chunks/s             {chunk_rows / wall:8.1f}")
        print(f"  submit-to-done p50   {statistics.median(latencies) * 1000:8.0f} ms")
        print(f"  submit-to-done p99   {percentile(latencies, 0.99) * 1000:8.0f} ms")
        print(f"  done                 {done}/{args.runs}")
    finally:
        for w in workers:
            w.stop()
        gw.stop()
        sub.close()
        delete_topics(settings)
        drop_schema(settings)
        if state is not None:
            down(state)
            shutil.rmtree(state, ignore_errors=True)


if __name__ == "__main__":
    main()
