"""The retention sweep's cost: W1 beside it, and deleting rows against dropping them.

Default: for each repetition, one namespace with N workers; two phases in ABBA order,
each on a table pre-filled with the same backlog of expired runs (ended 10 days ago,
compacted): ``idle`` (no sweep) and ``sweeping`` (passes back to back in a thread of
this process, ``KODA_RETENTION_BATCH`` rows a statement, while W1 runs). W1: demo runs
of 16 stamped chunks, no delay, straight into Postgres and the runs topic. Printed
side by side: runs/s, chunk latency (a chunk's yield to its group transaction, p50 and
p99, from the stamps) and the ratios sweeping / idle.

``--cost``: on ``--rows`` rows (runs of 200 rows), the time to delete them all in
statements of ``--batch`` rows (each its own transaction, as the sweep does) and to
VACUUM the table afterwards, against the time to drop them as one partition of a table
partitioned by run id; plus the insert time into each.

    python -m tests.bench.retention --runs 2000 --old-runs 2000 --repeat 3
    python -m tests.bench.retention --cost --rows 1000000
"""

from __future__ import annotations

import argparse
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import text

from koda_runtime.localstack import StackInfo
from koda_runtime.processors.retention import RetentionSweeper
from koda_runtime.schemas.db import sync_engine
from koda_runtime.settings import Settings
from tests.bench.common import Loader, demo_input, fmt, namespace, percentile, services
from tests.fixtures.processes import WorkerProcess

TOKENS = 16
STAMP = r"^[0-9]{10}\.[0-9]{6} "


def prefill(settings: Settings, runs: int, rows: int) -> None:
    """``runs`` ended, compacted runs of ``rows`` chunks and a done event, ended 10 days ago."""
    engine = sync_engine(settings)
    ids = [str(uuid.uuid4()) for _ in range(runs)]
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO sessions (id, user_id) VALUES ('s-old', 'old') ON CONFLICT DO NOTHING"
            )
        )
        for lo in range(0, runs, 500):
            part = ids[lo : lo + 500]
            conn.execute(
                text(
                    "INSERT INTO runs (id, session_id, user_id, idempotency_key, input, status,"
                    " attempt, created_at, started_at, finished_at, compacted_at)"
                    " SELECT i, 's-old', 'old', 'old:' || i, '{}', 'done', 1,"
                    " now() - interval '10 days', now() - interval '10 days',"
                    " now() - interval '10 days', now() - interval '9 days'"
                    " FROM unnest(CAST(:ids AS text[])) AS i"
                ),
                {"ids": part},
            )
            conn.execute(
                text(
                    "INSERT INTO messages (run_id, seq, kind, content, attempt)"
                    " SELECT i, g, CASE WHEN g = :n THEN 'done' ELSE 'chunk' END,"
                    " CASE WHEN g = :n THEN '' ELSE 'token ' END, 1"
                    " FROM unnest(CAST(:ids AS text[])) AS i, generate_series(0, :n) AS g"
                ),
                {"ids": part, "n": rows},
            )
    engine.dispose()


def w1(loader: Loader, runs: int, users: int, alive: Any) -> dict[str, float]:
    loaded = loader.insert(runs, users, lambda i: demo_input(i, TOKENS, stamp=True), prefix="u")
    t0 = time.time()
    loader.publish(loaded)
    loader.wait_terminal(loaded.run_ids, max(600.0, runs / 5), "w1", alive)
    out = loader.outcome(loaded.run_ids, t0)
    lat = loader.query(
        "SELECT percentile_cont(ARRAY[0.5, 0.99]) WITHIN GROUP (ORDER BY d) AS p FROM ("
        " SELECT extract(epoch FROM created_at) - split_part(content, ' ', 1)::float8 AS d"
        "   FROM messages WHERE run_id = ANY(:ids) AND kind = 'chunk' AND content ~ :stamp) c",
        ids=loaded.run_ids,
        stamp=STAMP,
    )[0].p
    out["chunk_p50_ms"], out["chunk_p99_ms"] = lat[0] * 1000, lat[1] * 1000
    return out


@contextmanager
def sweeping(settings: Settings, on: bool) -> Iterator[dict[str, int]]:
    """Passes back to back in a thread while the block runs (nothing when not ``on``)."""
    done: dict[str, int] = {"rows": 0, "passes": 0}
    if not on:
        yield done
        return
    stop = threading.Event()
    sweeper = RetentionSweeper(settings.with_(chunk_retention_s=7 * 86400.0))

    def loop() -> None:
        while not stop.is_set():
            report = sweeper.sweep_once()
            done["rows"] += report.deleted["messages"]
            done["passes"] += 1
            if not report.collapsed and not report.deleted["messages"]:
                stop.wait(0.2)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield done
    finally:
        stop.set()
        thread.join(120)
        sweeper.close()


def run_beside(stack: StackInfo, args: argparse.Namespace) -> None:
    results: dict[str, list[dict[str, float]]] = {"idle": [], "sweeping": []}
    for rep in range(args.repeat):
        order = ["idle", "sweeping"] if rep % 2 == 0 else ["sweeping", "idle"]
        with namespace(stack, partitions=8, chunk_batch_ms=20) as settings:
            workers = [WorkerProcess(settings, f"w{i}").start() for i in range(args.workers)]
            loader = Loader(settings)

            def alive(workers: list[WorkerProcess] = workers) -> None:
                for w in workers:
                    w.check()

            try:
                warm = loader.insert(8, 8, lambda i: demo_input(i, 1), prefix="warm")
                loader.publish(warm)
                loader.wait_terminal(warm.run_ids, 120, "warm-up", alive)
                for phase in order:
                    prefill(settings, args.old_runs, args.old_chunks)
                    with sweeping(settings, phase == "sweeping") as swept:
                        res = w1(loader, args.runs, args.users, alive)
                    res["swept_rows"] = swept["rows"]
                    results[phase].append(res)
                    print(
                        f"  rep {rep + 1}/{args.repeat} {phase:8}: {res['runs_s']:.0f} runs/s, "
                        f"chunk p50 {res['chunk_p50_ms']:.1f} ms p99 {res['chunk_p99_ms']:.1f} "
                        f"ms, rows swept meanwhile {swept['rows']}",
                        flush=True,
                    )
            finally:
                for w in workers:
                    w.stop()
                loader.close()
    idle, busy = results["idle"], results["sweeping"]
    print(
        f"\nRetention beside W1 ({args.runs} runs x {TOKENS} chunks, {args.workers} workers;"
        f" backlog {args.old_runs} runs x {args.old_chunks} rows; median [min, max])"
    )
    print(f"{'':16}{'idle':>24}{'sweeping':>24}{'sweeping/idle':>24}")
    for key, label in (
        ("runs_s", "runs/s"),
        ("chunk_p50_ms", "chunk p50 ms"),
        ("chunk_p99_ms", "chunk p99 ms"),
    ):
        ratios = [b[key] / a[key] for a, b in zip(idle, busy, strict=True) if a[key]]
        print(
            f"{label:16}{fmt([r[key] for r in idle], 1):>24}"
            f"{fmt([r[key] for r in busy], 1):>24}{fmt(ratios, 2):>24}"
        )
    print(f"{'rows swept':16}{'':>24}{fmt([r['swept_rows'] for r in busy]):>24}")


def run_cost(stack: StackInfo, args: argparse.Namespace) -> None:
    runs = max(1, args.rows // 200)
    with namespace(stack, partitions=1) as settings:
        engine = sync_engine(settings)
        cols = "(run_id text NOT NULL, seq int NOT NULL, kind text NOT NULL,"
        cols += " content text NOT NULL, attempt int NOT NULL,"
        cols += " created_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (run_id, seq))"
        fill = (
            "INSERT INTO {t} (run_id, seq, kind, content, attempt)"
            " SELECT 'run-' || lpad(r::text, 8, '0'), g, 'chunk', 'token number ' || g, 1"
            " FROM generate_series(1, :runs) r, generate_series(0, 199) g"
        )
        figures: dict[str, float] = {}
        with engine.begin() as conn:
            conn.execute(text(f"CREATE TABLE cost_plain {cols}"))
            conn.execute(text(f"CREATE TABLE cost_parted {cols} PARTITION BY RANGE (run_id)"))
            conn.execute(
                text(
                    "CREATE TABLE cost_day PARTITION OF cost_parted"
                    " FOR VALUES FROM ('run-') TO ('run.')"
                )
            )
        for table in ("cost_plain", "cost_parted"):
            t = time.perf_counter()
            with engine.begin() as conn:
                conn.execute(text(fill.format(t=table)), {"runs": runs})
            figures[f"insert {table}"] = time.perf_counter() - t
        with engine.connect() as conn:
            size = conn.execute(text("SELECT pg_total_relation_size('cost_plain')")).scalar_one()
        ids = [f"run-{r:08d}" for r in range(1, runs + 1)]
        per_stmt: list[float] = []
        t = time.perf_counter()
        for lo in range(0, runs, 100):
            group = ids[lo : lo + 100]
            while True:
                s = time.perf_counter()
                with engine.begin() as conn:
                    n = conn.execute(
                        text(
                            "DELETE FROM cost_plain WHERE ctid = ANY(ARRAY("
                            " SELECT ctid FROM cost_plain WHERE run_id = ANY(:ids)"
                            " LIMIT :b FOR UPDATE SKIP LOCKED))"
                        ),
                        {"ids": group, "b": args.batch},
                    ).rowcount
                per_stmt.append(time.perf_counter() - s)
                if n < args.batch:
                    break
        figures["batched delete"] = time.perf_counter() - t
        t = time.perf_counter()
        with engine.connect() as conn:
            conn.execution_options(isolation_level="AUTOCOMMIT").execute(text("VACUUM cost_plain"))
        figures["vacuum after"] = time.perf_counter() - t
        t = time.perf_counter()
        with engine.begin() as conn:
            conn.execute(text("ALTER TABLE cost_parted DETACH PARTITION cost_day"))
            conn.execute(text("DROP TABLE cost_day"))
        figures["detach + drop"] = time.perf_counter() - t
        engine.dispose()
    print(f"\nDropping {runs * 200:,} message rows ({size / 2**20:.0f} MiB with its index)")
    for name, seconds in figures.items():
        print(f"  {name:24} {seconds:9.3f} s")
    print(
        f"  {'per delete statement':24} p50 {percentile(per_stmt, 0.5) * 1000:.1f} ms,"
        f" p99 {percentile(per_stmt, 0.99) * 1000:.1f} ms, {len(per_stmt)} statements"
        f" of {args.batch} rows"
    )


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m tests.bench.retention")
    ap.add_argument("--cost", action="store_true", help="deleting rows against a partition drop")
    ap.add_argument("--rows", type=int, default=1_000_000, help="--cost: rows to drop")
    ap.add_argument("--batch", type=int, default=1000, help="--cost: rows per delete statement")
    ap.add_argument("--runs", type=int, default=2000, help="W1 runs per phase")
    ap.add_argument("--users", type=int, default=200)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--old-runs", type=int, default=2000, help="expired runs pre-filled per phase")
    ap.add_argument("--old-chunks", type=int, default=200, help="rows of each expired run")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    with services() as stack:
        if args.cost:
            run_cost(stack, args)
        else:
            run_beside(stack, args)


if __name__ == "__main__":
    main()
