"""The gateway's live feed against the real broker: where it starts, what it skips,
and partitions that appear while it runs."""

from __future__ import annotations

from confluent_kafka.admin import AdminClient, NewPartitions  # type: ignore[attr-defined]

from koda_runtime.gateway.livefeed import LiveEvent, LiveFeed
from koda_runtime.settings import Settings
from koda_runtime.topics.catalogue import RUN_CHUNKS
from tests.fixtures.livefeed import collect, produce
from tests.support import async_wait_until


async def test_feed_starts_at_the_end_and_notices_new_partitions(kafka_topics: Settings) -> None:
    settings = kafka_topics.with_(feed_discovery_interval_s=0.3)
    produce(settings, "run-a", 0, 2)  # before the feed: not delivered
    feed = LiveFeed(settings)
    try:
        assert await feed.start()  # assigned at the high watermarks before it returns
        viewer = feed.subscribe("run-a", 1 << 20)
        other = feed.subscribe("run-b", 1 << 20)
        produce(settings, "run-a", 1, 2)
        produce(settings, "run-z", 0, 2)  # nobody watches it
        got: list[LiveEvent] = []
        await async_wait_until(lambda: collect(viewer, got, 1), timeout=20, what="live record")
        assert [(e.seq, e.kind) for e in got] == [(1, "chunk")]
        assert got[0].frame.startswith(b"id: 1\nevent: chunk\ndata: {")
        # The topic grows: the feed assigns the new partitions from their beginning.
        admin = AdminClient({"bootstrap.servers": settings.kafka_bootstrap})
        topic = settings.names.topic(RUN_CHUNKS)
        for fut in admin.create_partitions([NewPartitions(topic, 12)]).values():
            fut.result()
        produce(settings, "run-a", 2, 11, kind="done")
        await async_wait_until(
            lambda: collect(viewer, got, 2), timeout=30, what="record on a new partition"
        )
        assert [(e.seq, e.kind, e.terminal) for e in got] == [
            (1, "chunk", False),
            (2, "done", True),
        ]
        assert await other.next_batch(0.1) == []
        assert feed.viewer_count == 2
        feed.unsubscribe(viewer)
        feed.unsubscribe(other)
        assert feed.viewer_count == 0
    finally:
        await feed.stop()
