"""W1, throughput: demo runs of 16 chunks of about 8 bytes, no delay.

For each contender and each repetition: a fresh namespace (topics, group,
schema), the processes started and their group stable, a warm-up of one run per
partition, then the measured runs. Throughput is runs (or chunk rows) divided by
the time from the first submission to the last ``finished_at`` in Postgres.

Contenders (the repetitions are interleaved, every other one in reverse order, so
drift in the machine's load hits every contender alike):

* ``koda e2e``: submitted through the gateway (POST /v1/runs), N workers.
* ``koda worker``: runs inserted and their records produced straight to the
  runs topic (what Submitter does), N workers.
* ``ceiling``, ``naive``, ``quix``: the same work without koda (tests/bench/rivals.py).
* with ``--ledger-off``, ``koda e2e ledger-off`` beside each ``koda e2e``: the same
  processes with ``KODA_COST_LEDGER=false`` (no ledger rows, no budget checks), for
  the cost of the ledger. The ``koda e2e`` trial then gives every user a budget, so
  each admission reads a real budget row.

    python -m tests.bench.w1_throughput --runs 2000 --repeat 3
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from collections import defaultdict
from collections.abc import Callable
from functools import partial
from typing import Any

import aiohttp
from sqlalchemy import text

from koda_runtime.localstack import StackInfo
from koda_runtime.settings import Settings
from tests.bench.common import (
    Loader,
    Table,
    cpu_seconds,
    demo_input,
    fmt,
    namespace,
    services,
    users_on_distinct_partitions,
    wait_group,
)
from tests.bench.goals import target
from tests.bench.procs import QUIX_PYTHON, rival
from tests.fixtures.processes import ChildProcess, GatewayProcess, WorkerProcess

TOKENS = 16
PARTITIONS = 32
LEDGER_OFF = "koda e2e ledger-off"


def give_budgets(loader: Loader, users: list[str]) -> None:
    """A budget no run reaches for every user: admission reads a row for each POST."""
    with loader.engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO budgets (user_id, monthly_usd, daily_usd)"
                " SELECT u, 1000000, 100000 FROM unnest(CAST(:u AS text[])) AS u"
            ),
            {"u": users},
        )


async def post_runs(
    url: str, users: list[str], inputs: list[dict[str, Any]], concurrency: int
) -> tuple[list[str], list[float]]:
    """POST every input (user ``users[i]``) at ``concurrency``; run ids and latencies (s)."""
    ids: list[str] = [""] * len(inputs)
    lat: list[float] = [0.0] * len(inputs)
    it = iter(range(len(inputs)))
    conn = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    async with aiohttp.ClientSession(base_url=url, connector=conn) as session:

        async def lane() -> None:
            for i in it:
                t = time.perf_counter()
                async with session.post(
                    "/v1/runs",
                    json={"input": inputs[i]},
                    headers={"Authorization": f"Bearer dev:{users[i]}"},
                ) as r:
                    body = await r.json()
                    if r.status != 202:
                        raise AssertionError(f"POST /v1/runs -> {r.status}: {body}")
                lat[i] = time.perf_counter() - t
                ids[i] = body["run_id"]

        await asyncio.gather(*(lane() for _ in range(concurrency)))
    return ids, lat


class Trial:
    """One contender's processes in one fresh namespace."""

    def __init__(
        self,
        stack: StackInfo,
        kind: str,
        procs: int,
        *,
        max_inflight: int,
        budgets: bool = False,
        worker_env: dict[str, str] | None = None,
    ) -> None:
        self.stack, self.kind, self.nprocs = stack, kind, procs
        self.max_inflight = max_inflight
        self.budgets = budgets
        self.worker_env = dict(worker_env or {})  # extra KODA_* for koda's workers
        self.children: list[Any] = []
        self.gateway: GatewayProcess | None = None

    def alive(self) -> None:
        for c in self.children:
            if isinstance(c, ChildProcess):
                c.check()
            elif not c.alive():
                raise AssertionError(f"worker {c.worker_id} exited:\n{c.log()[-3000:]}")

    def start(self, settings: Settings) -> None:
        if self.kind.startswith("koda"):
            group = settings.names.group(settings.worker_group)
            off = {"KODA_COST_LEDGER": "false"} if self.kind == LEDGER_OFF else {}
            self.children = [
                WorkerProcess(settings, f"w{i}", self.worker_env | off).start()
                for i in range(self.nprocs)
            ]
            if self.kind in ("koda e2e", LEDGER_OFF):
                self.gateway = GatewayProcess(
                    settings,
                    {
                        "KODA_RATE_PER_S": "1000000",
                        "KODA_RATE_BURST": "1000000",
                        "KODA_MAX_ACTIVE_RUNS_PER_USER": "1000000",
                        **off,
                    },
                ).start()
        else:
            group = settings.names.group(f"bench-{self.kind}")
            self.children = [
                rival(self.kind, settings, i, group).start() for i in range(self.nprocs)
            ]
        wait_group(settings, group, self.nprocs)

    def stop(self) -> None:
        for c in self.children:
            c.stop()
        if self.gateway is not None:
            self.gateway.stop()

    def measure(self, runs: int, users: int, timeout: float) -> dict[str, float]:
        with namespace(
            self.stack, partitions=PARTITIONS, chunk_batch_ms=20, max_inflight=self.max_inflight
        ) as settings:
            loader = Loader(settings)
            try:
                self.start(settings)
                # One run per partition: every process has taken its partitions' fences.
                warm = loader.insert(
                    PARTITIONS,
                    users_on_distinct_partitions(PARTITIONS, PARTITIONS, "warm"),
                    lambda i: demo_input(i, 1),
                )
                loader.publish(warm)
                loader.wait_terminal(warm.run_ids, 120, "warm-up", self.alive)
                if self.kind == "koda e2e" and self.budgets:
                    give_budgets(loader, [f"u-{i}" for i in range(users)])
                return self._measured(loader, runs, users, timeout)
            finally:
                self.stop()
                loader.close()

    def _pids(self) -> list[int]:
        return [c.pid for c in self.children]

    def _measured(self, loader: Loader, runs: int, users: int, timeout: float) -> dict[str, float]:
        gen0 = time.process_time()  # the load generator: this process (POSTs or produces)
        out = self._measured_runs(loader, runs, users, timeout)
        out["gen_cpu_ms"] = 1000 * (time.process_time() - gen0) / runs
        out["load1"] = os.getloadavg()[0]
        out["cpu_ms"] = 1000 * (sum(cpu_seconds(p) for p in self._pids()) - self._cpu0) / runs
        if self.gateway is not None and self.gateway.proc is not None:
            out["gw_cpu_ms"] = 1000 * (cpu_seconds(self.gateway.proc.pid) - self._gw0) / runs
        return out

    def _measured_runs(
        self, loader: Loader, runs: int, users: int, timeout: float
    ) -> dict[str, float]:
        self._cpu0 = sum(cpu_seconds(p) for p in self._pids())
        self._gw0 = cpu_seconds(self.gateway.proc.pid) if self.gateway and self.gateway.proc else 0
        make: Callable[[int], dict[str, Any]] = lambda i: demo_input(i, TOKENS)  # noqa: E731
        if self.gateway is not None:
            inputs = [make(i) for i in range(runs)]
            who = [f"u-{i % users}" for i in range(runs)]
            t0 = time.time()
            ids, _lat = asyncio.run(post_runs(self.gateway.url, who, inputs, 64))
            submit_s = time.time() - t0
            loader.wait_terminal(ids, timeout, self.kind, self.alive)
            out = loader.outcome(ids, t0)
            out["post_s"] = runs / submit_s
            return out
        loaded = loader.insert(runs, users, make, prefix="u")
        t0 = time.time()
        loader.publish(loaded)
        loader.wait_terminal(loaded.run_ids, timeout, self.kind, self.alive)
        return loader.outcome(loaded.run_ids, t0)


def contenders(
    worker_counts: list[int], rival_procs: int, rivals: list[str], ledger_off: bool = False
) -> list[tuple[str, int]]:
    out: list[tuple[str, int]] = []
    for n in worker_counts:
        out += [("koda e2e", n)] + ([(LEDGER_OFF, n)] if ledger_off else []) + [("koda worker", n)]
    for kind in rivals:
        if kind == "quix" and not QUIX_PYTHON.exists():
            continue
        out.append((kind, rival_procs))
    return out


def run_w1(stack: StackInfo, args: argparse.Namespace) -> Table:
    plan = contenders(args.workers, args.rival_procs, args.rivals, args.ledger_off)
    results: dict[tuple[str, int], list[dict[str, float]]] = defaultdict(list)
    timeout = max(600.0, args.runs / 5)
    failed: list[str] = []
    for rep in range(args.repeat):
        # Every other repetition in reverse (ABBA): a contender is never always the one
        # that runs first, right after another's load.
        for kind, n in plan if rep % 2 == 0 else plan[::-1]:
            t = time.monotonic()
            runs = (
                args.runs if kind != "naive" else max(PARTITIONS, int(args.runs * args.naive_share))
            )
            trial = Trial(stack, kind, n, max_inflight=args.max_inflight, budgets=args.ledger_off)
            res = measure_trial(
                partial(trial.measure, runs, args.users, timeout),
                f"w1 rep {rep + 1}/{args.repeat} {kind} procs={n}",
            )
            if res is None:
                failed.append(f"{kind} procs={n} in repetition {rep + 1}")
                continue
            res["runs"], res["rep"] = runs, rep
            results[(kind, n)].append(res)
            print(
                f"  w1 rep {rep + 1}/{args.repeat} {kind:12} procs={n} runs={runs}: "
                f"{res['runs_s']:.0f} runs/s {res['chunks_s']:.0f} chunks/s "
                f"cpu {res['cpu_ms']:.1f} ms/run"
                + (f" gateway cpu {res['gw_cpu_ms']:.1f} ms/run" if "gw_cpu_ms" in res else "")
                + f" generator cpu {res['gen_cpu_ms']:.1f} ms/run load {res['load1']:.1f}"
                + f" done={res['done']}/{runs} ({time.monotonic() - t:.0f} s)",
                flush=True,
            )
    return w1_table(results, args, failed)


def measure_trial(trial: Callable[[], dict[str, float]], label: str) -> dict[str, float] | None:
    """One trial's figures; a trial that fails is started once more in a fresh
    namespace, and None after a second failure (the bench goes on without it: a trial
    is its own namespace, so the others' figures stand)."""
    for attempt in (1, 2):
        try:
            return trial()
        except Exception as exc:  # noqa: BLE001 - reported, and the trial is run again
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            print(f"  {label}: FAILED (attempt {attempt} of 2): {first}", flush=True)
    return None


def paired(
    a: list[dict[str, float]], b: list[dict[str, float]]
) -> list[tuple[dict[str, float], dict[str, float]]]:
    """The trials of ``a`` and ``b`` from the same repetition (a failed trial leaves its
    repetition out of every ratio it is in)."""
    theirs = {r["rep"]: r for r in b}
    return [(r, theirs[r["rep"]]) for r in a if r["rep"] in theirs]


def w1_table(
    results: dict[tuple[str, int], list[dict[str, float]]],
    args: argparse.Namespace,
    failed: list[str] | None = None,
) -> Table:
    table = Table(
        f"W1 throughput: {args.runs} runs x {TOKENS} chunks x ~8 B, {args.users} users, "
        f"{PARTITIONS} partitions, {args.repeat} repetitions, cores={os.cpu_count()} "
        "(median [min-max])",
        [
            "contender",
            "procs",
            "runs",
            "runs/s",
            "chunks/s",
            "POST/s",
            "CPU ms/run",
            "generator ms/run",
            "load avg",
            "done",
        ],
    )
    for (kind, n), rs in results.items():
        table.add(
            kind,
            str(n),
            str(int(rs[0]["runs"])),
            fmt([r["runs_s"] for r in rs]),
            fmt([r["chunks_s"] for r in rs]),
            fmt([r["post_s"] for r in rs]) if "post_s" in rs[0] else "-",
            fmt([r["cpu_ms"] for r in rs], 1),
            fmt([r["gen_cpu_ms"] for r in rs], 1),
            fmt([r["load1"] for r in rs], 1),
            f"{min(r['done'] for r in rs):.0f}/{int(rs[0]['runs'])}",
        )
    # Ratios pair each repetition's figures (same round, same broker and database).
    ratios = Table(
        "W1 ratios (per repetition, median [min-max]) and goals", ["ratio", "value", "goal", "met"]
    )
    rp = args.rival_procs
    base = results.get(("koda worker", rp))
    # The second round's targets (tests/bench/goals.py); naive's is the first round's.
    for other, goal, cmp in (
        ("ceiling", target("w1_worker_ceiling"), ">="),
        ("naive", 5.0, ">="),
        ("quix", target("w1_worker_quix"), ">="),
    ):
        theirs = results.get((other, rp))
        if not base or not theirs:
            continue
        vals = [a["runs_s"] / b["runs_s"] for a, b in paired(base, theirs)]
        if not vals:
            continue
        med = sorted(vals)[len(vals) // 2]
        met = med >= goal if cmp == ">=" else med > goal
        ratios.add(
            f"koda worker / {other} ({rp} procs)",
            fmt(vals, 2),
            f"{cmp} {goal}",
            "yes" if met else "NO",
        )
    for n in args.workers:
        on, off = results.get(("koda e2e", n)), results.get((LEDGER_OFF, n))
        if on and off:
            vals = [a["runs_s"] / b["runs_s"] for a, b in paired(on, off)]
            if not vals:
                continue
            med = sorted(vals)[len(vals) // 2]
            if n == rp:
                table.figures["w1_ledger_overhead"] = vals
            goal = target("w1_ledger_overhead")
            ratios.add(
                f"koda e2e / {LEDGER_OFF} ({n} procs)",
                fmt(vals, 3),
                f">= {goal}",
                "yes" if med >= goal else "NO",
            )
    for other in ("ceiling", "quix"):
        theirs = results.get((other, rp))
        if base and theirs:
            pairs = paired(base, theirs)
            table.figures[f"w1_worker_{other}"] = [a["runs_s"] / b["runs_s"] for a, b in pairs]
            table.figures[f"w1_cpu_{other}"] = [a["cpu_ms"] / b["cpu_ms"] for a, b in pairs]
    e2e = results.get(("koda e2e", rp))
    if e2e and base:
        vals = [a["runs_s"] / b["runs_s"] for a, b in paired(e2e, base)]
        if vals:
            ratios.add(f"koda e2e / koda worker ({rp} procs)", fmt(vals, 2), "-", "-")
    table.notes.append(
        "CPU ms/run: user+system CPU of the contender's worker processes "
        "(not the gateway, broker or database) per run"
    )
    table.notes.append(
        "runs/s and chunks/s: runs (chunk rows) / (first submission -> last finished_at)"
    )
    table.notes.append(
        "generator ms/run: CPU of the load generator (this process: the aiohttp POSTs, or "
        "the inserts and produces) per run, on the same 2 cores, not pinned; load avg: the "
        "1-minute load average at the end of each trial"
    )
    if args.runs < 20_000:
        table.notes.append(
            f"scaled down: {args.runs} runs per trial instead of 20,000 "
            "(--runs 20000 for the full size)"
        )
    if args.naive_share < 1:
        table.notes.append(
            f"naive runs {args.naive_share:.0%} of the runs (its rate is what "
            "is compared; the full count would take most of the budget)"
        )
    table.notes.append(
        "rivals do koda's rows and records with the same batching; see tests/bench/rivals.py"
    )
    for what in failed or []:
        table.notes.append(f"FAILED twice, left out of every ratio of its repetition: {what}")
    table.footer = ["", ratios.render()]
    return table


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--runs", type=int, default=1500)
    ap.add_argument("--users", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--rival-procs", type=int, default=2)
    ap.add_argument("--rivals", nargs="*", default=["ceiling", "naive", "quix"])
    ap.add_argument("--naive-share", type=float, default=0.25)
    ap.add_argument("--max-inflight", type=int, default=8)
    ap.add_argument(
        "--ledger-off",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run koda e2e with KODA_COST_LEDGER=false: the ledger's and budgets' cost"
        " (issue 14's goal; --no-ledger-off to skip it)",
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    add_args(ap)
    args = ap.parse_args()
    with services() as stack:
        print(run_w1(stack, args).render())


if __name__ == "__main__":
    main()
