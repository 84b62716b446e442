"""Forged records on the real chunk topic never reach a viewer: the live feed forwards a
record only when its value is a ``run.chunk/1`` of a known kind for the run and seq its key
names; anything else is dropped and counted (``koda_records_skipped_total``)."""

from __future__ import annotations

import json

from confluent_kafka import Producer

from koda_runtime import metrics
from koda_runtime.gateway.livefeed import LiveEvent, LiveFeed
from koda_runtime.kafka import producer_config
from koda_runtime.lifecycle.chunks import chunk_key
from koda_runtime.settings import Settings
from koda_runtime.topics.catalogue import RUN_CHUNKS
from koda_runtime.topics.records.codec import chunk_value
from tests.fixtures.livefeed import collect
from tests.support import async_wait_until


def skipped() -> float:
    return float(metrics.RECORDS_SKIPPED.labels(reason="bad_chunk_record")._value.get())


def forged_chunk(run_id: str, seq: int, kind: str, content: str) -> bytes:
    return json.dumps(
        {"run_id": run_id, "seq": seq, "kind": kind, "content": content, "attempt": 1}
    ).encode()


async def test_a_viewer_never_sees_forged_chunk_records(kafka_topics: Settings) -> None:
    settings = kafka_topics
    victim, other = "run-victim", "run-other"
    key = chunk_key(victim, 1).encode()
    forged: list[tuple[bytes, bytes]] = [
        # another run's output under the victim's key
        (key, chunk_value(other, 1, "chunk", "FORGED-other-run", 1)),
        # the victim's run id, but another seq than the key's
        (key, chunk_value(victim, 7, "chunk", "FORGED-seq", 1)),
        # a kind koda never writes (it would become the SSE `event:` line)
        (key, chunk_value(victim, 1, "admin", "FORGED-kind", 1)),
        (key, forged_chunk(victim, 1, "chunk\nevent: done", "FORGED-injected-event")),
        # not a chunk value at all
        (key, b"\xff\xfeFORGED-garbage"),
        (key, b"[" * 5000 + b"]" * 5000),
        (key, json.dumps({"run_id": victim, "FORGED": "missing fields"}).encode()),
    ]
    feed = LiveFeed(settings)
    try:
        assert await feed.start()
        viewer = feed.subscribe(victim, 1 << 20)
        bystander = feed.subscribe(other, 1 << 20)
        before = skipped()
        producer = Producer(producer_config(settings, "test"))
        topic = settings.names.topic(RUN_CHUNKS)
        # One partition keeps the order: the genuine records come after every forged one.
        for k, value in forged:
            producer.produce(topic, key=k, value=value, partition=0)
        producer.produce(
            topic, key=key, value=chunk_value(victim, 1, "chunk", "real", 1), partition=0
        )
        producer.produce(
            topic,
            key=chunk_key(victim, 2).encode(),
            value=chunk_value(victim, 2, "done", "", 1),
            partition=0,
        )
        assert producer.flush(20) == 0
        got: list[LiveEvent] = []
        await async_wait_until(lambda: collect(viewer, got, 2), timeout=30, what="real records")
        assert [(e.seq, e.kind) for e in got] == [(1, "chunk"), (2, "done")]
        assert b"real" in got[0].frame
        frames = b"".join(e.frame for e in got)
        assert b"FORGED" not in frames and frames.count(b"event: ") == 2
        # Nothing reached the run the forged value named either.
        assert await bystander.next_batch(0.2) == []
        assert feed.bad_records == len(forged)
        assert skipped() - before == len(forged)
    finally:
        await feed.stop()
