"""Worker memory over many runs: RSS sampled against runs finished, and its slope.

W1's demo runs (16 chunks, no delay) go straight to the runs topic in batches,
keeping a bounded backlog, through ``--workers`` workers. Every two seconds the
bench samples each worker's RSS (``/proc/<pid>/status``) and the number of runs
finished. The slope is a least-squares fit of RSS against runs finished over
the samples after the first ``--skip`` of the runs (start-up, pools, caches).

    make bench-memory                              # 100,000 runs
    python -m tests.bench.memory --runs 20000      # a shorter look
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from koda_runtime.localstack import StackInfo
from tests.bench.common import Loader, Table, demo_input, namespace, services, wait_group
from tests.fixtures.processes import WorkerProcess

PARTITIONS = 32
BATCH = 5000


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0


def run_memory(stack: StackInfo, args: argparse.Namespace) -> Table:
    with namespace(stack, partitions=PARTITIONS, chunk_batch_ms=20) as settings:
        loader = Loader(settings)
        workers = [WorkerProcess(settings, f"m{i}").start() for i in range(args.workers)]
        samples: list[tuple[int, list[int]]] = []
        try:
            wait_group(settings, settings.names.group(settings.worker_group), args.workers)
            published: list[str] = []
            done = 0
            next_sample = 0.0
            t0 = time.monotonic()
            while done < args.runs:
                if len(published) < args.runs and len(published) - done < BATCH:
                    n = min(BATCH, args.runs - len(published))
                    offset = len(published)

                    def run_input(i: int, o: int = offset) -> dict[str, Any]:
                        return demo_input(o + i, 16)

                    batch = loader.insert(n, args.users, run_input, "mem")
                    loader.publish(batch)
                    published += batch.run_ids
                for w in workers:
                    if not w.alive():
                        raise AssertionError(f"worker {w.worker_id} exited:\n{w.log()[-3000:]}")
                if time.monotonic() >= next_sample:
                    done = int(
                        loader.query("SELECT count(*) AS n FROM runs WHERE status = 'done'")[0].n
                    )
                    samples.append((done, [rss_kib(w.pid) for w in workers]))
                    next_sample = time.monotonic() + 2.0
                    if len(samples) % 15 == 0:
                        print(
                            f"  memory: {done}/{args.runs} runs, RSS "
                            f"{[r // 1024 for r in samples[-1][1]]} MiB",
                            flush=True,
                        )
                time.sleep(0.2)
            wall = time.monotonic() - t0
        finally:
            for w in workers:
                w.stop()
            loader.close()
    table = Table(
        f"Worker memory: {args.runs} runs x 16 chunks, {args.workers} workers, RSS sampled "
        f"every 2 s ({len(samples)} samples, {wall:.0f} s)",
        [
            "worker",
            "RSS first MiB",
            "RSS at skip MiB",
            "RSS last MiB",
            "max MiB",
            "slope KiB/1000 runs",
        ],
    )
    cut = args.runs * args.skip
    steady = [(d, r) for d, r in samples if d >= cut]
    for i, w in enumerate(workers):
        xs = [float(d) for d, _ in steady]
        ys = [float(r[i]) for _, r in steady]
        table.add(
            w.name,
            f"{samples[0][1][i] / 1024:.0f}",
            f"{ys[0] / 1024:.0f}",
            f"{ys[-1] / 1024:.0f}",
            f"{max(r[i] for _, r in samples) / 1024:.0f}",
            f"{slope(xs, ys) * 1000:.1f}",
        )
    table.notes.append(
        f"slope: least squares over the samples after {args.skip:.0%} of the "
        "runs; each worker finishes about 1/workers of the runs"
    )
    if args.runs < 100_000:
        table.notes.append(f"scaled down: {args.runs} runs instead of 100,000")
    return table


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--runs", type=int, default=100_000)
    ap.add_argument("--users", type=int, default=2000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--skip", type=float, default=0.1)


def main() -> None:
    ap = argparse.ArgumentParser()
    add_args(ap)
    args = ap.parse_args()
    with services() as stack:
        print(run_memory(stack, args).render())


if __name__ == "__main__":
    main()
