"""SSE benchmark: R runs x V viewers each = R*V concurrent streams on one gateway process.

Prints chunk latency from the worker's produce (the chunk record's Kafka timestamp,
set by the producer when it queues the record) to the viewer's receipt, p50/p99/max;
the gateway's RSS (idle with every stream open, and peak) and its CPU while the runs
stream. A plain consumer tailing the topic in the same process splits the latency into
the worker/broker share and the gateway's. Also checks every viewer received seq
0..end once, in order. Not a test: it asserts nothing about speed.

    make bench-sse                                  # 200 runs x 5 viewers = 1,000 streams
    python -m tests.bench.sse --runs 50 --viewers 4 --tokens 20

Viewers connect while the runs are pending (the runs are inserted but not published),
so every measured event is live, not replayed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import shutil
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
from confluent_kafka import Consumer, TopicPartition

from koda_runtime.gateway.eventstream import TERMINAL_KINDS, EventParser
from koda_runtime.kafka import consumer_config
from koda_runtime.localstack import StackInfo, down, up
from koda_runtime.schemas.migrate import upgrade
from koda_runtime.settings import Settings
from koda_runtime.topics.admin import apply_topics
from koda_runtime.topics.catalogue import RUN_CHUNKS
from tests.fixtures.namespaces import delete_topics, drop_schema, make_settings
from tests.fixtures.processes import GatewayProcess, WorkerProcess
from tests.fixtures.runs import Submitter, read_topic
from tests.support import wait_until


@dataclass
class ViewerLog:
    run_id: str
    received: list[tuple[int, float]] = field(default_factory=list)  # (seq, unix time s)
    done: bool = False
    error: str | None = None


async def view(host: str, port: int, user: str, log: ViewerLog, opened: list[int]) -> None:
    """One raw HTTP/1.1 SSE connection (chunked transfer decoding + the SSE parser)."""
    try:
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(
            f"GET /v1/runs/{log.run_id}/events HTTP/1.1\r\nHost: {host}\r\n"
            f"Authorization: Bearer dev:{user}\r\nAccept: text/event-stream\r\n\r\n".encode()
        )
        head = await reader.readuntil(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(head.split(b"\r\n")[0].decode())
        opened[0] += 1
        parser = EventParser()
        while not log.done:
            size = int((await reader.readuntil(b"\r\n")).strip(), 16)
            if size == 0:
                break
            data = await reader.readexactly(size + 2)
            now = time.time()
            for event in parser.feed(data[:-2]):
                if event.seq is not None:
                    log.received.append((event.seq, now))
                if event.event in TERMINAL_KINDS:
                    log.done = True
        writer.close()
    except Exception as exc:  # noqa: BLE001 - reported in the summary
        log.error = f"{type(exc).__name__}: {exc}"


class TailProbe:
    """A plain consumer of the chunk topic in a thread: when each record became readable.

    Splits the latency: produce -> consumable (worker, broker) versus the gateway's part.
    """

    def __init__(self, settings: Settings, runs: set[str]) -> None:
        self.topic = settings.names.topic(RUN_CHUNKS)
        conf = consumer_config(settings, "bench-probe", settings.names.group("bench-probe"))
        self.consumer = Consumer(conf | {"fetch.wait.max.ms": 10})
        self.runs = runs
        self.seen: dict[tuple[str, int], float] = {}
        self.stop = threading.Event()
        md = self.consumer.list_topics(self.topic, timeout=10).topics[self.topic]
        tps = []
        for p in md.partitions:
            _, high = self.consumer.get_watermark_offsets(TopicPartition(self.topic, p), 10)
            tps.append(TopicPartition(self.topic, p, high))
        self.consumer.assign(tps)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            first = self.consumer.poll(0.05)
            if first is None:
                continue
            for m in [first, *self.consumer.consume(500, 0)]:
                key = m.key()
                if m.error() is None and key:
                    run_id, _, seq = key.decode().rpartition(":")
                    if run_id in self.runs and seq.isdigit():
                        self.seen[(run_id, int(seq))] = time.time()
        self.consumer.close()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def run_viewers(
    gw: GatewayProcess, sub: Submitter, runs: dict[str, str], viewers: int, timeout_s: float
) -> tuple[list[ViewerLog], dict[str, float]]:
    logs = [ViewerLog(run_id) for run_id in runs for _ in range(viewers)]
    opened = [0]
    proc = psutil.Process(gw.proc.pid)  # type: ignore[union-attr]
    host, port = "127.0.0.1", gw.port
    gate = asyncio.Semaphore(100)

    async def connect(log: ViewerLog) -> None:
        async with gate:
            task = asyncio.create_task(view(host, port, runs[log.run_id], log, opened))
            while opened[0] == 0 and not task.done():
                await asyncio.sleep(0)
            await asyncio.sleep(0)
        await task

    t0 = time.monotonic()
    tasks = [asyncio.create_task(connect(log)) for log in logs]
    deadline = time.monotonic() + 120
    while metric(gw.url, "koda_sse_connections") < len(logs):
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {opened[0]}/{len(logs)} streams opened")
        await asyncio.sleep(0.2)
    figures = {"connect_s": time.monotonic() - t0, "rss_idle": proc.memory_info().rss}
    peak = [figures["rss_idle"]]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            stop.wait(0.25)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    cpu0 = sum(proc.cpu_times()[:2])
    t1 = time.monotonic()
    for run_id, user in runs.items():
        sub.publish(run_id, user)
    try:
        await asyncio.wait_for(asyncio.gather(*tasks), timeout_s)
    finally:
        stop.set()
        sampler.join()
    figures["stream_s"] = time.monotonic() - t1
    figures["cpu_s"] = sum(proc.cpu_times()[:2]) - cpu0
    figures["rss_peak"] = peak[0]
    figures["rss_after"] = proc.memory_info().rss
    return logs, figures


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--viewers", type=int, default=5, help="viewers per run")
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--delay-ms", type=int, default=50)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--partitions", type=int, default=32)
    args = ap.parse_args()

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = args.runs * args.viewers * 2 + 1024
    if soft < need:  # the gateway inherits it
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(need, hard), hard))

    state: Path | None = None
    if os.environ.get("KODA_KAFKA_BOOTSTRAP") and os.environ.get("KODA_DATABASE_URL"):
        info = StackInfo(os.environ["KODA_KAFKA_BOOTSTRAP"], os.environ["KODA_DATABASE_URL"], 1)
    else:
        state = Path(tempfile.mkdtemp(prefix="koda-bench-sse-", dir="/tmp"))
        info = up(state)
    settings = make_settings(
        info, partitions=args.partitions, chunk_batch_ms=10, max_inflight=args.partitions
    )
    upgrade(settings)
    apply_topics(settings)
    sub = Submitter(settings)
    gw = GatewayProcess(settings, {"KODA_RATE_PER_S": "100000", "KODA_RATE_BURST": "100000"})
    workers = [WorkerProcess(settings, f"bench-w{i}") for i in range(args.workers)]
    try:
        gw.start()
        for w in workers:
            w.start()
        warm = [
            sub.submit(f"warm-{i}", {"text": "warm", "demo": {"tokens": 1, "delay_ms": 0}})
            for i in range(args.partitions)
        ]
        wait_until(lambda: sub.all_terminal(warm), timeout=180, what="warm-up runs")
        inp = {"demo": {"tokens": args.tokens, "delay_ms": args.delay_ms}}
        runs = {}
        for i in range(args.runs):
            user = f"bench-{i}"
            runs[sub.submit(user, {"text": f"run {i}", **inp}, publish=False)] = user
        timeout = 600.0
        load_before = os.getloadavg()[0]
        probe = TailProbe(settings, set(runs))
        try:
            logs, fig = asyncio.run(run_viewers(gw, sub, runs, args.viewers, timeout))
        finally:
            probe.close()
        load_after = os.getloadavg()[0]
        produced = {}
        for m in read_topic(settings, settings.names.topic(RUN_CHUNKS), timeout=120):
            run_id, _, seq = m.key().decode().rpartition(":")
            if run_id in runs and seq.isdigit():
                produced[(run_id, int(seq))] = m.timestamp()[1] / 1000.0
        latencies, broken = [], 0
        for log in logs:
            seqs = [s for s, _ in log.received]
            if log.error or not log.done or seqs != list(range(len(seqs))):
                broken += 1
            latencies += [
                t - produced[(log.run_id, s)]
                for s, t in log.received
                if (log.run_id, s) in produced
            ]
        upstream = [t - produced[k] for k, t in probe.seen.items() if k in produced]
        events = sum(len(log.received) for log in logs)
        n = len(logs)
        print(
            f"sse: {args.runs} runs x {args.viewers} viewers = {n} concurrent streams on one "
            f"gateway; {args.tokens} chunks/run every {args.delay_ms} ms; {args.workers} "
            f"workers, {args.partitions} partitions; cores={os.cpu_count()}"
        )
        print(f"  streams opened in        {fig['connect_s']:8.2f} s")
        print(
            f"  streaming phase          {fig['stream_s']:8.2f} s  ({events} events delivered, "
            f"{events / fig['stream_s']:.0f}/s)"
        )
        print(
            f"  latency produce->viewer  p50 {statistics.median(latencies) * 1000:7.1f} ms   "
            f"p99 {pct(latencies, 0.99) * 1000:7.1f} ms   max {max(latencies) * 1000:7.1f} ms"
        )
        print(
            f"  produce->plain consumer  p50 {statistics.median(upstream) * 1000:7.1f} ms   "
            f"p99 {pct(upstream, 0.99) * 1000:7.1f} ms   (worker + broker share)"
        )
        print(
            f"  gateway RSS              idle with {n} streams {fig['rss_idle'] / 2**20:6.1f} "
            f"MiB, peak {fig['rss_peak'] / 2**20:6.1f} MiB, after {fig['rss_after'] / 2**20:6.1f}"
            f" MiB"
        )
        print(
            f"  gateway CPU              {fig['cpu_s']:8.2f} s over {fig['stream_s']:.2f} s "
            f"({100 * fig['cpu_s'] / fig['stream_s']:.0f}% of one core)"
        )
        print(f"  load average (1 min)     {load_before:.1f} before, {load_after:.1f} after")
        print(f"  viewers complete         {n - broken}/{n} (seq 0..end, once, in order)")
        errors = {log.error for log in logs if log.error}
        if errors:
            print(f"  errors                   {sorted(errors)[:3]}")
    finally:
        for w in workers:
            w.stop()
        gw.stop()
        sub.close()
        delete_topics(settings)
        drop_schema(settings)
        if state is not None:
            down(state)
            shutil.rmtree(state, ignore_errors=True)


if __name__ == "__main__":
    main()
