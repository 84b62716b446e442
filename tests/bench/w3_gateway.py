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
from tests.bench.common import (
    ServiceCpu,
    Table,
    cpu_seconds,
    demo_input,
    fmt,
    namespace,
    percentile,
    services,
)
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


def measure(
    url: str,
    n: int,
    concurrency: int,
    tag: str,
    pid: int | None = None,
    services_cpu: ServiceCpu | None = None,
) -> dict[str, float]:
    """``n`` POSTs at ``concurrency``; ``pid`` is the server's, whose CPU is reported,
    and ``services_cpu`` the broker's and Postgres's."""
    users = [f"{tag}-{i % 500}" for i in range(n)]
    inputs = [demo_input(i, 16) for i in range(n)]
    server0 = cpu_seconds(pid) if pid else 0.0
    svc0 = services_cpu.snapshot() if services_cpu else {}
    t, cpu = time.perf_counter(), time.process_time()
    _ids, lat = asyncio.run(post_runs(url, users, inputs, concurrency))
    wall = time.perf_counter() - t
    gen_s = time.process_time() - cpu
    svc = services_cpu.since(svc0) if services_cpu else {}
    nan = float("nan")
    return {
        "server_cores": ((cpu_seconds(pid) - server0) / wall) if pid else nan,
        "server_ms": (1000 * (cpu_seconds(pid) - server0) / n) if pid else nan,
        "kafka_ms": 1000 * svc["kafka"] / n if svc else nan,
        "postgres_ms": 1000 * svc["postgres"] / n if svc else nan,
        "gen_ms": 1000 * gen_s / n,
        "all_ms": (
            (1000 * (cpu_seconds(pid) - server0) / n if pid else 0.0)
            + 1000 * (sum(svc.values()) + gen_s) / n
        ),
        "gen_cores": gen_s / wall,
        "load1": os.getloadavg()[0],
        "rps": n / wall,
        "p50": percentile(lat, 0.5) * 1000,
        "p99": percentile(lat, 0.99) * 1000,
    }


CPU_PARTS = (
    ("server", "server_ms"),
    ("Kafka", "kafka_ms"),
    ("Postgres", "postgres_ms"),
    ("generator", "gen_ms"),
)


def _med(reps: list[dict[str, float]], key: str) -> float:
    values = [r[key] for r in reps if key in r and r[key] == r[key]]
    return statistics.median(values) if values else float("nan")


def _ceiling(reps: list[dict[str, float]]) -> float:
    """Requests/s the machine's cores allow at the measured CPU per request."""
    per_request_ms = _med(reps, "all_ms")
    return 1000 * (os.cpu_count() or 1) / per_request_ms if per_request_ms > 0 else float("nan")


def _pid(child: ChildProcess) -> int | None:
    proc = getattr(child, "proc", None)
    return None if proc is None else int(proc.pid)


def run_w3(stack: StackInfo, args: argparse.Namespace) -> Table:
    res: dict[tuple[str, int], list[dict[str, float]]] = defaultdict(list)
    for rep in range(args.repeat):
        with namespace(stack, partitions=32) as settings:
            gw = GatewayProcess(
                settings,
                {
                    "KODA_RATE_PER_S": "1000000",
                    "KODA_RATE_BURST": "1000000",
                    "KODA_MAX_ACTIVE_RUNS_PER_USER": "1000000",
                },
            )
            bare = bare_process(settings)
            try:
                gw.start()
                bare.start()
                wait_http(bare.url, bare)  # type: ignore[attr-defined]
                gw_pid, bare_pid = _pid(gw), _pid(bare)
                svc = ServiceCpu(stack)
                measure(gw.url, 100, 8, "warm", gw_pid)  # connections, prepared statements
                measure(bare.url, 100, 8, "warm", bare_pid)  # type: ignore[attr-defined]
                for level in args.levels:
                    g = measure(gw.url, args.requests, level, f"g{rep}", gw_pid, svc)
                    b = measure(bare.url, args.requests, level, f"b{rep}", bare_pid, svc)  # type: ignore[attr-defined]
                    res[("gateway", level)].append(g)
                    res[("bare", level)].append(b)
                    print(
                        f"  w3 rep {rep + 1}/{args.repeat} concurrency {level}: gateway "
                        f"{g['rps']:.0f} req/s p99 {g['p99']:.1f} ms; bare {b['rps']:.0f} "
                        f"req/s p99 {b['p99']:.1f} ms; generator {g['gen_cores']:.2f}/"
                        f"{b['gen_cores']:.2f} cores; server {g['server_cores']:.2f}/"
                        f"{b['server_cores']:.2f} cores, load {b['load1']:.1f}",
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
            "server cores gw/bare",
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
            f"{fmt([r['server_cores'] for r in gw_reps], 2)} / "
            f"{fmt([r['server_cores'] for r in bare_reps], 2)}",
            fmt([r["load1"] for r in gw_reps + bare_reps], 1),
        )
    for level in args.levels:
        gw_reps, bare_reps = res[("gateway", level)], res[("bare", level)]
        table.figures[f"w3_rps_{level}"] = [r["rps"] for r in gw_reps]
        table.figures[f"w3_ratio_{level}"] = [
            x["rps"] / y["rps"] for x, y in zip(gw_reps, bare_reps, strict=True)
        ]
    table.notes.append(
        "CPU ms per request, gateway / bare (median): "
        + "; ".join(
            f"c{level}: "
            + ", ".join(
                f"{what} {_med(res[('gateway', level)], key):.2f} / "
                f"{_med(res[('bare', level)], key):.2f}"
                for what, key in CPU_PARTS
            )
            + f", all {_med(res[('gateway', level)], 'all_ms'):.2f} / "
            f"{_med(res[('bare', level)], 'all_ms'):.2f}"
            for level in args.levels
        )
    )
    table.notes.append(
        f"at 100 % of {os.cpu_count()} cores, those totals allow at most "
        + "; ".join(
            f"c{level}: {_ceiling(res[('gateway', level)]):.0f} / "
            f"{_ceiling(res[('bare', level)]):.0f} req/s"
            for level in args.levels
        )
        + ": the gateway's goal of 1,500 req/s needs its whole path, broker included, under"
        f" {1000 * (os.cpu_count() or 1) / GOAL_RPS:.2f} ms per request"
    )
    table.notes.append(
        "server cores: the gateway's (or the bare handler's) process CPU s per s of each level,"
        " its threads included (not Kafka's or Postgres's)"
    )
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
