"""The worker's partition cursors against the real broker.

Faust can drop a fetched record around a rebalance while the consumer position has
already moved past it; with nothing committed for the partition, Faust then commits
the next record's offset over it. These tests drop a record the same way, between
the fetch and the chain, and show the cursor brings it back and holds the commit.
"""

from __future__ import annotations

from aiokafka import AIOKafkaConsumer, TopicPartition
from confluent_kafka import Producer
from confluent_kafka import TopicPartition as CkTopicPartition
from confluent_kafka.admin import AdminClient

from koda_runtime.kafka import aiokafka_security, producer_config
from koda_runtime.processors.cursor import PartitionCursors
from koda_runtime.settings import Settings
from koda_runtime.topics.catalogue import RUNS
from koda_runtime.topics.kafka.offsets import GroupOffsetReader

PARTITION = 2


def produce(settings: Settings, count: int) -> str:
    topic = settings.names.topic(RUNS)
    producer = Producer(producer_config(settings, "test"))
    for i in range(count):
        producer.produce(topic, key=b"u", value=str(i).encode(), partition=PARTITION)
    assert producer.flush(30) == 0
    return topic


def group_consumer(settings: Settings, name: str) -> AIOKafkaConsumer:
    return AIOKafkaConsumer(
        bootstrap_servers=settings.kafka_bootstrap,
        group_id=settings.names.group(name),
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        **aiokafka_security(settings),
    )


async def read_through_cursors(
    consumer: AIOKafkaConsumer, cursors: PartitionCursors, tp: TopicPartition, drop: int, want: int
) -> list[int]:
    """Offsets the chain receives; the record at ``drop`` is lost once on the way."""
    got: list[int] = []
    dropped = False
    for _ in range(60):
        batch = await consumer.getmany(tp, timeout_ms=500)
        for rec in batch.get(tp, []):
            if rec.offset == drop and not dropped:
                dropped = True  # fetched, position moved on, never dispatched
                continue
            if await cursors.admit(PARTITION, rec.offset, generation=1):
                cursors.advance(PARTITION, rec.offset)
                got.append(rec.offset)
        if len(got) >= want:
            break
    return got


async def test_a_dropped_first_record_is_read_again_and_never_committed_over(
    kafka_topics: Settings,
) -> None:
    topic = produce(kafka_topics, 5)
    tp = TopicPartition(topic, PARTITION)
    consumer = group_consumer(kafka_topics, "cursor-check")
    await consumer.start()
    try:
        consumer.assign([tp])

        async def seek(partition: int, offset: int) -> None:
            consumer.seek(TopicPartition(topic, partition), offset)

        reader = GroupOffsetReader(
            kafka_topics, "test", topic, kafka_topics.names.group("cursor-check")
        )

        async def base(partition: int) -> int:
            return await reader.run(reader.start_offset, partition)

        cursors = PartitionCursors(base, seek)
        got = await read_through_cursors(consumer, cursors, tp, drop=0, want=5)
        assert got == [0, 1, 2, 3, 4]

        # Work on 1..4 done, 0 not yet: nothing may be committed.
        assert cursors.take_commit(PARTITION, [1, 2, 3, 4]) is None
        offset = cursors.take_commit(PARTITION, [0, 1, 2, 3, 4])
        assert offset == 5
        await consumer.commit({tp: offset})
        # The next assignment starts where the work ended.
        assert await base(PARTITION) == 5
        await reader.aclose()
    finally:
        await consumer.stop()


async def test_start_offset_is_the_commit_or_else_the_log_start(
    kafka_topics: Settings,
) -> None:
    topic = produce(kafka_topics, 6)
    admin = AdminClient({"bootstrap.servers": kafka_topics.kafka_bootstrap})
    # Retention deleted the first three records.
    for fut in admin.delete_records([CkTopicPartition(topic, PARTITION, 3)]).values():
        fut.result()
    consumer = group_consumer(kafka_topics, "cursor-start")
    reader = GroupOffsetReader(
        kafka_topics, "test", topic, kafka_topics.names.group("cursor-start")
    )
    await consumer.start()
    try:
        tp = TopicPartition(topic, PARTITION)
        consumer.assign([tp])
        assert await reader.run(reader.start_offset, PARTITION) == 3
        # A commit that retention has since passed is taken as it is (the coordinator
        # alone answers): the consumer resets to the log start and the cursor steps
        # over the deleted offsets after its rewinds (tests/unit).
        await consumer.commit({tp: 1})
        assert await reader.run(reader.start_offset, PARTITION) == 1
        await consumer.commit({tp: 5})
        assert await reader.run(reader.start_offset, PARTITION) == 5
    finally:
        await consumer.stop()
        await reader.aclose()
