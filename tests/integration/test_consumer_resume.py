"""A consumer group with manual commits resumes exactly after its last commit."""

from __future__ import annotations

import time
from typing import Any

from confluent_kafka import Consumer, Producer, TopicPartition

from koda_runtime.kafka import consumer_config, producer_config
from koda_runtime.settings import Settings
from koda_runtime.topics.catalogue import RUNS


def consume(conf: dict, topic: str, count: int, deadline_s: float = 30.0) -> list:
    consumer = Consumer(conf)
    consumer.subscribe([topic])
    got: list[Any] = []
    deadline = time.monotonic() + deadline_s
    while len(got) < count and time.monotonic() < deadline:
        msg = consumer.poll(0.5)
        if msg is None or msg.error():
            continue
        got.append(msg)
    return [consumer, got]


def test_group_resumes_after_last_committed_offset(kafka_topics: Settings) -> None:
    topic = kafka_topics.names.topic(RUNS)
    producer = Producer(producer_config(kafka_topics, "test"))
    for i in range(20):
        producer.produce(topic, key=b"one-user", value=str(i).encode())
    assert producer.flush(30) == 0

    group = kafka_topics.names.group("resume-check")
    conf = consumer_config(kafka_topics, "test", group)
    consumer, first = consume(conf, topic, 20)
    assert [int(m.value()) for m in first] == list(range(20))
    # commit only through the 8th record (offset 7 -> committed position 8)
    seventh = first[7]
    consumer.commit(
        offsets=[TopicPartition(topic, seventh.partition(), seventh.offset() + 1)],
        asynchronous=False,
    )
    consumer.close()

    consumer2, second = consume(conf, topic, 12)
    assert [int(m.value()) for m in second] == list(range(8, 20))
    assert consumer2.poll(1.0) is None  # nothing beyond: no skip, no replay of 0..7
    consumer2.close()
