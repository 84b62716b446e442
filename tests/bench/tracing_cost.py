"""The cost of tracing: W1 throughput and W2 latency with tracing off and on, side by side.

"On" is every process exporting every span (``parentbased_always_on``) to a local Jaeger
(koda/localstack/jaeger.py, the binary `make install` builds), which this bench starts;
"off" is the same processes without ``OTEL_EXPORTER_OTLP_ENDPOINT``. The processes a
trial starts inherit this process's environment, so the trial sets the OTEL variables
around itself. Repetitions alternate the order (off, on / on, off) so that drift in the
machine's load hits both alike; every ratio pairs the two trials of one repetition.

* W1: ``koda e2e`` (gateway + ``--workers`` workers, tests/bench/w1_throughput.py's
  trial): runs/s, worker and gateway CPU per run.
* W2: one step of tests/bench/w2_latency.py's shape (runs of ``--w2-chunks`` chunks
  ``--w2-spacing-ms`` apart, two SSE viewers each) at a fixed ``--w2-rate`` chunks/s,
  below the knee: yield -> viewer and time to first chunk p50/p99, and the CPU of the
  gateway and workers.

    python -m tests.bench.tracing_cost --repeat 3
    python -m tests.bench --only tracing
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from koda_runtime.localstack import StackInfo, jaeger
from tests.bench import knee
from tests.bench.common import (
    Loader,
    Table,
    cpu_seconds,
    demo_input,
    fmt,
    namespace,
    percentile,
    services,
    users_on_distinct_partitions,
    wait_group,
)
from tests.bench.w1_throughput import Trial
from tests.fixtures.processes import GatewayProcess, WorkerProcess

MODES = ("off", "on")
W2_PARTITIONS = 32
W2_MAX_INFLIGHT = 128
OPEN = {
    "KODA_RATE_PER_S": "1000000",
    "KODA_RATE_BURST": "1000000",
    "KODA_MAX_ACTIVE_RUNS_PER_USER": "1000000",
}


@contextmanager
def otel(endpoint: str | None) -> Iterator[None]:
    """The OTEL variables the trial's processes inherit: an endpoint (on) or none (off)."""
    values = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
        "OTEL_SERVICE_NAME": "koda-bench" if endpoint else None,
        "OTEL_TRACES_SAMPLER": None,
        "OTEL_SDK_DISABLED": None,
    }
    saved = {k: os.environ.get(k) for k in values}
    try:
        for key, value in values.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


def w1_trial(stack: StackInfo, args: argparse.Namespace) -> dict[str, float]:
    trial = Trial(stack, "koda e2e", args.workers, max_inflight=args.max_inflight)
    return trial.measure(args.runs, args.users, max(600.0, args.runs / 5))


def w2_trial(stack: StackInfo, args: argparse.Namespace, rep: int) -> knee.Step:
    with namespace(
        stack, partitions=W2_PARTITIONS, chunk_batch_ms=20, max_inflight=W2_MAX_INFLIGHT
    ) as settings:
        loader = Loader(settings)
        gw = GatewayProcess(settings, OPEN)
        workers = [WorkerProcess(settings, f"w{i}") for i in range(args.workers)]
        try:
            gw.start()
            for w in workers:
                w.start()
            wait_group(settings, settings.names.group(settings.worker_group), args.workers, 300)
            warm_users = users_on_distinct_partitions(W2_PARTITIONS, W2_PARTITIONS, "warm")
            warm = loader.insert(W2_PARTITIONS, warm_users, lambda i: demo_input(i, 1))
            loader.publish(warm)
            loader.wait_terminal(warm.run_ids, 180, "warm-up")
            offer = knee.Offer(
                gw.url,
                users_on_distinct_partitions(W2_PARTITIONS, W2_PARTITIONS, f"tr{rep}"),
                chunks=args.w2_chunks,
                spacing_ms=args.w2_spacing_ms,
                warm_s=args.w2_warm_s,
                hold_s=args.w2_hold_s,
            )
            system = [gw.pid] + [w.pid for w in workers]
            return knee.run_step(offer, args.w2_rate, lambda: sum(cpu_seconds(p) for p in system))
        finally:
            for w in workers:
                w.stop()
            gw.stop()
            loader.close()


def ratios(results: dict[str, list[float]]) -> list[float]:
    """on / off of each repetition."""
    return [on / off for off, on in zip(results["off"], results["on"], strict=True) if off]


def run_tracing(stack: StackInfo, args: argparse.Namespace) -> Table:
    state = Path(tempfile.mkdtemp(prefix="koda-bench-jaeger-", dir="/tmp"))
    ports = jaeger.start(state, preferred=False)
    w1: dict[str, dict[str, list[float]]] = {}
    w2: dict[str, dict[str, list[float]]] = {}

    def keep(into: dict[str, dict[str, list[float]]], name: str, mode: str, v: float) -> None:
        into.setdefault(name, {"off": [], "on": []})[mode].append(v)

    try:
        for rep in range(args.repeat):
            for mode in MODES if rep % 2 == 0 else MODES[::-1]:
                with otel(ports.endpoint if mode == "on" else None):
                    t = time.monotonic()
                    r = w1_trial(stack, args)
                    keep(w1, "runs/s", mode, r["runs_s"])
                    keep(w1, "worker CPU ms/run", mode, r["cpu_ms"])
                    keep(w1, "gateway CPU ms/run", mode, r.get("gw_cpu_ms", float("nan")))
                    print(
                        f"  tracing rep {rep + 1}/{args.repeat} W1 {mode:3}: "
                        f"{r['runs_s']:.0f} runs/s, cpu {r['cpu_ms']:.1f} ms/run "
                        f"({time.monotonic() - t:.0f} s)",
                        flush=True,
                    )
                    s = w2_trial(stack, args, rep)
                    keep(w2, "yield->viewer p50 ms", mode, percentile(s.lat, 0.5) * 1000)
                    keep(w2, "yield->viewer p99 ms", mode, percentile(s.lat, 0.99) * 1000)
                    keep(w2, "TTFC p50 ms", mode, percentile(s.ttfc, 0.5) * 1000)
                    keep(w2, "TTFC p99 ms", mode, percentile(s.ttfc, 0.99) * 1000)
                    keep(w2, "gateway+workers cores", mode, s.sut_cores)
                    print(f"  tracing rep {rep + 1}/{args.repeat} W2 {mode:3}: {s.line()}")
    finally:
        jaeger.stop(state)
    return tracing_table(w1, w2, args)


def tracing_table(
    w1: dict[str, dict[str, list[float]]],
    w2: dict[str, dict[str, list[float]]],
    args: argparse.Namespace,
) -> Table:
    table = Table(
        f"Tracing cost: off vs on (every span to Jaeger), {args.repeat} repetitions, "
        f"cores={os.cpu_count()} (median [min-max])",
        ["workload", "figure", "off", "on", "on / off"],
    )
    for workload, results in (("W1", w1), ("W2", w2)):
        for name, by_mode in results.items():
            digits = 2 if "cores" in name or "CPU" in name else 0
            table.add(
                workload,
                name,
                fmt(by_mode["off"], digits),
                fmt(by_mode["on"], digits),
                fmt(ratios(by_mode), 3),
            )
    if "runs/s" in w1:
        table.figures["tracing_w1_runs_ratio"] = ratios(w1["runs/s"])
    if "yield->viewer p99 ms" in w2:
        table.figures["tracing_w2_p99_ratio"] = ratios(w2["yield->viewer p99 ms"])
    table.notes.append(
        f"W1: koda e2e, {args.runs} runs x 16 chunks, {args.workers} workers; "
        f"W2: one step at {args.w2_rate:.0f} chunks/s ({args.w2_chunks}-chunk runs, "
        f"{args.w2_spacing_ms} ms apart, 2 viewers each), {args.w2_hold_s:.0f} s measured"
    )
    table.notes.append(
        "on / off pairs the two trials of each repetition; runs/s below 1 and latency or "
        "CPU above 1 are tracing's cost"
    )
    return table


def add_args(ap: argparse.ArgumentParser, prefix: str = "tracing-") -> None:
    """The bench's own knobs (``--tracing-...`` under ``python -m tests.bench``)."""
    ap.add_argument(f"--{prefix}runs", type=int, default=1500)
    ap.add_argument(f"--{prefix}users", type=int, default=2000)
    ap.add_argument(f"--{prefix}workers", type=int, default=2)
    ap.add_argument(f"--{prefix}max-inflight", type=int, default=8)
    ap.add_argument(f"--{prefix}w2-rate", type=float, default=2000.0, help="chunks/s")
    ap.add_argument(f"--{prefix}w2-chunks", type=int, default=100)
    ap.add_argument(f"--{prefix}w2-spacing-ms", type=int, default=20)
    ap.add_argument(f"--{prefix}w2-warm-s", type=float, default=4.0)
    ap.add_argument(f"--{prefix}w2-hold-s", type=float, default=15.0)


def quick(args: argparse.Namespace) -> None:
    """Small counts: a check that the bench runs, not figures to report."""
    args.runs, args.users, args.w2_rate = 200, 200, 500.0
    args.w2_chunks, args.w2_warm_s, args.w2_hold_s = 20, 1.0, 3.0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tests.bench.tracing_cost")
    add_args(ap, prefix="")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        quick(args)
    with services() as stack:
        print(run_tracing(stack, args).render())


if __name__ == "__main__":
    main()
