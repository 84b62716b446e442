"""The cost of one streamed run, and a check of a capacity model built from it.

Two measurements of the same closed-loop workload: ``streams`` users, each with one
answer streaming at any time (it submits through the gateway, reads the answer's SSE
stream to its end, and submits the next), the openai handler against the model server
of W4 (tests/bench/model_timing.py: first token after 300-800 ms, 30-60 tokens/s,
200-800 tokens).

1. **calibrate** (1 broker, 2 workers, ``--calibrate-streams``): what one chunk event
   delivered to a viewer costs, over ``--hold`` seconds: worker, gateway, Kafka and
   Postgres CPU, Postgres transactions and rows written, Kafka records produced. (A run
   straddles the hold's edges; its chunk events do not, so they are the unit.)
2. **check** (3 brokers, 4 workers, ``--check-streams``): the model predicts the
   same figures from the calibration's cost per chunk event times the chunk events the
   check delivers, and the check measures them; the table prints predicted, measured
   and measured / predicted side by side.

    python -m tests.bench.capacity                       # both, the reported sizes
    python -m tests.bench.capacity --hold 30 --calibrate-streams 40 --check-streams 80
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from confluent_kafka import Consumer, TopicPartition
from sqlalchemy import text

from koda_runtime.kafka import consumer_config
from koda_runtime.localstack import StackInfo, down, up
from koda_runtime.schemas.db import sync_engine
from koda_runtime.settings import Settings
from koda_runtime.topics.catalogue import catalogue
from tests.bench.common import ServiceCpu, cpu_seconds, namespace, wait_group
from tests.bench.model_timing import Shape
from tests.bench.w4_assistant import model_stats, python_child, wait_http
from tests.fixtures.processes import GatewayProcess, WorkerProcess, free_port

MODEL = "capacity-model"
PARTITIONS = 64
ENDS = (b"done", b"error", b"cancelled")


@dataclass
class Tally:
    runs: int = 0
    tokens: int = 0
    failed: int = 0
    open: int = 0
    most_open: int = 0


@dataclass
class Phase:
    """What one measurement costs, over its hold."""

    name: str
    brokers: int
    workers: int
    streams: int
    seconds: float = 0.0
    runs: int = 0
    tokens: int = 0
    failed: int = 0
    cpu: dict[str, float] = field(default_factory=dict)  # worker, gateway, kafka, postgres
    pg: dict[str, float] = field(default_factory=dict)  # commits, rows
    records: float = 0.0
    machine_busy: float = 0.0  # CPU seconds the whole machine was busy

    def per_chunk(self) -> dict[str, float]:
        """Each figure per chunk event delivered to a viewer in the hold: the unit the
        hold measures whole (a run spans the hold's edges; its chunks do not)."""
        n = max(1, self.tokens)
        out = {f"{k} CPU ms": 1000 * v / n for k, v in self.cpu.items()}
        out.update({f"Postgres {k}": v / n for k, v in self.pg.items()})
        out["Kafka records"] = self.records / n
        return out

    def totals(self) -> dict[str, float]:
        out = {f"{k} CPU ms": 1000 * v for k, v in self.cpu.items()}
        out.update({f"Postgres {k}": v for k, v in self.pg.items()})
        out["Kafka records"] = self.records
        return out


def machine_busy_s() -> float:
    """CPU seconds every core of this machine has spent busy since boot."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    values = [int(v) for v in fields]
    idle = values[3] + values[4]  # idle + iowait
    return (sum(values[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def pg_counters(settings: Settings) -> dict[str, float]:
    engine = sync_engine(settings)
    try:
        with engine.connect() as conn:
            row = conn.execute(
                text(
                    "SELECT xact_commit, tup_inserted + tup_updated + tup_deleted AS rows"
                    " FROM pg_stat_database WHERE datname = current_database()"
                )
            ).one()
        return {"commits": float(row.xact_commit), "rows": float(row.rows)}
    finally:
        engine.dispose()


def kafka_records(settings: Settings) -> float:
    """The sum of every namespace topic's end offsets."""
    consumer = Consumer(consumer_config(settings, "capacity", None) | {"group.id": "unused"})
    try:
        total = 0
        for spec in catalogue(settings):
            md = consumer.list_topics(spec.name, timeout=10).topics.get(spec.name)
            if md is None:
                continue
            for p in md.partitions:
                _, high = consumer.get_watermark_offsets(
                    TopicPartition(spec.name, p), timeout=10, cached=False
                )
                total += max(0, high)
        return float(total)
    finally:
        consumer.close()


async def one_user(
    session: aiohttp.ClientSession, url: str, user: str, stop_at: float, tally: Tally
) -> None:
    """Ask, read the answer to its end, ask again, until ``stop_at``."""
    auth = {"Authorization": f"Bearer dev:{user}"}
    while time.monotonic() < stop_at:
        prompt = f"plan={uuid.uuid4().hex} what should I know about {user}?"
        async with session.post(
            f"{url}/v1/runs", json={"input": {"text": prompt}}, headers=auth
        ) as r:
            got = await r.json()
            if r.status != 202:
                tally.failed += 1
                await asyncio.sleep(1.0)
                continue
        tally.open += 1
        tally.most_open = max(tally.most_open, tally.open)
        ended = b""
        try:
            async with session.get(f"{url}/v1/runs/{got['run_id']}/events", headers=auth) as r:
                buf = b""
                async for data in r.content.iter_any():
                    buf += data
                    *frames, buf = buf.split(b"\n\n")
                    for fr in frames:
                        kind = _event(fr)
                        if kind == b"chunk":
                            tally.tokens += 1
                        elif kind in ENDS:
                            ended = kind
        finally:
            tally.open -= 1
        if ended == b"done":
            tally.runs += 1
        else:
            tally.failed += 1


def _event(frame: bytes) -> bytes:
    for line in frame.split(b"\n"):
        if line.startswith(b"event:"):
            return line[6:].strip()
    return b""


async def drive(url: str, users: list[str], seconds: float, tally: Tally) -> None:
    stop_at = time.monotonic() + seconds
    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=120)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        await asyncio.gather(*(one_user(session, url, u, stop_at, tally) for u in users))


@contextmanager
def stack_of(brokers: int) -> Iterator[StackInfo]:
    state = Path(tempfile.mkdtemp(prefix=f"koda-capacity-{brokers}b-", dir="/tmp"))
    try:
        yield up(state, brokers=brokers)
    finally:
        down(state)
        shutil.rmtree(state, ignore_errors=True)


def measure(
    phase: Phase, warm_s: float, hold_s: float, seed: int, window_ms: int, coalesce: bool
) -> Phase:
    """One phase on a stack of its own: warm up, then measure over ``hold_s``."""
    replicas = min(3, phase.brokers)
    with (
        stack_of(phase.brokers) as stack,
        namespace(
            stack,
            partitions=PARTITIONS,
            chunk_batch_ms=window_ms,
            handler="openai",
            replication_factor=replicas,
            min_insync_replicas=max(1, replicas - 1),
        ) as settings,
    ):
        port = free_port()
        model = python_child(
            "capacity-model", "tests.bench.model_timing", "--port", str(port), "--seed", str(seed)
        )
        model_url = f"http://127.0.0.1:{port}"
        env = {
            "KODA_OPENAI_BASE_URL": model_url,
            "KODA_OPENAI_MODEL": MODEL,
            "KODA_MEMORY": "false",
            "KODA_CHUNK_COALESCE": "true" if coalesce else "false",
        }
        gw = GatewayProcess(
            settings, {**env, "KODA_RATE_PER_S": "1000000", "KODA_RATE_BURST": "1000000"}
        )
        workers = [WorkerProcess(settings, f"cap{i}", env) for i in range(phase.workers)]
        service_cpu = ServiceCpu(stack)
        try:
            model.start()
            wait_http(model, f"{model_url}/stats")
            gw.start()
            for w in workers:
                w.start()
            wait_group(settings, settings.names.group(settings.worker_group), phase.workers, 300)
            users = [f"cap-{phase.name}-{i}" for i in range(phase.streams)]
            warm = Tally()
            asyncio.run(drive(gw.url, users, warm_s, warm))
            # The measured window: the same users go on; costs are deltas over it.
            pids = {"worker": [w.pid for w in workers], "gateway": [gw.pid]}
            cpu0 = {k: sum(cpu_seconds(p) for p in v) for k, v in pids.items()}
            svc0 = service_cpu.snapshot()
            pg0, rec0, busy0 = pg_counters(settings), kafka_records(settings), machine_busy_s()
            started = time.monotonic()
            tally = Tally()
            asyncio.run(drive(gw.url, users, hold_s, tally))
            phase.seconds = time.monotonic() - started
            pg1, rec1, busy1 = pg_counters(settings), kafka_records(settings), machine_busy_s()
            phase.cpu = {
                k: sum(cpu_seconds(p) for p in v) - cpu0[k] for k, v in pids.items()
            } | service_cpu.since(svc0)
            phase.pg = {k: pg1[k] - pg0[k] for k in pg0}
            phase.records = rec1 - rec0
            phase.machine_busy = busy1 - busy0
            phase.runs, phase.tokens, phase.failed = tally.runs, tally.tokens, tally.failed
            late = model_stats(model_url)
            print(
                f"{phase.name}: {phase.streams} streams (most open {tally.most_open}),"
                f" {phase.runs} runs done, {phase.failed} not, over {phase.seconds:.0f} s;"
                f" model server lateness {late}",
                flush=True,
            )
        finally:
            for w in workers:
                w.stop()
            gw.stop()
            model.stop()
    return phase


def predicted(calibration: Phase, check: Phase) -> dict[str, float]:
    """The check's figures as the model predicts them: the calibration's cost per chunk
    event delivered times the chunk events the check delivered."""
    return {k: v * check.tokens for k, v in calibration.per_chunk().items()}


def table(calibration: Phase, check: Phase) -> str:
    want = predicted(calibration, check)
    got = check.totals()
    lines = [
        f"{'per chunk (calibration)':<28}{'':>12}   check: {'predicted':>12} {'measured':>12}"
        f" {'measured/predicted':>20}"
    ]
    for k, v in calibration.per_chunk().items():
        ratio = got[k] / want[k] if want[k] else float("nan")
        lines.append(f"{k:<28}{v:>12.4f}   {'':>7}{want[k]:>12.1f} {got[k]:>12.1f} {ratio:>20.2f}")
    for ph in (calibration, check):
        lines.append(
            f"{ph.name}: {ph.tokens} chunk events delivered, {ph.runs} runs done in "
            f"{ph.seconds:.0f} s ({ph.tokens / max(1, ph.seconds):.0f} chunk events/s)"
        )
    lines.append(
        f"machine busy (cores): calibration {calibration.machine_busy / calibration.seconds:.2f},"
        f" check {check.machine_busy / check.seconds:.2f} of {os.cpu_count()}"
    )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m tests.bench.capacity")
    ap.add_argument("--calibrate-streams", type=int, default=60)
    ap.add_argument("--check-streams", type=int, default=120)
    ap.add_argument("--warm", type=float, default=20.0)
    ap.add_argument("--hold", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--window-ms", type=int, default=50, help="KODA_CHUNK_BATCH_MS, as W4")
    ap.add_argument(
        "--coalesce",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="KODA_CHUNK_COALESCE, as W4 (--no-coalesce: one chunk per token)",
    )
    args = ap.parse_args()
    shape = Shape()
    print(
        f"model timing: {shape}; KODA_CHUNK_BATCH_MS={args.window_ms}, "
        f"KODA_CHUNK_COALESCE={str(args.coalesce).lower()}",
        flush=True,
    )
    how = (args.warm, args.hold, args.seed, args.window_ms, args.coalesce)
    calibration = measure(Phase("calibrate", 1, 2, args.calibrate_streams), *how)
    check = measure(Phase("check", 3, 4, args.check_streams), *how)
    print(table(calibration, check))
    if calibration.failed or check.failed:
        print(f"runs not done: calibration {calibration.failed}, check {check.failed}")
        sys.exit(1)


if __name__ == "__main__":
    main()
