"""W2's baseline: a raw confluent-kafka producer -> consumer on the chunk topic.

At the rate of the step it is compared with and on that step's run-chunks topic (same
partitions, same broker, right after the step, so the two never compete), a producer
thread produces ``run.chunk/1`` records of the demo handler's size, each stamped with
the wall clock at ``produce()``, on a fixed schedule; a consumer assigned to the end
of every partition receives them the way the gateway's live feed does (``poll``, then
what is already fetched). Latency: stamp -> the record handed to Python. Both use
koda's own client configuration (koda/kafka.py: the producer's ``linger.ms`` 2,
acks=all, idempotent; a plain consumer), so the gap between this and koda's yield ->
viewer figure is what koda's path adds: the worker's batching, its event loop, the
gateway's feed and SSE, the HTTP client.

The gateway's live feed tails the same topic and routes these records to no viewer.
"""

from __future__ import annotations

import threading
import time

from confluent_kafka import OFFSET_END, Consumer, Producer, TopicPartition

from koda_runtime.kafka import consumer_config, producer_config
from koda_runtime.lifecycle.chunks import chunk_key
from koda_runtime.lifecycle.ids import uuid7
from koda_runtime.settings import Settings
from koda_runtime.topics.catalogue import RUN_CHUNKS, partition_for_key
from koda_runtime.topics.records.codec import RUN_CHUNK, chunk_value, headers_for

TICK_S = 0.005  # the producer's schedule: rate * TICK_S records every 5 ms


def raw_latencies(settings: Settings, rate: float, seconds: float, runs: int = 64) -> list[float]:
    """Produce ``rate`` records/s for ``seconds``; produce -> consume latencies (s)."""
    topic = settings.names.topic(RUN_CHUNKS)
    consumer = Consumer(consumer_config(settings, "bench-raw", settings.names.group("bench-raw")))
    parts = consumer.list_topics(topic, timeout=10).topics[topic].partitions
    consumer.assign([TopicPartition(topic, p, OFFSET_END) for p in parts])
    # Until the assignment has resolved its end offsets, records could be skipped.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        consumer.poll(0.1)
        if all(tp.offset >= 0 for tp in consumer.position(consumer.assignment())):
            break
    producer = Producer(producer_config(settings, "bench-raw"))
    headers = headers_for(RUN_CHUNK)
    run_ids = [uuid7() for _ in range(runs)]
    total = int(rate * seconds)
    lat: list[float] = []
    done = threading.Event()

    def produce() -> None:
        t0 = time.monotonic()
        sent = 0
        tick = 0
        while sent < total:
            tick += 1
            due = min(total, int(rate * tick * TICK_S))
            while sent < due:
                run_id = run_ids[sent % runs]
                seq = sent // runs
                value = chunk_value(run_id, seq, "chunk", f"{time.time():.6f} word ", 1)
                try:
                    producer.produce(
                        topic,
                        key=chunk_key(run_id, seq).encode(),
                        value=value,
                        headers=list(headers),
                        partition=partition_for_key(run_id.encode(), len(parts)),
                    )
                    sent += 1
                except BufferError:
                    producer.poll(0.01)
            producer.poll(0)
            time.sleep(max(0.0, t0 + tick * TICK_S - time.monotonic()))
        producer.flush(30)
        done.set()

    thread = threading.Thread(target=produce, name="bench-raw-producer", daemon=True)
    thread.start()
    try:
        end = time.monotonic() + seconds + 30
        while len(lat) < total and time.monotonic() < end:
            # As the gateway's tail (topics/kafka/tail.py) does: poll returns with the first
            # record, then take what is already fetched without waiting for more.
            first = consumer.poll(0.2)
            if first is None:
                continue
            for msg in [first, *consumer.consume(num_messages=499, timeout=0)]:
                now = time.time()
                if msg.error() is not None:
                    continue
                value = msg.value() or b""
                at = value.find(b'"content":"')
                if at >= 0:
                    lat.append(now - float(value[at + 11 : value.index(b" ", at + 11)]))
        thread.join(30)
    finally:
        consumer.close()
    if len(lat) < total:
        raise AssertionError(f"raw baseline: {len(lat)}/{total} records consumed")
    return lat
