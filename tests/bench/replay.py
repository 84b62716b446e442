"""Replay throughput into DuckDB against the raw consume rate of the same topic.

The bench fills a fresh ``<env>.koda.run-chunks`` (32 partitions) with ``--records``
chunk records shaped like a worker's (runs of 20 chunks ending in ``done``, the
``run.chunk/1`` value and headers), then, ``--reps`` times, on the same machine and
broker:

* raw: a confluent-kafka consumer assigns every partition from the beginning and
  consumes until it has every record (nothing decoded, nothing written), and
* replay: ``koda replay run-chunks --to duckdb:///...`` in this process (the CLI's code
  path, a fresh DuckDB file each time): decode, upsert chunks, rebuild outputs, one
  transaction per ``--batch`` records.

Both are wall-clock from creating the consumer to the last record (the replay also
opens its file and creates its tables). It prints records/s for each, median
[min-max], and the ratio replay / raw taken within each repetition, with the CPU each
used (this process's CPU time, librdkafka's threads included) and the load average.
Nothing else of the bench runs meanwhile: the topic is filled before the first
repetition, and the raw consumer and the replay take turns, so on a shared machine
they compete only with the broker and whatever else the machine runs (the load
average says how much that was). ``--json FILE`` also writes the figures.

    make bench-replay                                   # 200,000 records, 3 repetitions
    python -m tests.bench.replay --records 50000        # a quicker look

Before/after (``python -m tests.bench.compare --bench replay --before DIR``, DIR a
checkout with its own ``make install``): one filled topic; each repetition runs the
raw consumer, then ``koda replay run-chunks`` as a child process from DIR's
virtualenv and from this one, so both trees pay the same start-up and each ratio to
the raw rate comes from the same repetition.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition

from koda_runtime.kafka import consumer_config, producer_config
from koda_runtime.lifecycle.chunks import chunk_key
from koda_runtime.lifecycle.ids import uuid7
from koda_runtime.localstack import StackInfo
from koda_runtime.settings import Settings
from koda_runtime.topics.catalogue import RUN_CHUNKS, partition_for_key
from koda_runtime.topics.records.codec import RUN_CHUNK, chunk_value, headers_for
from koda_runtime.topics.replay import ReplayOptions, run_replay
from koda_runtime.topics.replay.engine import BATCH_RECORDS
from tests.bench.common import Table, fmt, namespace, services
from tests.fixtures.processes import ROOT, settings_env

PARTITIONS = 32
CHUNKS_PER_RUN = 20
WORDS = "the quick brown fox jumps over lazy dogs while kafka keeps every partition".split()


def fill(settings: Settings, records: int) -> int:
    """Produce ``records`` chunk records; return how many the topic holds."""
    topic = settings.names.topic(RUN_CHUNKS)
    producer = Producer(producer_config(settings, "bench") | {"linger.ms": 20})
    headers = headers_for(RUN_CHUNK)
    written = 0
    while written < records:
        run_id = uuid7()
        partition = partition_for_key(run_id.encode(), settings.partitions)
        for seq in range(min(CHUNKS_PER_RUN, records - written)):
            last = seq == CHUNKS_PER_RUN - 1
            kind, content = (
                ("done", '{"status": "done"}') if last else ("chunk", WORDS[seq % 12] + " ")
            )
            value = chunk_value(run_id, seq, kind, content, 1)
            while True:
                try:
                    producer.produce(
                        topic,
                        key=chunk_key(run_id, seq).encode(),
                        value=value,
                        headers=list(headers),
                        partition=partition,
                    )
                    break
                except BufferError:
                    producer.poll(0.05)
            written += 1
        producer.poll(0)
    assert producer.flush(120) == 0
    return written


def timed(fn: Callable[[], None]) -> tuple[float, float]:
    """Wall-clock and CPU seconds (this process, every thread) of ``fn()``."""
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


def raw_consume(settings: Settings, records: int) -> None:
    """Consume every record of the topic with a plain confluent-kafka consumer."""
    topic = settings.names.topic(RUN_CHUNKS)
    consumer = Consumer(
        consumer_config(settings, "bench-raw", settings.names.group("bench-raw"))
        | {"queued.max.messages.kbytes": 65536, "fetch.wait.max.ms": 100}
    )
    try:
        parts = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in parts])
        seen = 0
        while seen < records:
            for msg in consumer.consume(num_messages=1000, timeout=1.0):
                if msg.error() is None:
                    seen += 1
    finally:
        consumer.close()


def replay_into_duckdb(settings: Settings, records: int, batch: int, path: Path) -> None:
    """``koda replay run-chunks`` into a fresh DuckDB file at ``path``."""
    options = ReplayOptions(topics=(RUN_CHUNKS,), sink_url=f"duckdb:///{path}", batch_records=batch)
    summary = run_replay(settings, options)
    assert summary.records == records, (summary.records, records)
    assert summary.rows["chunks"] == records


def replay_into_iceberg(settings: Settings, records: int, batch: int, path: Path) -> None:
    """``koda replay run-chunks`` into fresh Iceberg tables (a local SQL catalog) at ``path``."""
    options = ReplayOptions(
        topics=(RUN_CHUNKS,), sink_url=f"iceberg:///{path}", batch_records=batch
    )
    summary = run_replay(settings, options)
    assert summary.records == records, (summary.records, records)


def load_note(loads: list[float]) -> str:
    return "1-minute load average at the start and after each repetition: " + ", ".join(
        f"{x:.1f}" for x in loads
    )


def child_cpu() -> float:
    """CPU seconds of the finished child processes."""
    use = resource.getrusage(resource.RUSAGE_CHILDREN)
    return use.ru_utime + use.ru_stime


def replay_cli(settings: Settings, root: Path, records: int, batch: int, path: Path) -> float:
    """``koda replay run-chunks`` from the checkout ``root`` (its .venv) into a fresh
    DuckDB file; returns the child's CPU seconds."""
    python = root / ".venv" / "bin" / "python"
    argv = [str(python), "-m", "koda_runtime.cli", "replay", "run-chunks", "--quiet"]
    argv += ["--to", f"duckdb:///{path}", "--batch", str(batch)]
    cpu = child_cpu()
    done = subprocess.run(  # noqa: S603 - our own interpreter and arguments
        argv, cwd=root, env=settings_env(settings), capture_output=True, text=True, timeout=3600
    )
    if done.returncode != 0 or f"replayed {records:,} records" not in done.stdout:
        raise RuntimeError(
            f"replay from {root} failed ({done.returncode}): {done.stdout}{done.stderr}"
        )
    return child_cpu() - cpu


def compare(before: Path, records: int, reps: int, batch: int) -> Table:
    """Before/after (see the module docstring): the raw rate, then each tree's replay."""
    trees = {"before": before.resolve(), "after": ROOT}
    rates: dict[str, list[float]] = {"raw": [], "before": [], "after": []}
    ratios: dict[str, list[float]] = {"before": [], "after": []}
    cpu: dict[str, list[float]] = {"raw": [], "before": [], "after": []}
    loads = [os.getloadavg()[0]]
    folder = Path(tempfile.mkdtemp(prefix="koda-bench-replay-", dir="/tmp"))
    try:
        with services() as stack, namespace(stack, partitions=PARTITIONS) as settings:
            n = fill(settings, records)
            for rep in range(reps):
                raw_s, raw_c = timed(lambda: raw_consume(settings, n))
                rates["raw"].append(n / raw_s)
                cpu["raw"].append(raw_c / n * 1e6)
                for label, root in trees.items():
                    path = folder / f"{label}-{uuid7()}.duckdb"
                    t0 = time.perf_counter()
                    used = replay_cli(settings, root, n, batch, path)
                    replay_s = time.perf_counter() - t0
                    path.unlink()
                    rates[label].append(n / replay_s)
                    ratios[label].append(raw_s / replay_s)
                    cpu[label].append(used / n * 1e6)
                    print(
                        f"  rep {rep + 1}/{reps} {label:6}: {n / replay_s:,.0f} records/s,"
                        f" ratio {raw_s / replay_s:.3f} (raw {n / raw_s:,.0f}/s)",
                        flush=True,
                    )
                loads.append(os.getloadavg()[0])
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    table = Table(
        f"Before/after: koda replay run-chunks into DuckDB (CLI child process), {n:,} records,"
        f" batch {batch}, {reps} repetitions (median [min-max]); before = {before}",
        ["measure", "before", "after", "after/before"],
    )
    pairs = zip(rates["before"], rates["after"], strict=True)
    table.add(
        "replay (records/s)",
        fmt(rates["before"]),
        fmt(rates["after"]),
        fmt([a / b for b, a in pairs], 2),
    )
    table.add("ratio replay / raw", fmt(ratios["before"], 3), fmt(ratios["after"], 3), "")
    table.add("replay CPU (us/record)", fmt(cpu["before"], 1), fmt(cpu["after"], 1), "")
    table.notes.append(
        f"raw confluent-kafka consume {fmt(rates['raw'])} records/s,"
        f" CPU {fmt(cpu['raw'], 1)} us/record"
    )
    table.notes.append(load_note(loads))
    return table


def measure(
    stack: StackInfo, records: int, reps: int, batch: int
) -> tuple[Table, dict[str, object]]:
    """Fill a fresh topic, then ``reps`` times the raw consume and the replay; the table
    and the figures (``--json``'s)."""
    folder = Path(tempfile.mkdtemp(prefix="koda-bench-replay-", dir="/tmp"))
    raw_rates: list[float] = []
    replay_rates: list[float] = []
    ratios: list[float] = []
    iceberg_rates: list[float] = []
    iceberg_ratios: list[float] = []
    raw_cpu: list[float] = []
    replay_cpu: list[float] = []
    loads = [os.getloadavg()[0]]
    try:
        with namespace(stack, partitions=PARTITIONS) as settings:
            t0 = time.perf_counter()
            n = fill(settings, records)
            fill_s = time.perf_counter() - t0
            for _ in range(reps):
                raw_s, raw_c = timed(lambda: raw_consume(settings, n))
                path = folder / f"bench-{uuid7()}.duckdb"
                replay_s, replay_c = timed(
                    lambda: replay_into_duckdb(settings, n, batch, path)  # noqa: B023
                )
                path.unlink()
                lake = folder / f"iceberg-{uuid7()}"
                iceberg_s, _ = timed(
                    lambda: replay_into_iceberg(settings, n, batch, lake)  # noqa: B023
                )
                shutil.rmtree(lake, ignore_errors=True)
                iceberg_rates.append(n / iceberg_s)
                iceberg_ratios.append(raw_s / iceberg_s)
                raw_rates.append(n / raw_s)
                replay_rates.append(n / replay_s)
                ratios.append(raw_s / replay_s)
                raw_cpu.append(raw_c / n * 1e6)
                replay_cpu.append(replay_c / n * 1e6)
                loads.append(os.getloadavg()[0])
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    table = Table(
        f"replay into DuckDB vs raw consume: {n:,} run.chunk/1 records, {PARTITIONS} partitions,"
        f" batch {batch}, cores={os.cpu_count()} (median [min-max] of {reps})",
        ["measure", "value"],
    )
    table.add("raw confluent-kafka consume (records/s)", fmt(raw_rates))
    table.add("koda replay into DuckDB (records/s)", fmt(replay_rates))
    table.add("ratio replay / raw", fmt(ratios, 3))
    table.add("koda replay into Iceberg, local SQL catalog (records/s)", fmt(iceberg_rates))
    table.add("ratio Iceberg replay / raw", fmt(iceberg_ratios, 3))
    table.add("raw consumer CPU (us/record)", fmt(raw_cpu, 1))
    table.add("replay CPU (us/record)", fmt(replay_cpu, 1))
    table.add("goal: ratio >= 0.25", "met" if statistics.median(ratios) >= 0.25 else "not met")
    table.notes.append(f"filled the topic in {fill_s:.1f} s")
    table.notes.append("each ratio is taken within one repetition; the replay includes decoding,")
    table.notes.append("upserts of chunks and outputs, and one transaction per batch")
    table.notes.append(load_note(loads))
    table.figures = {"replay_ratio": ratios, "replay_load1": loads[1:]}
    figures: dict[str, object] = {
        "records": n,
        "raw_records_s": raw_rates,
        "replay_records_s": replay_rates,
        "iceberg_records_s": iceberg_rates,
        "iceberg_ratio": iceberg_ratios,
        "ratio": ratios,
        "raw_cpu_us": raw_cpu,
        "replay_cpu_us": replay_cpu,
        "load_average": loads,
    }
    return table, figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--batch",
        type=int,
        default=BATCH_RECORDS,
        help="records per sink transaction (default: koda replay's)",
    )
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args()
    with services() as stack:
        table, figures = measure(stack, args.records, args.reps, args.batch)
    print(table.render())
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
