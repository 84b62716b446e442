"""``make bench``: W1 throughput, W2 latency and W3 gateway, printed as tables.

Every figure is the median of ``--repeat`` (at least 3) repetitions with min and
max; every ratio pairs figures measured in the same repetition, on the same
broker and database. One private Kafka and Postgres are started for the whole
run (or the exported ``KODA_KAFKA_BOOTSTRAP``/``KODA_DATABASE_URL`` are used).

    python -m tests.bench                          # the reported configuration
    python -m tests.bench --quick                  # a few minutes: small counts
    python -m tests.bench --only w1 --runs 20000   # one workload, full size
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from tests.bench import w1_throughput, w2_latency, w3_gateway
from tests.bench.common import services


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m tests.bench")
    ap.add_argument("--only", nargs="+", choices=["w1", "w2", "w3"], default=["w1", "w2", "w3"])
    ap.add_argument(
        "--quick",
        action="store_true",
        help="small counts for a check that the benches run (not for reporting)",
    )
    w1_throughput.add_args(ap)
    # W2 and W3 take the same --repeat; their own counts:
    ap.add_argument("--w2-runs", type=int, default=200)
    ap.add_argument("--w2-chunks", type=int, default=100)
    ap.add_argument("--w3-levels", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--w3-requests", type=int, default=1000)
    args = ap.parse_args()
    if args.repeat < 3 and not args.quick:
        ap.error("--repeat must be at least 3 (use --quick for a smoke run)")
    if args.quick:
        args.runs, args.repeat, args.workers = 600, 1, [2]
        args.w2_runs, args.w2_chunks, args.w3_requests, args.w3_levels = 40, 50, 300, [1, 32]
    return args


def main() -> None:
    args = parse()
    w2 = argparse.Namespace(
        runs=args.w2_runs,
        chunks=args.w2_chunks,
        spacing_ms=20,
        viewers=2,
        workers=2,
        max_inflight=110,
        repeat=args.repeat,
    )
    w3 = argparse.Namespace(levels=args.w3_levels, requests=args.w3_requests, repeat=args.repeat)
    tables = []
    started = time.monotonic()
    load0 = os.getloadavg()
    with services() as stack:
        if "w1" in args.only:
            tables.append(w1_throughput.run_w1(stack, args))
        if "w2" in args.only:
            tables.append(w2_latency.run_w2(stack, w2))
        if "w3" in args.only:
            tables.append(w3_gateway.run_w3(stack, w3))
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


if __name__ == "__main__":
    main()
