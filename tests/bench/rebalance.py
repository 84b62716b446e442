"""What a rebalance does to long runs in flight: a join, a leave, a rolling restart
and a kill -9, each on three workers with a 40-second run streaming on 24 partitions.

Every figure comes from Postgres: the run rows, the ``messages`` rows' ``created_at``
(the time of the group commit that wrote each chunk) and the ``partition_epochs``
table, sampled every 0.2 s while the scenario runs (which worker held each partition,
under which epoch). The chunk topic's record timestamps are not used: the compactor
replaces a finished run's chunk records, so they are not all there afterwards.

* **runs cut**: runs with a ``reset`` message. *On staying partitions* when the worker
  that held the partition before the cut holds it again at the reset, *moved* otherwise
  (a run cut twice may count in both).
* **started again**: runs whose attempt grew past 1, as a share of the runs in flight
  (streaming when a step began).
* **partitions moved**: changes of a partition's holder from the first step to the end;
  **re-fenced** counts epoch bumps without a change of holder (an eager rebalance
  revokes and re-assigns partitions that stay).
* **pause on staying partitions**: for each run in flight on a partition whose holder
  did not change during the step, the longest gap between its consecutive messages
  that ends during the step (the demo handler writes one chunk every ``delay_ms``);
  the maximum and the median over those runs.
* **moved resume**: from the step's action to the first message a moved partition's
  run got under its next attempt; the maximum over moved partitions. **stopped
  worker's resume**: the same over the partitions the stopped (or killed) worker held;
  for the kill -9 the time until the dead worker's partitions resume, reported against
  the session timeout plus 3 s.
"""

from __future__ import annotations

import functools
import signal
import statistics
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import text

from koda_runtime.localstack import StackInfo
from koda_runtime.schemas.db import sync_engine
from koda_runtime.settings import Settings
from koda_runtime.topics.catalogue import RUNS
from tests.bench.common import Loader, namespace, users_on_distinct_partitions, wait_group
from tests.fixtures.processes import WorkerPool, WorkerProcess
from tests.support import wait_until

SCENARIOS = ("join", "leave", "rolling", "kill")
LABELS = {
    "join": "join (3 + 1)",
    "leave": "leave (SIGTERM 1 of 3)",
    "rolling": "rolling restart of 3",
    "kill": "kill -9 (1 of 3)",
}
SAMPLE_S = 0.2

Owner = tuple[int, str]  # (epoch, worker_id)


@dataclass
class Config:
    """One scenario's load: ``users`` runs of ``tokens`` chunks ``delay_ms`` apart."""

    workers: int = 3
    users: int = 24
    tokens: int = 400
    delay_ms: int = 100
    lead_s: float = 5.0  # how long the runs stream before a step's action
    timeout_s: float = 600.0

    @property
    def run_s(self) -> float:
        return self.tokens * self.delay_ms / 1000


class OwnershipSampler(threading.Thread):
    """Samples ``partition_epochs`` every :data:`SAMPLE_S` seconds into ``samples``."""

    def __init__(self, settings: Settings) -> None:
        super().__init__(daemon=True)
        self.engine = sync_engine(settings)
        self.topic = settings.names.topic(RUNS)
        self.samples: list[tuple[float, dict[int, Owner]]] = []
        self.halt = threading.Event()
        self.errors: list[str] = []

    def run(self) -> None:
        query = text("SELECT partition, epoch, worker_id FROM partition_epochs WHERE topic = :t")
        while not self.halt.is_set():
            try:
                with self.engine.connect() as conn:
                    rows = conn.execute(query, {"t": self.topic}).all()
            except Exception as exc:  # noqa: BLE001 - a missed sample is caught by stop()
                self.errors.append(repr(exc))
            else:
                at = time.time()
                self.samples.append((at, {r.partition: (r.epoch, r.worker_id) for r in rows}))
            self.halt.wait(SAMPLE_S)

    def stop(self, until: float) -> list[tuple[float, dict[int, Owner]]]:
        """The samples; fails if they do not cover up to ``until`` without a 2 s hole."""
        self.halt.set()
        if self.is_alive():
            self.join(10)
        self.engine.dispose()
        times = [t for t, _ in self.samples]
        holes = [b - a for a, b in zip(times, times[1:], strict=False) if b - a > 2.0]
        if not times or times[-1] < until - 1.0 or holes:
            raise AssertionError(
                f"partition_epochs samples have holes {holes} or end before the scenario: "
                f"{self.errors[-3:]}"
            )
        return self.samples


@dataclass
class Step:
    """One action (a join, a stop, a kill) and the runs in flight when it came."""

    at: float  # unix seconds
    in_flight: dict[str, int]  # run id -> partition
    attempts: dict[str, int]  # run id -> attempt at the action
    victim: str | None = None  # the worker stopped or killed, if any
    until: float = 0.0  # the next step's action, or the scenario's end


@dataclass
class Timeline:
    """Who held each partition when, from the sampler's rows."""

    samples: list[tuple[float, dict[int, Owner]]]

    def holder(self, partition: int, at: float) -> str | None:
        held: str | None = None
        for t, rows in self.samples:
            if t > at:
                break
            if partition in rows:
                held = rows[partition][1]
        return held

    def changes(self, since: float, until: float) -> tuple[dict[int, int], dict[int, int]]:
        """Per partition: holder changes and epoch bumps without one, in the interval."""
        moved: dict[int, int] = defaultdict(int)
        refenced: dict[int, int] = defaultdict(int)
        last: dict[int, Owner] = {}
        for t, rows in self.samples:
            for p, owner in rows.items():
                prev = last.get(p)
                last[p] = owner
                if prev is None or t < since or t > until:
                    continue
                if owner[1] != prev[1]:
                    moved[p] += 1
                elif owner[0] != prev[0]:
                    refenced[p] += 1
        return moved, refenced


@dataclass
class Scenario:
    """One scenario on its own namespace: three workers, a load, then ``steps``."""

    stack: StackInfo
    name: str
    config: Config
    overrides: dict[str, Any]
    steps: list[Step] = field(default_factory=list)

    def run(self) -> dict[str, Any]:
        cfg = self.config
        with namespace(self.stack, **self.overrides) as settings:
            self.settings = settings
            loader = Loader(settings)
            self.loader = loader
            sampler = OwnershipSampler(settings)
            users = users_on_distinct_partitions(settings.partitions, cfg.users, self.name)
            self.users = users
            self.current: dict[str, str] = {}  # user -> their latest run
            self.waves = 0
            self.stopped: set[int] = set()
            try:
                with WorkerPool(settings, kill_at_end=True) as pool:
                    for i in range(cfg.workers):
                        pool.start(f"w{i + 1}")
                    self.settle(pool, {f"w{i + 1}" for i in range(cfg.workers)})
                    sampler.start()
                    ACTIONS[self.name](self, pool)
                    run_ids = list({r for s in self.steps for r in s.in_flight})
                    loader.wait_terminal(
                        run_ids, cfg.timeout_s, f"{self.name} runs", alive=self.alive(pool)
                    )
                    end = time.time()
            finally:
                sampler.halt.set()
                loader.close()
            samples = sampler.stop(end)
            return self.measure(settings, Timeline(samples), end)

    # ------------------------------------------------------------ driving

    def alive(self, pool: WorkerPool) -> Callable[[], None]:
        """Raises if a worker the scenario did not stop has exited."""

        def check() -> None:
            for w in pool:
                if id(w) not in self.stopped:
                    w.check()

        return check

    def stop(self, worker: WorkerProcess, sig: signal.Signals) -> None:
        """Send ``sig`` to ``worker`` (now expected to exit) and wait for it to exit."""
        self.stopped.add(id(worker))
        worker.signal(sig)
        assert worker.proc is not None
        worker.proc.wait(self.settings.handoff_ceiling_s + 60)

    def settle(
        self, pool: WorkerPool, expected: set[str], fresh: str = "", since: float = 0.0
    ) -> None:
        """Until the group is stable with ``expected`` as its members, each holding
        partitions, and ``fresh`` (a worker started at ``since``) took its own."""
        settings = pool.settings
        wait_group(settings, settings.names.group(settings.worker_group), len(expected))

        def held() -> bool:
            rows = self.loader.query(
                "SELECT worker_id, extract(epoch FROM assigned_at) AS at FROM partition_epochs"
                " WHERE topic = :t",
                t=settings.names.topic(RUNS),
            )
            return (
                len(rows) == settings.partitions
                and {r.worker_id for r in rows} == expected
                and all(float(r.at) >= since for r in rows if r.worker_id == fresh)
            )

        wait_until(held, timeout=120, interval=0.2, what=f"partitions held by {sorted(expected)}")

    def top_up(self) -> None:
        """A new run for every user without one in flight; then until all stream."""
        cfg = self.config
        busy = {
            r.user_id
            for r in self.loader.query(
                "SELECT user_id FROM runs WHERE id = ANY(:ids) AND status NOT IN"
                " ('done', 'failed', 'cancelled')",
                ids=list(self.current.values()),
            )
        }
        idle = [u for u in self.users if u not in busy]
        self.waves += 1
        wave = self.waves

        def make_input(i: int) -> dict[str, Any]:
            return {
                "text": f"{idle[i]} wave {wave}",
                "demo": {"tokens": cfg.tokens, "delay_ms": cfg.delay_ms},
            }

        if idle:
            loaded = self.loader.insert(len(idle), idle, make_input)
            self.loader.publish(loaded)
            self.current.update(zip(loaded.users, loaded.run_ids, strict=True))
        ids = list(self.current.values())

        def streaming_long_enough() -> bool:
            row = self.loader.query(
                "SELECT count(*) FILTER (WHERE status = 'streaming') AS n,"
                " extract(epoch FROM max(first_chunk_at)) AS newest"
                " FROM runs WHERE id = ANY(:ids)",
                ids=ids,
            )[0]
            return row.n == len(ids) and time.time() - float(row.newest) >= cfg.lead_s

        wait_until(streaming_long_enough, timeout=120, interval=0.2, what="runs streaming")

    def act(self, action: Callable[[], object], victim: str | None = None) -> None:
        """Top up the load, note what is in flight, then ``action`` (which stops
        ``victim``, if given)."""
        self.top_up()
        ids = list(self.current.values())
        rows = self.loader.query(
            "SELECT id, partition, attempt FROM runs WHERE id = ANY(:ids)", ids=ids
        )
        step = Step(
            time.time(),
            {r.id: r.partition for r in rows},
            {r.id: r.attempt for r in rows},
            victim,
        )
        if self.steps:
            self.steps[-1].until = step.at
        self.steps.append(step)
        action()

    # ------------------------------------------------------------ figures

    def measure(self, settings: Settings, timeline: Timeline, end: float) -> dict[str, Any]:
        self.steps[-1].until = end
        engine = sync_engine(settings)
        run_ids = list({r for s in self.steps for r in s.in_flight})
        try:
            with engine.connect() as conn:
                runs = {
                    r.id: r
                    for r in conn.execute(
                        text("SELECT id, partition, attempt, status FROM runs WHERE id = ANY(:i)"),
                        {"i": run_ids},
                    ).all()
                }
                msgs: dict[str, list[tuple[int, str, int, float]]] = defaultdict(list)
                for m in conn.execute(
                    text(
                        "SELECT run_id, seq, kind, attempt, extract(epoch FROM created_at) AS at"
                        " FROM messages WHERE run_id = ANY(:i) ORDER BY run_id, seq"
                    ),
                    {"i": run_ids},
                ).all():
                    msgs[m.run_id].append((m.seq, m.kind, m.attempt, float(m.at)))
        finally:
            engine.dispose()

        moved, refenced = timeline.changes(self.steps[0].at, end)
        cut_staying: set[str] = set()
        cut_moved: set[str] = set()
        for run_id, rows in msgs.items():
            p = runs[run_id].partition
            for prev, cur in zip(rows, rows[1:], strict=False):
                if cur[1] != "reset":
                    continue
                same = timeline.holder(p, prev[3]) == timeline.holder(p, cur[3])
                (cut_staying if same else cut_moved).add(run_id)

        pauses: list[float] = []
        resumes: list[float] = []
        victim_resumes: list[float] = []
        for step in self.steps:
            step_moved, _ = timeline.changes(step.at, step.until)
            for run_id, p in step.in_flight.items():
                rows = msgs.get(run_id, [])
                if p not in step_moved:
                    gaps = [
                        b[3] - a[3]
                        for a, b in zip(rows, rows[1:], strict=False)
                        if step.at <= b[3] <= step.until
                    ]
                    if gaps:
                        pauses.append(max(gaps))
                    continue
                later = [m[3] for m in rows if m[2] > step.attempts[run_id] and m[3] <= step.until]
                if not later:
                    continue
                resumes.append(min(later) - step.at)
                if step.victim is not None and timeline.holder(p, step.at) == step.victim:
                    victim_resumes.append(min(later) - step.at)

        restarted = sum(1 for r in runs.values() if r.attempt > 1)
        return {
            "in_flight": len(run_ids),
            "steps": len(self.steps),
            "partitions_moved": sum(moved.values()),
            "partitions_refenced": sum(refenced.values()),
            "cut": len(cut_staying | cut_moved),
            "cut_staying": len(cut_staying),
            "cut_moved": len(cut_moved),
            "restarted": restarted,
            "restarted_share": restarted / len(run_ids) if run_ids else 0.0,
            "pause_staying_max_s": max(pauses) if pauses else None,
            "pause_staying_p50_s": statistics.median(pauses) if pauses else None,
            "staying_runs": len(pauses),
            "resume_moved_max_s": max(resumes) if resumes else None,
            "moved_runs": len(resumes),
            "victim_resume_max_s": max(victim_resumes) if victim_resumes else None,
            "victim_runs": len(victim_resumes),
            "not_done": sum(1 for r in runs.values() if r.status != "done"),
            "session_timeout_s": settings.session_timeout_s,
        }


# ---------------------------------------------------------------- the scenarios


def members(pool: WorkerPool) -> set[str]:
    return {w.worker_id for w in pool if w.alive() and w.worker_id}


def join(sc: Scenario, pool: WorkerPool) -> None:
    joiner = f"w{len(pool) + 1}"
    since = time.time()
    sc.act(lambda: pool.start(joiner))
    sc.settle(pool, members(pool), joiner, since)


def leave(sc: Scenario, pool: WorkerPool) -> None:
    sc.act(lambda: sc.stop(pool[0], signal.SIGTERM), pool[0].worker_id)


def rolling(sc: Scenario, pool: WorkerPool) -> None:
    for old in list(pool):
        assert old.worker_id is not None
        sc.act(functools.partial(sc.stop, old, signal.SIGTERM), old.worker_id)
        since = time.time()
        pool.start(old.worker_id)
        sc.settle(pool, members(pool), old.worker_id, since)


def kill(sc: Scenario, pool: WorkerPool) -> None:
    sc.act(lambda: sc.stop(pool[0], signal.SIGKILL), pool[0].worker_id)


ACTIONS: dict[str, Callable[[Scenario, WorkerPool], None]] = {
    "join": join,
    "leave": leave,
    "rolling": rolling,
    "kill": kill,
}


def run_scenarios(
    stack: StackInfo, names: list[str], config: Config, overrides: dict[str, Any]
) -> dict[str, dict[str, Any]]:
    """Each named scenario on a fresh namespace; its figures by name."""
    out = {}
    for name in names:
        started = time.monotonic()
        out[name] = Scenario(stack, name, config, overrides).run()
        print(
            f"  {LABELS[name]}: {time.monotonic() - started:.0f} s, {out[name]}",
            flush=True,
        )
    return out
