"""The worker's event loop: koda's worker alone (W1's "koda worker") on uvloop and on
asyncio's own loop, trials alternating on one stack, CPU per run and runs/s side by side.

    python -m tests.bench.event_loop                      # 3,000 runs, 3 trials of each
    python -m tests.bench.event_loop --runs 20000 --repeat 5

Each trial is a fresh namespace with 2 worker processes (``--workers``) and
``KODA_EVENT_LOOP`` set for them; the ratios pair the trials of one repetition, and
every other repetition runs asyncio first (ABBA).
"""

from __future__ import annotations

import argparse
import os

from tests.bench.common import Table, fmt, services
from tests.bench.w1_throughput import Trial

LOOPS = ("asyncio", "uvloop")


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m tests.bench.event_loop")
    ap.add_argument("--runs", type=int, default=3000)
    ap.add_argument("--users", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--max-inflight", type=int, default=8)
    args = ap.parse_args()
    res: dict[str, list[dict[str, float]]] = {loop: [] for loop in LOOPS}
    with services() as stack:
        for rep in range(args.repeat):
            for loop in LOOPS if rep % 2 == 0 else LOOPS[::-1]:
                r = Trial(
                    stack,
                    "koda worker",
                    args.workers,
                    max_inflight=args.max_inflight,
                    worker_env={"KODA_EVENT_LOOP": loop},
                ).measure(args.runs, args.users, max(600.0, args.runs / 5))
                res[loop].append(r)
                print(
                    f"  rep {rep + 1}/{args.repeat} {loop:8} {r['runs_s']:.0f} runs/s "
                    f"cpu {r['cpu_ms']:.2f} ms/run load {r['load1']:.1f}",
                    flush=True,
                )
    table = Table(
        f"koda worker by event loop: {args.runs} runs, {args.workers} processes, "
        f"{args.repeat} repetitions, cores={os.cpu_count()} (median [min-max])",
        ["loop", "runs/s", "CPU ms/run", "load avg"],
    )
    for loop in LOOPS:
        rs = res[loop]
        table.add(
            loop,
            fmt([r["runs_s"] for r in rs]),
            fmt([r["cpu_ms"] for r in rs], 2),
            fmt([r["load1"] for r in rs], 1),
        )
    pairs = list(zip(res["uvloop"], res["asyncio"], strict=True))
    table.notes.append(
        "uvloop / asyncio, per repetition: runs/s "
        + fmt([u["runs_s"] / a["runs_s"] for u, a in pairs], 2)
        + ", CPU per run "
        + fmt([u["cpu_ms"] / a["cpu_ms"] for u, a in pairs], 2)
    )
    print(table.render())


if __name__ == "__main__":
    main()
