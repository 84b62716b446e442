"""The gateway (librdkafka) and the workers (aiokafka) must agree on partitions."""

from __future__ import annotations

import asyncio

from aiokafka import AIOKafkaProducer
from confluent_kafka import Message, Producer

from koda_runtime.kafka import producer_config
from koda_runtime.settings import Settings
from koda_runtime.topics.catalogue import RUNS, partition_for_key

KEYS = [f"user-{i}" for i in range(200)] + ["", "a", "ünïcode-ユーザー", "x" * 300]


def key_and_partition(msg: Message) -> tuple[str, int]:
    key, partition = msg.key(), msg.partition()
    assert key is not None and partition is not None, "a delivered record has both"
    return key.decode(), partition


def produce_with_librdkafka(settings: Settings, topic: str) -> dict[str, int]:
    producer = Producer(producer_config(settings, "test"))
    placed: dict[str, int] = {}

    def on_delivery(err, msg) -> None:
        assert err is None, err
        placed[msg.key().decode()] = msg.partition()

    for key in KEYS:
        producer.produce(topic, key=key.encode(), value=b"x", on_delivery=on_delivery)
    assert producer.flush(30) == 0
    return placed


async def produce_with_aiokafka(settings: Settings, topic: str) -> dict[str, int]:
    producer = AIOKafkaProducer(bootstrap_servers=settings.kafka_bootstrap)
    await producer.start()
    try:
        placed = {}
        for key in KEYS:
            md = await producer.send_and_wait(topic, key=key.encode(), value=b"x")
            placed[key] = md.partition
        return placed
    finally:
        await producer.stop()


def test_librdkafka_and_aiokafka_put_each_key_in_the_same_partition(
    kafka_topics: Settings,
) -> None:
    topic = kafka_topics.names.topic(RUNS)
    rd = produce_with_librdkafka(kafka_topics, topic)
    aio = asyncio.run(produce_with_aiokafka(kafka_topics, topic))
    assert len(set(rd.values())) == kafka_topics.partitions  # keys spread over all partitions
    assert rd == aio
    assert rd == {k: partition_for_key(k.encode(), kafka_topics.partitions) for k in KEYS}


def test_librdkafka_default_partitioner_would_disagree(kafka_topics: Settings) -> None:
    """Guard for the guard: without the pinned partitioner the placement differs."""
    conf = producer_config(kafka_topics, "test")
    conf.pop("partitioner")
    producer = Producer(conf)
    placed: dict[str, int] = {}
    topic = kafka_topics.names.topic(RUNS)
    for key in KEYS:
        producer.produce(
            topic,
            key=key.encode(),
            value=b"x",
            on_delivery=lambda err, msg: placed.__setitem__(*key_and_partition(msg)),
        )
    assert producer.flush(30) == 0
    expected = {k: partition_for_key(k.encode(), kafka_topics.partitions) for k in KEYS}
    assert placed != expected
