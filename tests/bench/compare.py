"""Before/after: W1's koda figures for two source trees, repetitions interleaved.

``--before DIR`` is another checkout of koda (e.g. ``git worktree add /tmp/before
<commit>``); its workers and gateway run from DIR with this virtualenv. Each
repetition measures before and after back to back on the same broker and
database, and the ratio pairs them.

    python -m tests.bench.compare --before /tmp/before --runs 2000 --repeat 3

``--bench replay`` compares ``koda replay`` into DuckDB instead (tests/bench/replay.py):

    python -m tests.bench.compare --bench replay --before /tmp/before --runs 200000
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

import tests.fixtures.processes
from tests.bench import replay
from tests.bench.common import Table, fmt, services
from tests.bench.w1_throughput import Trial


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", required=True, type=Path)
    ap.add_argument("--runs", type=int, default=2000, help="runs (replay: chunk records)")
    ap.add_argument("--users", type=int, default=2000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--bench", choices=("w1", "replay"), default="w1")
    ap.add_argument("--batch", type=int, default=5000, help="replay: records per transaction")
    args = ap.parse_args()
    if args.bench == "replay":
        print(replay.compare(args.before, args.runs, args.repeat, args.batch).render())
        return
    after_root = tests.fixtures.processes.ROOT
    res: dict[tuple[str, str], list[dict[str, float]]] = defaultdict(list)
    with services() as stack:
        for rep in range(args.repeat):
            for kind in ("koda worker", "koda e2e"):
                for label, root in (("before", args.before.resolve()), ("after", after_root)):
                    tests.fixtures.processes.ROOT = root
                    try:
                        r = Trial(stack, kind, args.workers, max_inflight=8).measure(
                            args.runs, args.users, max(600.0, args.runs / 5)
                        )
                    finally:
                        tests.fixtures.processes.ROOT = after_root
                    res[(kind, label)].append(r)
                    extra = f" gateway cpu {r['gw_cpu_ms']:.1f} ms/run" if "gw_cpu_ms" in r else ""
                    print(
                        f"  rep {rep + 1}/{args.repeat} {kind:11} {label:6}: {r['runs_s']:.0f} "
                        f"runs/s, worker cpu {r['cpu_ms']:.1f} ms/run{extra}",
                        flush=True,
                    )
    table = Table(
        f"Before/after: {args.runs} runs x 16 chunks, {args.workers} workers, "
        f"{args.repeat} repetitions (median [min-max]); before = {args.before}",
        [
            "contender",
            "before runs/s",
            "after runs/s",
            "after/before",
            "worker CPU ms/run before -> after",
            "gateway CPU ms/run before -> after",
        ],
    )
    for kind in ("koda worker", "koda e2e"):
        b, a = res[(kind, "before")], res[(kind, "after")]
        gw = "-"
        if "gw_cpu_ms" in b[0]:
            gw = f"{fmt([x['gw_cpu_ms'] for x in b], 1)} -> {fmt([x['gw_cpu_ms'] for x in a], 1)}"
        table.add(
            kind,
            fmt([x["runs_s"] for x in b]),
            fmt([x["runs_s"] for x in a]),
            fmt([y["runs_s"] / x["runs_s"] for x, y in zip(b, a, strict=True)], 2),
            f"{fmt([x['cpu_ms'] for x in b], 1)} -> {fmt([x['cpu_ms'] for x in a], 1)}",
            gw,
        )
    e2e_b, e2e_a = res[("koda e2e", "before")], res[("koda e2e", "after")]
    table.notes.append(
        f"POST/s during the e2e submit phase: before {fmt([x['post_s'] for x in e2e_b])}, "
        f"after {fmt([x['post_s'] for x in e2e_a])}"
    )
    print(table.render())


if __name__ == "__main__":
    main()
