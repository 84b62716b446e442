"""``GET /admin/lag``'s figures against the real broker, through the worker directory's
one offsets reader: what the worker group committed, what the topic holds, and one
client for every request."""

from __future__ import annotations

from confluent_kafka import Consumer, Producer, TopicPartition

from koda_runtime.gateway.workers import WorkerDirectory
from koda_runtime.kafka import consumer_config, producer_config
from koda_runtime.settings import Settings
from koda_runtime.topics.catalogue import RUNS


async def test_lag_reads_commits_and_ends_with_one_client(kafka_topics: Settings) -> None:
    settings = kafka_topics
    topic = settings.names.topic(RUNS)
    producer = Producer(producer_config(settings, "test"))
    for i in range(5):
        producer.produce(topic, key=b"u", value=b"%d" % i, partition=1)
    producer.produce(topic, key=b"v", value=b"x", partition=3)
    assert producer.flush(20) == 0
    # The worker group committed 2 on partition 1 (a simple consumer, never a member).
    group = settings.names.group(settings.worker_group)
    committer = Consumer(consumer_config(settings, "test", group))
    committer.commit(offsets=[TopicPartition(topic, 1, 2)], asynchronous=False)
    committer.close()

    directory = WorkerDirectory(settings)
    try:
        rows = {row.partition: row for row in await directory.lag()}
        assert sorted(rows) == list(range(settings.partitions))
        assert (rows[1].end, rows[1].committed, rows[1].lag) == (5, 2, 3)
        # Nothing committed: everything from the log start is behind.
        assert (rows[3].end, rows[3].committed, rows[3].lag) == (1, None, 1)
        assert (rows[0].end, rows[0].lag) == (0, 0)
        client = directory._offsets._consumer
        assert client is not None
        again = {row.partition: row.lag for row in await directory.lag()}
        assert again[1] == 3
        # A request does not open a consumer of its own (and a thread with it).
        assert directory._offsets._consumer is client
    finally:
        await directory.stop()
    assert directory._offsets._consumer is None
