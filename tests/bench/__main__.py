"""``make bench``: W1 throughput, W2 latency, W3 gateway, replay and W4 assistant load,
then the goals.

Every figure is the median of ``--repeat`` (at least 3) repetitions with min and
max; every ratio pairs figures measured in the same repetition, on the same
broker and database. One private Kafka and Postgres are started for the whole
run (or the exported ``KODA_KAFKA_BOOTSTRAP``/``KODA_DATABASE_URL`` are used).

    python -m tests.bench                          # the reported configuration
    python -m tests.bench --quick                  # a few minutes: small counts
    python -m tests.bench --only w1 --runs 20000   # one workload, full size
    python -m tests.bench --only w2 --w2-pin       # W2 with the load generator pinned
    python -m tests.bench --only w4 --quick        # W4 (koda vs a direct FastAPI app), small
    python -m tests.bench --only tracing --quick   # tracing's cost on W1 and W2, off vs on

The last table, Goals (tests/bench/goals.py), is every goal of this round with its
measured figure and met / not met. Replay runs here too (tests/bench/replay.py,
``--replay-records``, 200,000 by default) so that its ratio sits beside the others;
``make bench-replay`` is the same measurement on its own.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from collections.abc import Callable

from koda_runtime.localstack import StackInfo
from koda_runtime.topics.replay.engine import BATCH_RECORDS
from tests.bench import replay, tracing_cost, w1_throughput, w2_latency, w3_gateway, w4_assistant
from tests.bench.common import Table, services
from tests.bench.goals import goals_table


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m tests.bench")
    every = ["w1", "w2", "w3", "replay", "w4", "tracing"]
    ap.add_argument("--only", nargs="+", choices=every, default=every)
    ap.add_argument(
        "--quick",
        action="store_true",
        help="small counts for a check that the benches run (not for reporting)",
    )
    w1_throughput.add_args(ap)
    # W2 and W3 take the same --repeat; their own counts:
    w2_latency.add_args(ap, prefix="w2-")
    ap.add_argument("--w3-levels", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--w3-requests", type=int, default=1000)
    ap.add_argument("--replay-records", type=int, default=200_000)
    w4_assistant.add_args(ap, prefix="w4-")
    tracing_cost.add_args(ap, prefix="tracing-")
    args = ap.parse_args()
    if args.repeat < 3 and not args.quick:
        ap.error("--repeat must be at least 3 (use --quick for a smoke run)")
    if args.quick:
        args.runs, args.repeat, args.workers = 600, 1, [2]
        args.w3_requests, args.w3_levels, args.replay_records = 300, [1, 32], 20_000
        args.w2_warm_s, args.w2_hold_s, args.w2_bisections, args.w2_burst_runs = 2, 5, 1, 40
        args.w4_warm_s, args.w4_hold_s, args.w4_bisections, args.w4_start = 6, 8, 0, 2.0
        args.w4_cap = min(args.w4_cap, 32.0)
    return args


def tracing_args(args: argparse.Namespace) -> argparse.Namespace:
    """The tracing bench's own arguments (``--tracing-...``), its small counts with --quick."""
    own = argparse.Namespace(
        **{k[8:]: v for k, v in vars(args).items() if k.startswith("tracing_")},
        repeat=args.repeat,
    )
    if args.quick:
        tracing_cost.quick(own)
    return own


def main() -> None:
    args = parse()
    w2 = argparse.Namespace(
        **{k[3:]: v for k, v in vars(args).items() if k.startswith("w2_")},
        workers=2,
        repeat=args.repeat,
    )
    w3 = argparse.Namespace(levels=args.w3_levels, requests=args.w3_requests, repeat=args.repeat)
    w4 = argparse.Namespace(
        **{k[3:]: v for k, v in vars(args).items() if k.startswith("w4_")}, repeat=args.repeat
    )
    tables = []
    started = time.monotonic()
    load0 = os.getloadavg()
    workloads: dict[str, Callable[[StackInfo], Table]] = {
        "w1": lambda stack: w1_throughput.run_w1(stack, args),
        "w2": lambda stack: w2_latency.run_w2(stack, w2),
        "w3": lambda stack: w3_gateway.run_w3(stack, w3),
        "replay": lambda stack: replay.measure(
            stack, args.replay_records, args.repeat, BATCH_RECORDS
        )[0],
        "w4": lambda stack: w4_assistant.run_w4(stack, w4),
        "tracing": lambda stack: tracing_cost.run_tracing(stack, tracing_args(args)),
    }
    failed: list[str] = []
    with services() as stack:
        for name, workload in workloads.items():
            if name not in args.only:
                continue
            try:
                tables.append(workload(stack))
            except Exception:  # noqa: BLE001 - printed; the other workloads still report
                traceback.print_exc()
                failed.append(name)
                print(f"\n{name} FAILED (traceback above); its goals are not measured", flush=True)
    print(
        f"\nkoda bench: cores={os.cpu_count()}, python {sys.version.split()[0]}, "
        f"{(time.monotonic() - started) / 60:.1f} min, load average (1/5/15 min) at start "
        f"{'/'.join(f'{x:.1f}' for x in load0)}, at end "
        f"{'/'.join(f'{x:.1f}' for x in os.getloadavg())}"
        + (" (QUICK: not for reporting)" if args.quick else "")
    )
    for table in tables:
        print()
        print(table.render())
    print()
    print(goals_table(tables, args.runs if "w1" in args.only else None, args.quick).render())
    if failed:
        print(f"\nworkloads that failed: {', '.join(failed)}")
        sys.exit(1)


if __name__ == "__main__":
    main()
