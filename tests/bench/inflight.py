"""How many runs in flight one worker process (one event loop) really serves, and the
memory each run in flight costs.

For each size N the bench starts one fresh worker (``KODA_MAX_INFLIGHT`` = 2 N, so the
bound never decides) on a fresh namespace of ``--partitions`` partitions, and keeps N
long streamed runs of N distinct users going: user *i* submits its first run at
``i * ramp / N`` seconds, and each following run as soon as the previous one ended
(a closed loop, polled every 0.5 s). A run streams a token every 100-200 ms (chosen per
run) for about ``--run-s`` seconds; each token carries its yield time (the demo
handler's ``stamp`` switch). Runs go straight to Postgres and the runs topic, as the
gateway would write them (tests/bench/common.py ``Loader``): no gateway runs.

Once the ramp and ``--settle-s`` are over, the bench measures for ``--hold-s`` seconds:

* runs in flight: the worker's ``koda_runs_in_flight`` gauge (median of the samples)
  and the runs table (started, not finished);
* RSS (``/proc/<pid>/status``) when idle, after a short warm-up, and the median in the
  window; memory per run in flight = (RSS - RSS idle) / runs in flight (measured);
* the worker's CPU (``/proc/<pid>/stat``) over the window, in % of one core;
* event-loop lag: the ``koda_event_loop_lag_seconds`` gauge, scraped every 0.25 s
  from the worker's ``/metrics``; the probe wakes every 0.5 s, so each distinct value
  is one wake-up (p50, p99, max over them);
* chunk delay: a chunk row's ``created_at`` (its writing transaction's start) minus
  the yield time stamped in its first token;
* tokens/s written against tokens/s offered, the median run length (nominal
  ``--run-s``), and the share of runs started in the window whose queue wait
  (``started_at - created_at``) exceeded 1 s.

The verdict is the largest N for which that N and every smaller one kept the loop-lag
p99 under ``--lag-limit-ms``, the worker's CPU under ``--cpu-limit`` % of one core,
and at least 90 % of the N runs in flight. The host's busy share of all its cores
and the 1-minute load are printed beside each row: other work on the machine shows
there.

    make bench-inflight                                   # N = 64 ... 1024
    python -m tests.bench.inflight --sizes 64 256 --hold-s 20
"""

from __future__ import annotations

import argparse
import os
import random
import re
import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from koda_runtime.localstack import StackInfo
from tests.bench.common import (
    Loader,
    Table,
    cpu_seconds,
    demo_input,
    namespace,
    percentile,
    services,
    wait_group,
)
from tests.bench.memory import rss_kib
from tests.fixtures.processes import WorkerProcess, free_port

SIZES = (64, 128, 256, 512, 1024)
LAG_LIMIT_MS = 100.0
CPU_LIMIT_PCT = 90.0
REACH = 0.9  # runs in flight must reach this share of N for N to count as served
SAMPLE_S = 0.25
POLL_S = 0.5
WAIT_LATE_S = 1.0
_STAMP_SQL = r"^[0-9]{10}\.[0-9]{6} "
_GAUGE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


# ---------------------------------------------------------------- pure parts


def parse_gauges(text: str, names: Sequence[str]) -> dict[str, float]:
    """The values of the unlabelled metrics ``names`` in a Prometheus text page."""
    wanted = set(names)
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _GAUGE.match(line)
        if m and m.group(1) in wanted and not m.group(2):
            out[m.group(1)] = float(m.group(3))
    return out


def distinct_ticks(values: Sequence[float]) -> list[float]:
    """Consecutive samples of a gauge that changes once per probe wake-up, with the
    repeats dropped: one value per wake-up seen (scraped faster than it wakes)."""
    out: list[float] = []
    for v in values:
        if not out or v != out[-1]:
            out.append(v)
    return out


def host_busy(before: Sequence[int], after: Sequence[int]) -> float:
    """Busy share (0..1) of all cores between two ``/proc/stat`` ``cpu`` lines' fields
    (user nice system idle iowait irq softirq steal ...)."""
    delta = [a - b for a, b in zip(after, before, strict=False)]
    total = sum(delta[:8])
    idle = delta[3] + (delta[4] if len(delta) > 4 else 0)
    return (total - idle) / total if total > 0 else float("nan")


@dataclass
class Step:
    """What one size N measured."""

    n: int
    in_flight: float  # median of the koda_runs_in_flight samples
    in_flight_db: float  # median of the runs table's started-not-finished counts
    rss_idle_kib: float
    rss_kib: float  # median in the window
    cpu_pct: float  # of one core, every thread of the process
    loop_cpu_pct: float  # of one core, the event loop's thread alone
    runq_pct: float  # share of the window the loop's thread waited for a core
    lag_ms: list[float]  # one per probe wake-up seen in the window
    chunk_p50_ms: float
    chunk_p99_ms: float
    tokens_s: float  # written
    offered_s: float  # N / mean token interval
    run_p50_s: float
    started: int  # runs started in the window
    late: int  # of them, queue wait above WAIT_LATE_S
    host_pct: float  # busy share of all the host's cores
    load1: float
    notes: list[str] = field(default_factory=list)

    @property
    def lag_p99_ms(self) -> float:
        return percentile(self.lag_ms, 0.99)

    @property
    def per_run_kib(self) -> float:
        if self.in_flight <= 0:
            return float("nan")
        return (self.rss_kib - self.rss_idle_kib) / self.in_flight

    @property
    def late_share(self) -> float:
        return self.late / self.started if self.started else float("nan")

    def failures(
        self, lag_limit_ms: float = LAG_LIMIT_MS, cpu_limit: float = CPU_LIMIT_PCT
    ) -> list[str]:
        """Why this step does not count as served ([] if it does)."""
        out = []
        if not self.lag_ms or not self.lag_p99_ms < lag_limit_ms:
            out.append(f"loop lag p99 {self.lag_p99_ms:.0f} ms >= {lag_limit_ms:.0f} ms")
        if not self.cpu_pct < cpu_limit:
            out.append(f"CPU {self.cpu_pct:.0f} % >= {cpu_limit:.0f} % of a core")
        if not self.in_flight >= REACH * self.n:
            out.append(f"only {self.in_flight:.0f} of {self.n} runs in flight")
        return out


def verdict(
    steps: Sequence[Step], lag_limit_ms: float = LAG_LIMIT_MS, cpu_limit: float = CPU_LIMIT_PCT
) -> tuple[int | None, str]:
    """The largest N served, with it every smaller N (a noisy pass above a failure does
    not count), and one line saying so and why the next size failed."""
    served: Step | None = None
    for step in sorted(steps, key=lambda s: s.n):
        why = step.failures(lag_limit_ms, cpu_limit)
        if why:
            head = (
                f"one worker serves {served.n} runs in flight"
                if served
                else f"one worker serves none of the sizes tried (smallest {step.n})"
            )
            return (served.n if served else None), f"{head}; at {step.n}: {'; '.join(why)}"
        served = step
    if served is None:
        return None, "no size measured"
    return served.n, f"one worker serves {served.n} runs in flight, the largest size tried"


def table(steps: Sequence[Step], args: argparse.Namespace) -> Table:
    t = Table(
        f"Runs in flight on one worker: {args.partitions} partitions, runs of ~{args.run_s:.0f} s "
        f"(a token every {args.delay_ms[0]}-{args.delay_ms[1]} ms), {args.hold_s:.0f} s window "
        f"per size, {os.cpu_count()} cores",
        [
            "N",
            "in flight (gauge/db)",
            "RSS idle MiB",
            "RSS MiB",
            "KiB/run",
            "CPU % all/loop",
            "runq wait %",
            "lag p50/p99/max ms",
            "chunk p50/p99 ms",
            "tokens/s (offered)",
            "run p50 s",
            "wait>1s",
            "host busy %",
            "load1",
        ],
    )
    for s in sorted(steps, key=lambda s: s.n):
        lag = s.lag_ms
        lag_cell = (
            f"{statistics.median(lag):.0f}/{s.lag_p99_ms:.0f}/{max(lag):.0f}" if lag else "n/a"
        )
        t.add(
            str(s.n),
            f"{s.in_flight:.0f}/{s.in_flight_db:.0f}",
            f"{s.rss_idle_kib / 1024:.0f}",
            f"{s.rss_kib / 1024:.0f}",
            f"{s.per_run_kib:.0f}",
            f"{s.cpu_pct:.0f}/{s.loop_cpu_pct:.0f}",
            f"{s.runq_pct:.0f}",
            lag_cell,
            f"{s.chunk_p50_ms:.0f}/{s.chunk_p99_ms:.0f}",
            f"{s.tokens_s:.0f} ({s.offered_s:.0f})",
            f"{s.run_p50_s:.1f}",
            f"{s.late_share:.1%} of {s.started}",
            f"{s.host_pct:.0f}",
            f"{s.load1:.1f}",
        )
        t.notes += [f"N={s.n}: {n}" for n in s.notes]
    t.notes += [
        "KiB/run: (RSS - RSS idle) / runs in flight (the gauge's median)",
        "CPU: % of one core, the whole process / the event loop's thread alone; runq wait: "
        "share of the window the loop's thread was ready but waited for a core (the host "
        "busy with other work shows here, and in the lag)",
        "lag: koda_event_loop_lag_seconds, one value per 0.5 s probe wake-up in the window",
        "chunk: row created_at (its transaction's start) - the yield time in its first token",
        f"wait>1s: runs started in the window whose queue wait exceeded {WAIT_LATE_S:.0f} s",
    ]
    n, line = verdict(steps, args.lag_limit_ms, args.cpu_limit)
    t.footer.append(
        f"verdict (lag p99 < {args.lag_limit_ms:.0f} ms, CPU < {args.cpu_limit:.0f} % of a "
        f"core, >= {REACH:.0%} of N in flight): {line}"
    )
    t.footer.append(f"KODA_MAX_INFLIGHT default today: 256; measured: {n if n else 'none'}")
    return t


# ---------------------------------------------------------------- measurement


def loop_thread_sched(pid: int) -> tuple[float, float]:
    """(CPU seconds, seconds runnable but waiting for a core) of the process's main
    thread, the one that runs the event loop (``/proc/<pid>/schedstat``); (0, 0) if
    the kernel does not keep them."""
    try:
        cpu_ns, wait_ns, *_ = Path(f"/proc/{pid}/schedstat").read_text().split()
    except (OSError, ValueError):
        return 0.0, 0.0
    return int(cpu_ns) / 1e9, int(wait_ns) / 1e9


def _proc_stat_cpu() -> list[int]:
    return [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]


class Sampler(threading.Thread):
    """Scrapes the worker's gauges and RSS every SAMPLE_S seconds while it runs."""

    def __init__(self, url: str, pid: int) -> None:
        super().__init__(daemon=True, name="inflight-sampler")
        self.url = url
        self.pid = pid
        self.samples: list[tuple[float, float, float, int]] = []  # t, in flight, lag s, RSS
        self.errors = 0
        self._halt = threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=2.0) as client:
            while not self._halt.is_set():
                t = time.time()
                try:
                    g = parse_gauges(
                        client.get(self.url).text,
                        ("koda_runs_in_flight", "koda_event_loop_lag_seconds"),
                    )
                    self.samples.append(
                        (
                            t,
                            g.get("koda_runs_in_flight", float("nan")),
                            g.get("koda_event_loop_lag_seconds", float("nan")),
                            rss_kib(self.pid),
                        )
                    )
                except (httpx.HTTPError, OSError):
                    self.errors += 1
                self._halt.wait(max(0.0, SAMPLE_S - (time.time() - t)))

    def stop(self) -> None:
        self._halt.set()
        self.join(5)

    def between(self, lo: float, hi: float) -> list[tuple[float, float, float, int]]:
        return [s for s in self.samples if lo <= s[0] <= hi]


class Users:
    """N users, each keeping one run going: the next is submitted once the last ended."""

    def __init__(self, loader: Loader, n: int, args: argparse.Namespace, tag: str) -> None:
        self.loader = loader
        self.args = args
        self.users = [f"{tag}-{i}" for i in range(n)]
        self.open: dict[str, str] = {}  # run id -> user
        self.serial = 0
        self.rng = random.Random(n)  # noqa: S311 - load shape, not crypto
        self.delays: list[float] = []

    def _input(self, _: int) -> dict[str, Any]:
        lo, hi = self.args.delay_ms
        delay = self.rng.randint(lo, hi)
        self.delays.append(delay)
        self.serial += 1
        tokens = max(1, round(self.args.run_s * 1000 / delay))
        return demo_input(self.serial, tokens, delay, stamp=True)

    def submit(self, users: list[str]) -> None:
        if not users:
            return
        loaded = self.loader.insert(len(users), users, self._input)
        self.loader.publish(loaded)
        self.open.update(zip(loaded.run_ids, loaded.users, strict=True))

    def ended(self) -> list[str]:
        """The users whose open run has ended since the last call."""
        if not self.open:
            return []
        rows = self.loader.query(
            "SELECT id FROM runs WHERE id = ANY(:ids) AND finished_at IS NOT NULL",
            ids=list(self.open),
        )
        return [self.open.pop(r.id) for r in rows]


def window_figures(loader: Loader, lo: float, hi: float) -> dict[str, float]:
    """Queue waits, run lengths and chunk delays from Postgres, for the window lo..hi."""
    w = {"lo": lo, "hi": hi}
    runs = loader.query(
        "SELECT count(*) AS started,"
        " count(*) FILTER (WHERE started_at - created_at > make_interval(secs => :late))"
        " AS late FROM runs WHERE started_at BETWEEN to_timestamp(:lo) AND to_timestamp(:hi)",
        late=WAIT_LATE_S,
        **w,
    )[0]
    length = loader.query(
        "SELECT percentile_cont(0.5) WITHIN GROUP"
        " (ORDER BY extract(epoch FROM finished_at - started_at)) AS p50"
        " FROM runs WHERE finished_at BETWEEN to_timestamp(:lo) AND to_timestamp(:hi)",
        **w,
    )[0]
    chunks = loader.query(
        "SELECT percentile_cont(ARRAY[0.5, 0.99]) WITHIN GROUP (ORDER BY d) AS p,"
        " sum(tokens) AS tokens FROM ("
        "  SELECT extract(epoch FROM created_at) - split_part(content, ' ', 1)::float8 AS d,"
        "         regexp_count(content, '[0-9]{10}\\.[0-9]{6} ') AS tokens"
        "    FROM messages WHERE kind = 'chunk' AND content ~ :stamp"
        "     AND created_at BETWEEN to_timestamp(:lo) AND to_timestamp(:hi)) AS c",
        stamp=_STAMP_SQL,
        **w,
    )[0]
    p = chunks.p or [float("nan"), float("nan")]
    return {
        "started": int(runs.started),
        "late": int(runs.late),
        "run_p50_s": float(length.p50) if length.p50 is not None else float("nan"),
        "chunk_p50_ms": float(p[0]) * 1000,
        "chunk_p99_ms": float(p[1]) * 1000,
        "tokens": float(chunks.tokens or 0),
    }


def measure(stack: StackInfo, n: int, args: argparse.Namespace) -> Step:
    """One size: a fresh namespace and worker, warm-up, idle RSS, ramp, settle, window."""
    cap = min(4096, 2 * n)
    with namespace(stack, partitions=args.partitions, chunk_batch_ms=20, max_inflight=cap) as st:
        loader = Loader(st)
        port = free_port()
        worker = WorkerProcess(st, f"inflight-{n}", {"KODA_WORKER_PORT": str(port)}).start()
        sampler: Sampler | None = None
        try:
            wait_group(st, st.names.group(st.worker_group), 1)
            warm = loader.insert(16, 16, lambda i: demo_input(i, 4, 10), f"warm{n}")
            loader.publish(warm)
            loader.wait_terminal(warm.run_ids, 120, "warm-up", worker.check)
            time.sleep(3.0)
            idle = []
            for _ in range(5):
                idle.append(rss_kib(worker.pid))
                time.sleep(0.4)
            rss_idle = float(statistics.median(idle))

            sampler = Sampler(f"http://127.0.0.1:{port}/metrics", worker.pid)
            sampler.start()
            users = Users(loader, n, args, f"u{n}")
            t0 = time.time()
            w_lo = t0 + args.ramp_s + args.settle_s
            w_hi = w_lo + args.hold_s
            ramped = 0
            db_counts: list[int] = []
            cpu_lo = stat_lo = None
            sched_lo = (0.0, 0.0)
            next_db = 0.0
            while True:
                now = time.time()
                if cpu_lo is None and now >= w_lo:
                    cpu_lo, stat_lo, w_lo = cpu_seconds(worker.pid), _proc_stat_cpu(), now
                    sched_lo = loop_thread_sched(worker.pid)
                if now >= w_hi:
                    cpu_hi, stat_hi, w_hi = cpu_seconds(worker.pid), _proc_stat_cpu(), now
                    sched_hi = loop_thread_sched(worker.pid)
                    break
                worker.check()
                due = min(n, int((now - t0) / args.ramp_s * n) + 1) if args.ramp_s else n
                fresh = users.users[ramped:due]
                ramped = max(ramped, due)
                users.submit(fresh + users.ended())
                if w_lo <= now and now >= next_db:
                    db_counts.append(
                        int(
                            loader.query(
                                "SELECT count(*) AS n FROM runs WHERE started_at IS NOT NULL"
                                " AND finished_at IS NULL"
                            )[0].n
                        )
                    )
                    next_db = now + 2.0
                time.sleep(max(0.0, POLL_S - (time.time() - now)))
            load1 = os.getloadavg()[0]
            sampler.stop()
            assert cpu_lo is not None and stat_lo is not None
            win = sampler.between(w_lo, w_hi)
            figures = window_figures(loader, w_lo, w_hi)
            span = w_hi - w_lo
            mean_delay_s = statistics.mean(users.delays) / 1000 if users.delays else float("nan")
            step = Step(
                n=n,
                in_flight=statistics.median([s[1] for s in win]) if win else float("nan"),
                in_flight_db=statistics.median(db_counts) if db_counts else float("nan"),
                rss_idle_kib=rss_idle,
                rss_kib=statistics.median([s[3] for s in win]) if win else float("nan"),
                cpu_pct=(cpu_hi - cpu_lo) / span * 100,
                loop_cpu_pct=(sched_hi[0] - sched_lo[0]) / span * 100,
                runq_pct=(sched_hi[1] - sched_lo[1]) / span * 100,
                lag_ms=[v * 1000 for v in distinct_ticks([s[2] for s in win])],
                chunk_p50_ms=figures["chunk_p50_ms"],
                chunk_p99_ms=figures["chunk_p99_ms"],
                tokens_s=figures["tokens"] / span,
                offered_s=n / mean_delay_s,
                run_p50_s=figures["run_p50_s"],
                started=int(figures["started"]),
                late=int(figures["late"]),
                host_pct=host_busy(stat_lo, stat_hi) * 100,
                load1=load1,
            )
            if sampler.errors:
                step.notes.append(f"{sampler.errors} /metrics scrapes failed")
            if len(win) < span / SAMPLE_S * 0.8:
                step.notes.append(f"only {len(win)} samples in {span:.0f} s (slow scrapes)")
            return step
        finally:
            if sampler is not None and sampler.is_alive():
                sampler.stop()
            worker.kill()  # the runs still streaming do not matter: the namespace goes
            loader.close()


def run_inflight(stack: StackInfo, args: argparse.Namespace) -> Table:
    steps: list[Step] = []
    for n in args.sizes:
        print(f"  inflight: N={n} ...", flush=True)
        try:
            step = measure(stack, n, args)
        except Exception as exc:  # noqa: BLE001 - print what was measured so far
            print(f"  inflight: N={n} failed: {exc!r}"[:3000], flush=True)
            break
        steps.append(step)
        print(
            f"  inflight: N={n}: in flight {step.in_flight:.0f}, CPU {step.cpu_pct:.0f} %, "
            f"loop {step.loop_cpu_pct:.0f} %, runq wait {step.runq_pct:.0f} %, "
            f"lag p99 {step.lag_p99_ms:.0f} ms, RSS {step.rss_kib / 1024:.0f} MiB "
            f"(idle {step.rss_idle_kib / 1024:.0f}), host busy {step.host_pct:.0f} %",
            flush=True,
        )
    return table(steps, args)


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    ap.add_argument("--partitions", type=int, default=16)
    ap.add_argument("--run-s", type=float, default=20.0, help="a run's nominal length")
    ap.add_argument("--delay-ms", type=int, nargs=2, default=[100, 200], metavar=("LO", "HI"))
    ap.add_argument("--ramp-s", type=float, default=20.0, help="first runs spread over this")
    ap.add_argument("--settle-s", type=float, default=5.0)
    ap.add_argument("--hold-s", type=float, default=40.0, help="the measured window")
    ap.add_argument("--lag-limit-ms", type=float, default=LAG_LIMIT_MS)
    ap.add_argument("--cpu-limit", type=float, default=CPU_LIMIT_PCT, help="% of one core")


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m tests.bench.inflight")
    add_args(ap)
    args = ap.parse_args()
    with services() as stack:
        print(run_inflight(stack, args).render())


if __name__ == "__main__":
    main()
