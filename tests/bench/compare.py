"""Before/after: W1's koda figures for two source trees, repetitions interleaved.

``--before DIR`` is another checkout of koda (e.g. ``git worktree add /tmp/before
<commit>``, then ``make install`` in it); its workers and gateway run from DIR with
DIR's own ``.venv`` (this virtualenv would import this checkout's code there). Each
repetition measures before and after back to back on the same broker and
database, and the ratio pairs them.

    python -m tests.bench.compare --before /tmp/before --runs 2000 --repeat 3

``--bench replay`` compares ``koda replay`` into DuckDB instead (tests/bench/replay.py):

    python -m tests.bench.compare --bench replay --before /tmp/before --runs 200000

``--bench w3`` compares the gateway's ``POST /v1/runs`` rate (tests/bench/w3_gateway.py):
each repetition measures, level by level, the before gateway, the after gateway and the
bare handler back to back in one namespace. The before gateway runs ``python -m
koda_runtime gateway`` with DIR's ``.venv`` when it has one, else with this interpreter
in DIR as working directory (so DIR must then hold a ``koda_runtime`` package, e.g. the
``build/__editable__...`` folder that ``make install`` made in the other checkout):

    python -m tests.bench.compare --bench w3 --before /tmp/before --levels 1 8 32 128
"""

from __future__ import annotations

import argparse
import os
from collections import defaultdict
from pathlib import Path

import tests.fixtures.processes
from koda_runtime.topics.replay.engine import BATCH_RECORDS
from tests.bench import replay, w3_gateway
from tests.bench.common import Table, fmt, namespace, services
from tests.bench.w1_throughput import Trial
from tests.fixtures.processes import GatewayProcess


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", required=True, type=Path)
    ap.add_argument("--runs", type=int, default=2000, help="runs (replay: chunk records)")
    ap.add_argument("--users", type=int, default=2000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--bench", choices=("w1", "replay", "w3"), default="w1")
    ap.add_argument(
        "--batch",
        type=int,
        default=BATCH_RECORDS,
        help="replay: records per transaction, for both trees (default: koda replay's)",
    )
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 8, 32, 128], help="w3")
    ap.add_argument("--requests", type=int, default=1000, help="w3: POSTs per level")
    args = ap.parse_args()
    if args.bench == "replay":
        print(replay.compare(args.before, args.runs, args.repeat, args.batch).render())
        return
    if args.bench == "w3":
        print(compare_w3(args.before.resolve(), args.levels, args.requests, args.repeat).render())
        return
    if not (args.before / ".venv" / "bin" / "python").exists():
        ap.error(f"--before {args.before} has no .venv: run `make install` in it first")
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


def compare_w3(before: Path, levels: list[int], requests: int, reps: int) -> Table:
    """Before/after for W3 (see the module docstring)."""
    res: dict[tuple[str, int], list[dict[str, float]]] = defaultdict(list)
    loads = [os.getloadavg()[0]]
    with services() as stack:
        for rep in range(reps):
            with namespace(stack, partitions=32) as settings:
                rate = {
                    "KODA_RATE_PER_S": "1000000",
                    "KODA_RATE_BURST": "1000000",
                    "KODA_MAX_ACTIVE_RUNS_PER_USER": "1000000",
                }
                old = GatewayProcess(settings, rate)
                old.cwd = before
                if (before / ".venv" / "bin" / "python").exists():
                    old.argv = [str(before / ".venv" / "bin" / "python"), *old.argv[1:]]
                new = GatewayProcess(settings, rate)
                bare = w3_gateway.bare_process(settings)
                urls = {"before": old.url, "after": new.url, "bare": bare.url}  # type: ignore[attr-defined]
                try:
                    old.start()
                    new.start()
                    bare.start()
                    w3_gateway.wait_http(urls["bare"], bare)
                    for url in urls.values():
                        w3_gateway.measure(url, 100, 8, "warm")
                    for level in levels:
                        line = []
                        for label, url in urls.items():
                            r = w3_gateway.measure(url, requests, level, f"{label[0]}{rep}")
                            res[(label, level)].append(r)
                            line.append(f"{label} {r['rps']:.0f} req/s p99 {r['p99']:.1f} ms")
                        print(f"  w3 rep {rep + 1}/{reps} c{level}: " + "; ".join(line), flush=True)
                finally:
                    for child in (old, new, bare):
                        if child.proc is not None:
                            child.stop()
            loads.append(os.getloadavg()[0])
    table = Table(
        f"Before/after: W3 gateway, {requests} POST /v1/runs per level, {reps} repetitions "
        f"(median [min-max]); before = {before}",
        [
            "concurrency",
            "before req/s",
            "after req/s",
            "after/before",
            "bare req/s",
            "before/bare",
            "after/bare",
            "p99 ms before -> after",
        ],
    )
    for level in levels:
        b, a, bare_r = res[("before", level)], res[("after", level)], res[("bare", level)]
        table.add(
            str(level),
            fmt([x["rps"] for x in b]),
            fmt([x["rps"] for x in a]),
            fmt([y["rps"] / x["rps"] for x, y in zip(b, a, strict=True)], 2),
            fmt([x["rps"] for x in bare_r]),
            fmt([x["rps"] / y["rps"] for x, y in zip(b, bare_r, strict=True)], 2),
            fmt([x["rps"] / y["rps"] for x, y in zip(a, bare_r, strict=True)], 2),
            f"{fmt([x['p99'] for x in b], 1)} -> {fmt([x['p99'] for x in a], 1)}",
        )
    table.notes.append(replay.load_note(loads))
    table.notes.append("the load generator (aiohttp) shares the 2 cores with the servers")
    return table


if __name__ == "__main__":
    main()
