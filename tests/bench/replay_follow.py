"""``koda replay --follow`` under W1 load: how far behind the topics the warehouse stays.

Each repetition is one fresh namespace (32 partitions) with ``--workers`` koda workers
and two phases, in ABBA order over the repetitions:

* ``alone``: W1 (demo runs of 16 chunks of about 8 bytes, no delay, inserted into
  Postgres and produced to the runs topic as the ``koda worker`` contender of
  tests/bench/w1_throughput.py does): runs/s;
* ``following``: two ``koda replay --follow --job NAME`` child processes, one
  ``--to duckdb:///...`` and one ``--to iceberg:///...`` (a local SQL catalog), every
  topic, started and caught up with what the topics hold; then W1 again: runs/s, and
  each run's lag per sink.

The lag of a run is the time its output row is in the warehouse, complete (with its
end), less its ``finished_at`` in Postgres. The row's time is read from outside the
replay, without opening its warehouse (a DuckDB file has one writer): a named job
commits a batch's offsets only after the sink committed its rows (engine.py), and a
following one commits them as soon as the write is over (writer.py), so the first
time, polled every :data:`POLL_S`, that the job's committed offset on the chunk
partition passes the run's terminal chunk record is when the row was there at the
latest: an upper bound, by at most the polling interval. The terminal records'
offsets are read from the chunk topic afterwards.

Printed: p50 / p95 / max lag per sink beside the 10 s target (met when the max is
within it), W1's runs/s alone and with the followers, and their ratio per repetition.

    make bench-replay-follow                               # 6,000 runs, 1 repetition
    python -m tests.bench.replay_follow --runs 6000 --repeat 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, TopicPartition

from koda_runtime.kafka import consumer_config
from koda_runtime.lifecycle.chunks import TERMINAL_KINDS, split_chunk_key
from koda_runtime.localstack import StackInfo
from koda_runtime.settings import Settings
from koda_runtime.topics.catalogue import RUN_CHUNKS
from koda_runtime.topics.replay.positions import Earliest
from koda_runtime.topics.replay.reader import open_reader, plan
from tests.bench.common import (
    Loader,
    Table,
    cpu_seconds,
    demo_input,
    fmt,
    namespace,
    percentile,
    services,
)
from tests.fixtures.processes import ChildProcess, WorkerProcess, koda_argv, settings_env

PARTITIONS = 32
TOKENS = 16
TARGET_S = 10.0
POLL_S = 0.1
SINKS = ("duckdb", "iceberg")
ENDS = {k.value for k in TERMINAL_KINDS}


class Follower:
    """One ``koda replay --follow --job`` child into a fresh warehouse under ``folder``."""

    def __init__(self, settings: Settings, sink: str, folder: Path) -> None:
        self.sink, self.job = sink, f"bench-follow-{sink}"
        url = f"duckdb:///{folder / 'w.duckdb'}" if sink == "duckdb" else f"iceberg:///{folder}"
        argv = [*koda_argv("replay"), "--follow", "--job", self.job, "--to", url, "--quiet"]
        self.proc = ChildProcess(f"replay-{sink}", argv, settings_env(settings))
        self.group = settings.names.replay_group(self.job)

    def start(self) -> Follower:
        self.proc.start()
        return self


class Committed:
    """The committed offsets of each follower's group on the chunk topic, polled every
    :data:`POLL_S` on a thread: (time, {partition: next offset}) samples per sink."""

    def __init__(self, settings: Settings, followers: list[Follower]) -> None:
        self.topic = settings.names.topic(RUN_CHUNKS)
        self.tps = [TopicPartition(self.topic, p) for p in range(settings.partitions)]
        self.consumers = {
            f.sink: Consumer(consumer_config(settings, "bench-follow", f.group)) for f in followers
        }
        self.samples: dict[str, list[tuple[float, dict[int, int]]]] = {
            s: [] for s in self.consumers
        }
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self.stop.is_set():
            for sink, consumer in self.consumers.items():
                got = consumer.committed(self.tps, timeout=10)
                self.samples[sink].append((time.time(), {x.partition: x.offset for x in got}))
            self.stop.wait(POLL_S)

    def latest(self, sink: str) -> dict[int, int]:
        return self.samples[sink][-1][1] if self.samples[sink] else {}

    def close(self) -> None:
        self.stop.set()
        self.thread.join(30)
        for c in self.consumers.values():
            c.close()


def chunk_ends(settings: Settings) -> dict[int, int]:
    """The chunk topic's high watermark per partition."""
    reader = open_reader(settings, None)
    try:
        planned = plan(reader, [settings.names.topic(RUN_CHUNKS)], Earliest(), job=False)
        return {p: end for (_, p), end in planned.ends.items()}
    finally:
        reader.close()


def terminal_offsets(settings: Settings, runs: set[str]) -> dict[str, tuple[int, int]]:
    """(partition, offset) of each run's terminal chunk record (else its final record)."""
    reader = open_reader(settings, None)
    found: dict[str, tuple[int, int]] = {}
    finals: dict[str, tuple[int, int]] = {}
    try:
        planned = plan(reader, [settings.names.topic(RUN_CHUNKS)], Earliest(), job=False)
        reader.assign(planned.starts, planned.ends)
        for msg in reader.records():
            run_id, seq = split_chunk_key((msg.key() or b"").decode())
            if run_id not in runs or msg.value() is None:
                continue
            where = (msg.partition() or 0, msg.offset() or 0)
            if seq is None:
                finals.setdefault(run_id, where)
            elif json.loads(msg.value() or b"{}").get("kind") in ENDS:
                found.setdefault(run_id, where)
    finally:
        reader.close()
    return finals | found


def caught_up(committed: Committed, sink: str, ends: dict[int, int]) -> bool:
    got = committed.latest(sink)
    return all(got.get(p, -1) >= end for p, end in ends.items() if end > 0)


def wait_caught_up(
    committed: Committed, followers: list[Follower], ends: dict[int, int], timeout: float
) -> None:
    deadline = time.monotonic() + timeout
    while not all(caught_up(committed, f.sink, ends) for f in followers):
        for f in followers:
            f.proc.check()
        if time.monotonic() > deadline:
            late = [f.sink for f in followers if not caught_up(committed, f.sink, ends)]
            raise AssertionError(f"followers {late} not caught up after {timeout:.0f} s")
        time.sleep(POLL_S)


def lags(
    committed: Committed, sink: str, where: dict[str, tuple[int, int]], finished: dict[str, float]
) -> tuple[list[float], int]:
    """Each run's lag (s) on ``sink``, and how many runs never showed up."""
    pending = dict(where)
    out: list[float] = []
    for at, offsets in committed.samples[sink]:
        for run_id, (p, offset) in list(pending.items()):
            if offsets.get(p, -1) > offset:
                out.append(at - finished[run_id])
                del pending[run_id]
        if not pending:
            break
    return out, len(pending)


def w1(loader: Loader, runs: int, users: int, alive: Any) -> tuple[dict[str, float], list[str]]:
    loaded = loader.insert(runs, users, lambda i: demo_input(i, TOKENS), prefix="u")
    t0 = time.time()
    loader.publish(loaded)
    loader.wait_terminal(loaded.run_ids, max(600.0, runs / 5), "w1", alive)
    return loader.outcome(loaded.run_ids, t0), loaded.run_ids


def repetition(stack: StackInfo, args: argparse.Namespace, rep: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    folder = Path(tempfile.mkdtemp(prefix="koda-bench-follow-", dir="/tmp"))
    with namespace(stack, partitions=PARTITIONS, chunk_batch_ms=20) as settings:
        workers = [WorkerProcess(settings, f"w{i}").start() for i in range(args.workers)]
        loader = Loader(settings)
        followers: list[Follower] = []
        committed: Committed | None = None

        def alive() -> None:
            for w in workers:
                w.check()
            for f in followers:
                f.proc.check()

        try:
            warm = loader.insert(PARTITIONS, PARTITIONS, lambda i: demo_input(i, 1), "warm")
            loader.publish(warm)
            loader.wait_terminal(warm.run_ids, 120, "warm-up", alive)
            for phase in ("alone", "following") if rep % 2 == 0 else ("following", "alone"):
                if phase == "alone":
                    alone, _ = w1(loader, args.runs, args.users, alive)
                    out["alone"] = alone
                    print(f"  rep {rep + 1} alone: {alone['runs_s']:.0f} runs/s", flush=True)
                    continue
                for sink in SINKS:
                    (folder / sink).mkdir(parents=True)
                followers = [Follower(settings, s, folder / s).start() for s in SINKS]
                committed = Committed(settings, followers)
                committed.thread.start()
                t = time.monotonic()
                wait_caught_up(committed, followers, chunk_ends(settings), args.catch_up)
                print(f"  rep {rep + 1} followers caught up in {time.monotonic() - t:.1f} s")
                cpu0 = {f.sink: cpu_seconds(f.proc.pid) for f in followers}
                figures, ids = w1(loader, args.runs, args.users, alive)
                res: dict[str, Any] = dict(figures)
                # every run's row in both warehouses (or the drain's timeout)
                ends = chunk_ends(settings)
                try:
                    wait_caught_up(committed, followers, ends, args.drain)
                except AssertionError as exc:
                    print(f"  rep {rep + 1}: {exc}", flush=True)
                res["follower_cpu_s"] = {
                    f.sink: cpu_seconds(f.proc.pid) - cpu0[f.sink] for f in followers
                }
                for f in followers:
                    f.proc.stop()
                committed.close()
                rows = loader.query(
                    "SELECT id, extract(epoch FROM finished_at) AS fin"
                    " FROM runs WHERE id = ANY(:i)",
                    i=ids,
                )
                finished = {r.id: float(r.fin) for r in rows}
                where = terminal_offsets(settings, set(ids))
                for sink in SINKS:
                    res[f"lag_{sink}"], res[f"missing_{sink}"] = lags(
                        committed, sink, where, finished
                    )
                out["following"] = res
                followers = []
                print(
                    f"  rep {rep + 1} following: {res['runs_s']:.0f} runs/s, lag p95 "
                    + ", ".join(f"{s} {percentile(res[f'lag_{s}'], 0.95):.2f} s" for s in SINKS),
                    flush=True,
                )
        finally:
            for f in followers:
                f.proc.kill()
            if committed is not None:
                committed.close()
            for w in workers:
                w.stop()
            loader.close()
            shutil.rmtree(folder, ignore_errors=True)
    out["load1"] = os.getloadavg()[0]
    return out


def run(stack: StackInfo, args: argparse.Namespace) -> Table:
    reps = [repetition(stack, args, rep) for rep in range(args.repeat)]
    table = Table(
        f"koda replay --follow under W1: {args.runs} runs x {TOKENS} chunks, {args.workers}"
        f" workers, {PARTITIONS} partitions, {args.repeat} repetition(s), cores={os.cpu_count()}"
        " (median [min-max] of the repetitions)",
        ["measure", "duckdb", "iceberg"],
    )
    for q, label in ((0.5, "p50"), (0.95, "p95"), (1.0, "max")):
        table.add(
            f"lag {label} (s): output row in the warehouse - finished_at",
            *(fmt([percentile(r["following"][f"lag_{s}"], q) for r in reps], 2) for s in SINKS),
        )
    table.add(
        f"goal: max lag <= {TARGET_S:.0f} s",
        *(
            "met"
            if all(
                r["following"][f"missing_{s}"] == 0
                and max(r["following"][f"lag_{s}"], default=float("inf")) <= TARGET_S
                for r in reps
            )
            else "not met"
            for s in SINKS
        ),
    )
    table.add(
        "runs never seen in the warehouse",
        *(str(sum(r["following"][f"missing_{s}"] for r in reps)) for s in SINKS),
    )
    table.add(
        "follower CPU (ms per W1 run)",
        *(
            fmt([1000 * r["following"]["follower_cpu_s"][s] / args.runs for r in reps], 1)
            for s in SINKS
        ),
    )
    alone = [r["alone"]["runs_s"] for r in reps]
    busy = [r["following"]["runs_s"] for r in reps]
    table.notes.append(
        f"W1 runs/s alone {fmt(alone)}, with both followers {fmt(busy)},"
        f" ratio with / alone {fmt([b / a for a, b in zip(alone, busy, strict=True)], 2)}"
    )
    table.notes.append(
        f"lag: an upper bound (the job's committed offsets, polled every {POLL_S} s, pass"
        " the run's terminal chunk record; offsets are committed after the rows)"
    )
    table.notes.append(
        "1-minute load average after each repetition: "
        + ", ".join(f"{r['load1']:.1f}" for r in reps)
    )
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=6000)
    ap.add_argument("--users", type=int, default=2000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--catch-up", type=float, default=120.0, help="s for the followers to start")
    ap.add_argument("--drain", type=float, default=120.0, help="s for them to finish after W1")
    args = ap.parse_args()
    with services() as stack:
        print(run(stack, args).render())


if __name__ == "__main__":
    main()
