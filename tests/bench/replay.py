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
[min-max], and the ratio replay / raw taken within each repetition.

    make bench-replay                                   # 200,000 records, 3 repetitions
    python -m tests.bench.replay --records 50000        # a quicker look
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition

from koda_runtime.kafka import consumer_config, producer_config
from koda_runtime.lifecycle.chunks import chunk_key
from koda_runtime.lifecycle.ids import uuid7
from koda_runtime.schemas.records import RUN_CHUNK, chunk_value, headers_for
from koda_runtime.settings import Settings
from koda_runtime.topics.catalogue import RUN_CHUNKS, partition_for_key
from koda_runtime.topics.replay import ReplayOptions, run_replay
from tests.bench.common import Table, fmt, namespace, services

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


def raw_consume(settings: Settings, records: int) -> float:
    """Seconds to consume every record of the topic with a plain confluent-kafka consumer."""
    topic = settings.names.topic(RUN_CHUNKS)
    t0 = time.perf_counter()
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
        return time.perf_counter() - t0
    finally:
        consumer.close()


def replay_into_duckdb(settings: Settings, records: int, batch: int, folder: Path) -> float:
    """Seconds for ``koda replay run-chunks`` into a fresh DuckDB file."""
    path = folder / f"bench-{uuid7()}.duckdb"
    options = ReplayOptions(topics=(RUN_CHUNKS,), sink_url=f"duckdb:///{path}", batch_records=batch)
    t0 = time.perf_counter()
    summary = run_replay(settings, options)
    elapsed = time.perf_counter() - t0
    assert summary.records == records, (summary.records, records)
    assert summary.rows["chunks"] == records
    path.unlink()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=5000, help="records per sink transaction")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="koda-bench-replay-", dir="/tmp"))
    raw_rates: list[float] = []
    replay_rates: list[float] = []
    ratios: list[float] = []
    try:
        with services() as stack, namespace(stack, partitions=PARTITIONS) as settings:
            t0 = time.perf_counter()
            n = fill(settings, args.records)
            fill_s = time.perf_counter() - t0
            for _ in range(args.reps):
                raw = n / raw_consume(settings, n)
                replay = n / replay_into_duckdb(settings, n, args.batch, folder)
                raw_rates.append(raw)
                replay_rates.append(replay)
                ratios.append(replay / raw)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    table = Table(
        f"replay into DuckDB vs raw consume: {n:,} run.chunk/1 records, {PARTITIONS} partitions,"
        f" batch {args.batch}, cores={os.cpu_count()} (median [min-max] of {args.reps})",
        ["measure", "value"],
    )
    table.add("raw confluent-kafka consume (records/s)", fmt(raw_rates))
    table.add("koda replay into DuckDB (records/s)", fmt(replay_rates))
    table.add("ratio replay / raw", fmt(ratios, 3))
    table.notes.append(f"filled the topic in {fill_s:.1f} s")
    table.notes.append("each ratio is taken within one repetition; the replay includes decoding,")
    table.notes.append("upserts of chunks and outputs, and one transaction per batch")
    print(table.render())


if __name__ == "__main__":
    main()
