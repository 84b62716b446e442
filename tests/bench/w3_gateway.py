"""W3, gateway: ``POST /v1/runs`` at rising concurrency, against a bare ASGI handler.

For each concurrency level and repetition, ``--requests`` POSTs go to the koda
gateway and the same number to tests/bench/bare_intake.py (produce to Kafka and
nothing else), back to back on the same broker; the ratio pairs the two figures
of one repetition. No workers run: the runs stay pending.

    python -m tests.bench.w3_gateway --levels 1 8 32 128 --requests 1500
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from collections import defaultdict

from koda_runtime.localstack import StackInfo
from tests.bench.common import Table, demo_input, fmt, namespace, percentile, services
from tests.bench.w1_throughput import post_runs
from tests.fixtures.processes import ChildProcess, GatewayProcess, free_port, settings_env
from tests.support import wait_until

GOAL_RPS = 1500
GOAL_RATIO = 0.4


def bare_process(settings) -> ChildProcess:
    port = free_port()
    env = settings_env(settings, KODA_GATEWAY_PORT=str(port))
    child = ChildProcess("bare", [sys.executable, "-m", "tests.bench.bare_intake"], env=env)
    child.url = f"http://127.0.0.1:{port}"  # type: ignore[attr-defined]
    return child


def wait_http(url: str, child: ChildProcess | None = None) -> None:
    import httpx

    def up() -> bool:
        if child is not None:
            child.check()
        try:
            return httpx.get(f"{url}/livez", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(up, timeout=30, what=f"{url} answering")


def measure(url: str, n: int, concurrency: int, tag: str) -> dict[str, float]:
    users = [f"{tag}-{i % 500}" for i in range(n)]
    inputs = [demo_input(i, 16) for i in range(n)]
    t, cpu = time.perf_counter(), time.process_time()
    _ids, lat = asyncio.run(post_runs(url, users, inputs, concurrency))
    wall = time.perf_counter() - t
    return {
        "gen_cores": (time.process_time() - cpu) / wall,
        "load1": os.getloadavg()[0],
        "rps": n / wall,
        "p50": percentile(lat, 0.5) * 1000,
        "p99": percentile(lat, 0.99) * 1000,
    }


def run_w3(stack: StackInfo, args: argparse.Namespace) -> Table:
    res: dict[tuple[str, int], list[dict[str, float]]] = defaultdict(list)
    for rep in range(args.repeat):
        with namespace(stack, partitions=32) as settings:
            gw = GatewayProcess(
                settings, {"KODA_RATE_PER_S": "1000000", "KODA_RATE_BURST": "1000000"}
            )
            bare = bare_process(settings)
            try:
                gw.start()
                bare.start()
                wait_http(bare.url, bare)  # type: ignore[attr-defined]
                measure(gw.url, 100, 8, "warm")  # connections, prepared statements, JIT caches
                measure(bare.url, 100, 8, "warm")  # type: ignore[attr-defined]
                for level in args.levels:
                    g = measure(gw.url, args.requests, level, f"g{rep}")
                    b = measure(bare.url, args.requests, level, f"b{rep}")  # type: ignore[attr-defined]
                    res[("gateway", level)].append(g)
                    res[("bare", level)].append(b)
                    print(
                        f"  w3 rep {rep + 1}/{args.repeat} concurrency {level}: gateway "
                        f"{g['rps']:.0f} req/s p99 {g['p99']:.1f} ms; bare {b['rps']:.0f} "
                        f"req/s p99 {b['p99']:.1f} ms; generator {g['gen_cores']:.2f}/"
                        f"{b['gen_cores']:.2f} cores, load {b['load1']:.1f}",
                        flush=True,
                    )
            finally:
                gw.stop()
                bare.stop()
    table = Table(
        f"W3 gateway: {args.requests} POST /v1/runs per level, {args.repeat} repetitions "
        "(median [min-max]); bare = ASGI handler that only produces to Kafka",
        [
            "concurrency",
            "gateway req/s",
            "gateway p99 ms",
            "bare req/s",
            "bare p99 ms",
            "gateway/bare req/s",
            "generator cores gw/bare",
            "load avg",
        ],
    )
    for level in args.levels:
        gw_reps, bare_reps = res[("gateway", level)], res[("bare", level)]
        table.add(
            str(level),
            fmt([r["rps"] for r in gw_reps]),
            fmt([r["p99"] for r in gw_reps], 1),
            fmt([r["rps"] for r in bare_reps]),
            fmt([r["p99"] for r in bare_reps], 1),
            fmt([x["rps"] / y["rps"] for x, y in zip(gw_reps, bare_reps, strict=True)], 2),
            f"{fmt([r['gen_cores'] for r in gw_reps], 2)} / "
            f"{fmt([r['gen_cores'] for r in bare_reps], 2)}",
            fmt([r["load1"] for r in gw_reps + bare_reps], 1),
        )
    for level in args.levels:
        gw_reps, bare_reps = res[("gateway", level)], res[("bare", level)]
        table.figures[f"w3_rps_{level}"] = [r["rps"] for r in gw_reps]
        table.figures[f"w3_ratio_{level}"] = [
            x["rps"] / y["rps"] for x, y in zip(gw_reps, bare_reps, strict=True)
        ]
    table.notes.append(
        "the load generator (aiohttp, this process) shares the 2 cores with the server, not "
        "pinned: the server is the gateway, Kafka and Postgres, and a core of its own for the "
        "generator would leave them one; generator cores: its CPU s per s of each level"
    )
    if 32 in args.levels:
        rps = statistics.median(r["rps"] for r in res[("gateway", 32)])
        ratio = statistics.median(
            g["rps"] / b["rps"]
            for g, b in zip(res[("gateway", 32)], res[("bare", 32)], strict=True)
        )
        met = "met" if rps >= GOAL_RPS and ratio >= GOAL_RATIO else "NOT met"
        table.notes.append(
            f"goal at concurrency 32: >= {GOAL_RPS} req/s and >= {GOAL_RATIO}x bare; median "
            f"{rps:.0f} req/s, {ratio:.2f}x: {met}"
        )
    return table


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--requests", type=int, default=1500)
    ap.add_argument("--repeat", type=int, default=3)


def main() -> None:
    ap = argparse.ArgumentParser()
    add_args(ap)
    args = ap.parse_args()
    with services() as stack:
        print(run_w3(stack, args).render())


if __name__ == "__main__":
    main()
