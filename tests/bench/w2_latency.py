"""W2, latency: chunk latency and time to first chunk below the machine's knee.

Each repetition starts a gateway and ``--workers`` (2) workers on a fresh namespace
(256 partitions) and, against those same processes:

1. finds the knee, the highest sustainable offered chunk rate (tests/bench/knee.py
   defines a step, "sustainable" and the search): runs of ``--chunks`` (100) chunks
   ``--spacing-ms`` (20) apart arrive at a steady rate, each run by a user of its own
   partition, two SSE viewers each. The first repetition grows the rate by 2x from
   ``--start`` (1,000 chunks/s); later ones by 1.5x from the first's knee; then
   ``--bisections`` halvings of the bracket;
2. measures 50 % and 80 % of that repetition's knee, each a step of the same shape;
3. right after the 80 % step, a raw confluent-kafka producer -> consumer at the same
   rate on the same run-chunks topic (tests/bench/rawpath.py): the baseline;
4. the old W2 load for continuity: ``--burst-runs`` (200) runs of 100 chunks every
   20 ms submitted at once (10,000 chunks/s offered for 2 s).

Figures, all from the runs POSTed in a step's hold window:

* yield -> viewer: the demo handler's ``stamp`` option prefixes each chunk with the wall
  clock at its yield; the viewer stamps each network read on arrival (same clock);
* time to first chunk (TTFC): POST sent -> first ``chunk`` event at a viewer. The demo
  handler sleeps ``--spacing-ms`` before its first token too: that is in the figure.

Beside each: the load generator's CPU (this process, in cores), the gateway's and
workers' CPU, and the 1-minute load average at the step's end. The goals at 80 % of
the knee are computed from the repetitions' medians.

    python -m tests.bench.w2_latency --repeat 3
    python -m tests.bench.w2_latency --repeat 3 --profile /tmp/w2-profile
    python -m tests.bench --only w2 --quick
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from koda_runtime.localstack import StackInfo
from tests.bench import knee
from tests.bench.common import (
    TERMINAL,
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
from tests.bench.fairness import place
from tests.bench.profile import print_profiles, spy_on, stop_spies
from tests.bench.rawpath import raw_latencies
from tests.fixtures.processes import GatewayProcess, WorkerProcess

PARTITIONS = 256
MAX_INFLIGHT = 128  # per worker: every partition a worker holds can run at once
LEVELS = ((0.5, "50 % of the knee"), (0.8, "80 % of the knee"))


@dataclass
class Rep:
    """One repetition's figures."""

    found: float  # the knee, chunks/s
    steps: list[knee.Step]
    levels: dict[str, knee.Step] = field(default_factory=dict)
    raw: list[float] = field(default_factory=list)
    raw_gen_cores: float = 0.0
    raw_load1: float = 0.0


async def burst(o: knee.Offer, runs: int) -> tuple[list[knee.RunSeen], int]:
    """The old W2 load: ``runs`` runs POSTed at once, each followed by its viewers."""
    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(base_url=o.url, connector=conn, timeout=timeout) as session:
        got = await asyncio.gather(
            *(knee.post_and_watch(session, o, u) for u in o.users[:runs]), return_exceptions=True
        )
    # A POST refused under the burst (503: the database pool timed out) is an unfinished
    # run of the figure, not the end of the bench.
    seen = [r for r in got if isinstance(r, knee.RunSeen)]
    unfinished = len(got) - len(seen) + sum(not all(v.terminal for v in r.viewers) for r in seen)
    return seen, unfinished


def timed_burst(o: knee.Offer, runs: int, cpu_of_sut: Callable[[], float]) -> knee.Step:
    """The old W2 load, with the CPU each side used and the load average."""
    gen0, sut0, t0 = time.process_time(), cpu_of_sut(), time.monotonic()
    seen, unfinished = asyncio.run(burst(o, runs))
    wall = time.monotonic() - t0
    step = knee.summarise(o, runs * o.chunks / (o.chunks * o.spacing_ms / 1000), seen, unfinished)
    step.gen_cores = (time.process_time() - gen0) / wall
    step.sut_cores = (cpu_of_sut() - sut0) / wall
    step.load1 = os.getloadavg()[0]
    return step


def settle(loader: Loader, timeout: float = 300.0) -> None:
    """Until no run is left pending or running: a step after an unsustainable one must
    not start on its backlog (its viewers gave up on the runs; the workers did not)."""
    deadline = time.monotonic() + timeout
    while True:
        left = loader.query(
            "SELECT count(*) AS n FROM runs WHERE NOT status = ANY(:t)", t=list(TERMINAL)
        )
        if left[0].n == 0:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{left[0].n} runs still open {timeout:.0f} s after a step")
        time.sleep(0.5)


def one_rep(stack: StackInfo, args: argparse.Namespace, rep: int, prior: float | None) -> Rep:
    with namespace(
        stack, partitions=PARTITIONS, chunk_batch_ms=20, max_inflight=MAX_INFLIGHT
    ) as settings:
        loader = Loader(settings)
        gw = GatewayProcess(
            settings,
            {
                "KODA_RATE_PER_S": "1000000",
                "KODA_RATE_BURST": "1000000",
                "KODA_MAX_ACTIVE_RUNS_PER_USER": "1000000",
            },
        )
        workers = [WorkerProcess(settings, f"w{i}") for i in range(args.workers)]
        try:
            gw.start()
            for w in workers:
                w.start()
            wait_group(settings, settings.names.group(settings.worker_group), args.workers, 300)
            system = [gw.pid] + [w.pid for w in workers]
            args.placement = place(args.pin, system)
            warm_users = users_on_distinct_partitions(PARTITIONS, PARTITIONS, "warm")
            warm = loader.insert(PARTITIONS, warm_users, lambda i: demo_input(i, 1))
            loader.publish(warm)
            loader.wait_terminal(warm.run_ids, 180, "warm-up")
            users = users_on_distinct_partitions(PARTITIONS, PARTITIONS, f"lat{rep}")
            offer = knee.Offer(
                gw.url,
                users,
                chunks=args.chunks,
                spacing_ms=args.spacing_ms,
                viewers=args.viewers,
                warm_s=args.warm_s,
                hold_s=args.hold_s,
            )

            def sut_cpu() -> float:
                return sum(cpu_seconds(p) for p in system)

            def step(rate: float) -> knee.Step:
                for w in workers:
                    w.check()
                gw.check()
                settle(loader)
                s = knee.run_step(offer, rate, sut_cpu)
                print(f"  w2 rep {rep + 1}/{args.repeat} step {s.line()}", flush=True)
                return s

            start, factor = (args.start, 2.0) if prior is None else (prior, 1.5)
            found, steps = knee.search(step, start, factor, args.bisections, args.cap)
            out = Rep(found, steps)
            if found <= 0:
                return out
            for share, label in LEVELS:
                out.levels[label] = step(round(found * share))
            t0, gen0 = time.monotonic(), time.process_time()
            out.raw = raw_latencies(settings, round(found * 0.8), args.hold_s)
            out.raw_gen_cores = (time.process_time() - gen0) / (time.monotonic() - t0)
            out.raw_load1 = os.getloadavg()[0]
            print(
                f"  w2 rep {rep + 1}/{args.repeat} raw producer -> consumer at "
                f"{round(found * 0.8)} records/s: p50 {percentile(out.raw, 0.5) * 1000:.1f} "
                f"p99 {percentile(out.raw, 0.99) * 1000:.1f} ms, {out.raw_gen_cores:.2f} cores, "
                f"load {out.raw_load1:.1f}",
                flush=True,
            )
            old = timed_burst(offer, args.burst_runs, sut_cpu)
            out.levels["old W2 load"] = old
            print(f"  w2 rep {rep + 1}/{args.repeat} old load {old.line()}", flush=True)
            if args.profile is not None and rep == 0:
                # One more step at 80 %, under py-spy; its figures count nowhere.
                folder = Path(args.profile)
                folder.mkdir(parents=True, exist_ok=True)
                targets = [("gateway", gw.pid)] + [(str(w.worker_id), w.pid) for w in workers]
                spies = spy_on(targets, folder, 100)
                try:
                    print("  profiled (py-spy attached):", end="")
                    step(round(found * 0.8))
                finally:
                    stop_spies(spies)
                print_profiles(folder, [name for name, _ in targets])
            return out
        finally:
            for w in workers:
                w.stop()
            gw.stop()
            loader.close()


def ms(values: list[float], q: float) -> float:
    return percentile(values, q) * 1000


def both(samples: list[list[float]], digits: int = 0) -> str:
    """``p50 / p99`` in ms, each the median [min-max] over the repetitions' samples."""
    return (
        f"{fmt([ms(x, 0.5) for x in samples], digits)} / "
        f"{fmt([ms(x, 0.99) for x in samples], digits)}"
    )


def run_w2(stack: StackInfo, args: argparse.Namespace) -> Table:
    reps: list[Rep] = []
    prior: float | None = None
    for rep in range(args.repeat):
        r = one_rep(stack, args, rep, prior)
        reps.append(r)
        prior = prior or r.found or None
    table = Table(
        f"W2 latency below the knee: runs of {args.chunks} chunks every {args.spacing_ms} ms "
        f"arriving at a steady rate, {args.viewers} SSE viewers each, {args.workers} workers, "
        f"{PARTITIONS} partitions, steps of {args.warm_s:.0f} + {args.hold_s:.0f} s, "
        f"{args.repeat} repetitions (median [min-max])",
        [
            "load",
            "chunks/s",
            "yield->viewer p50/p99 ms",
            "TTFC p50/p99 ms",
            "generator cores",
            "koda cores",
            "load avg",
        ],
    )
    table.add("knee (highest sustainable)", fmt([r.found for r in reps]), "", "", "", "", "")
    for label in [lab for _, lab in LEVELS] + ["old W2 load"]:
        got = [r.levels[label] for r in reps if label in r.levels]
        if not got:
            continue
        table.add(
            label,
            fmt([s.rate for s in got]),
            both([s.lat for s in got]),
            both([s.ttfc for s in got]),
            fmt([s.gen_cores for s in got], 2),
            fmt([s.sut_cores for s in got], 2),
            fmt([s.load1 for s in got], 1),
        )
    with_raw = [r for r in reps if r.raw]
    table.add(
        "raw producer->consumer at 80 %",
        fmt([r.levels["80 % of the knee"].rate for r in with_raw]),
        both([r.raw for r in with_raw], 1),
        "-",
        fmt([r.raw_gen_cores for r in with_raw], 2),
        "-",
        fmt([r.raw_load1 for r in with_raw], 1),
    )
    at80 = [r.levels["80 % of the knee"] for r in with_raw]
    ratio = [ms(s.lat, 0.99) / ms(r.raw, 0.99) for s, r in zip(at80, with_raw, strict=True)]
    table.figures = {
        "w2_knee": [r.found for r in reps],
        "w2_lat99": [ms(s.lat, 0.99) for s in at80],
        "w2_ratio_raw": ratio,
        "w2_ttfc50": [ms(s.ttfc, 0.5) for s in at80],
        "w2_ttfc99": [ms(s.ttfc, 0.99) for s in at80],
        "w2_load1": [s.load1 for s in at80],
        "w2_gen_cores": [s.gen_cores for s in at80],
    }
    table.notes.append(
        f"koda yield->viewer p99 / raw p99 at 80 % of the knee, per repetition: {fmt(ratio, 2)}"
    )
    table.notes.append(
        f"sustainable: a run's lag behind the offered schedule (last token's receipt - "
        f"(POST + chunks x spacing)) climbs from run to run by at most "
        f"{knee.SLOPE_LIMIT * 1000:.0f} ms per s (least-squares slope on POST time over the "
        f"hold window), the median lag of its first and last quarters is at most "
        f"{knee.LAG_LIMIT_S * 1000:.0f} ms (every step starts drained), and every run ends "
        f"within {knee.DRAIN_S:.0f} s of its schedule"
    )
    for i, r in enumerate(reps):
        table.notes.append(
            f"rep {i + 1} knee search: "
            + ", ".join(
                f"{s.rate:.0f} {'ok' if s.sustainable else 'NO'} ({s.slope * 1000:.0f} ms/s, "
                f"load {s.load1:.1f})"
                for s in r.steps
            )
        )
    table.notes.append(
        f"old W2 load: {args.burst_runs} runs x {args.chunks} chunks every {args.spacing_ms} ms "
        "POSTed at once (all its runs measured)"
    )
    table.notes.append(f"KODA_CHUNK_BATCH_MS=20, KODA_MAX_INFLIGHT={MAX_INFLIGHT} per worker")
    table.notes.append(
        "generator cores: CPU s per s of this process (aiohttp POSTs and SSE readers; for the "
        "raw row its producer and consumer); koda cores: gateway + workers"
    )
    table.notes.append(getattr(args, "placement", "processes never started"))
    return table


def add_args(ap: argparse.ArgumentParser, prefix: str = "") -> None:
    ap.add_argument(f"--{prefix}chunks", type=int, default=100)
    ap.add_argument(f"--{prefix}spacing-ms", type=int, default=20)
    ap.add_argument(f"--{prefix}viewers", type=int, default=2)
    ap.add_argument(f"--{prefix}start", type=float, default=1000.0, help="first rate, chunks/s")
    ap.add_argument(f"--{prefix}cap", type=float, default=40000.0, help="highest rate tried")
    ap.add_argument(f"--{prefix}bisections", type=int, default=3)
    ap.add_argument(f"--{prefix}warm-s", type=float, default=4.0)
    ap.add_argument(f"--{prefix}hold-s", type=float, default=15.0)
    ap.add_argument(f"--{prefix}burst-runs", type=int, default=200)
    ap.add_argument(
        f"--{prefix}profile",
        metavar="DIR",
        help="after the first repetition's figures, one more 80 %% step under py-spy "
        "(gateway and workers; raw stacks into DIR) and their top frames",
    )
    ap.add_argument(
        f"--{prefix}pin",
        action="store_true",
        help="pin the load generator to the last core, gateway and workers to the others",
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    add_args(ap)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    with services() as stack:
        print(run_w2(stack, args).render())


if __name__ == "__main__":
    main()
