"""The live feed outlives a broker restart: records produced afterwards still arrive,
once each, also when the feed rebuilt its consumer while the broker was away (a client
that lost every broker after a restart is rebuilt at the positions it had read)."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path

from koda_runtime import metrics
from koda_runtime.gateway.livefeed import LiveEvent, LiveFeed
from koda_runtime.localstack import down, kafka_node_start, kafka_node_stop, up
from koda_runtime.topics.admin import apply_topics
from tests.fixtures.livefeed import collect, produce
from tests.fixtures.namespaces import make_settings
from tests.support import async_wait_until


async def test_live_feed_survives_a_broker_restart() -> None:
    state = Path(tempfile.mkdtemp(prefix="koda-feed-restart-", dir="/tmp"))
    try:
        info = await asyncio.to_thread(up, state)
        settings = make_settings(info, partitions=2, feed_discovery_interval_s=0.5)
        await asyncio.to_thread(apply_topics, settings)
        feed = LiveFeed(settings, rebuild_after_s=1.0)
        await feed.start()
        try:
            viewer = feed.subscribe("run-r", 1 << 20)
            got: list[LiveEvent] = []
            await asyncio.to_thread(produce, settings, "run-r", 0, 1)
            await async_wait_until(
                lambda: collect(viewer, got, 1), timeout=20, what="record before the restart"
            )
            await asyncio.to_thread(kafka_node_stop, state, 1)
            # The fault itself: the broker stays down while the feed polls it, until no
            # broker has answered for rebuild_after_s and the feed has rebuilt its consumer.
            await async_wait_until(
                lambda: _rebuilt(feed), timeout=30, what="the feed to rebuild its consumer"
            )
            await asyncio.to_thread(kafka_node_start, state, 1)
            await asyncio.to_thread(produce, settings, "run-r", 1, 1)
            await asyncio.to_thread(produce, settings, "run-r", 2, 0)
            await async_wait_until(
                lambda: collect(viewer, got, 3), timeout=60, what="records after the restart"
            )
            assert sorted(e.seq for e in got) == [0, 1, 2]  # each once, none lost
            counted = metrics.REGISTRY.get_sample_value(
                "koda_kafka_clients_rebuilt_total", {"client": "gateway-feed"}
            )
            assert (counted or 0.0) >= feed.rebuilds
        finally:
            await feed.stop()
    finally:
        try:
            await asyncio.to_thread(down, state)
        finally:
            shutil.rmtree(state, ignore_errors=True)


async def _rebuilt(feed: LiveFeed) -> bool:
    return feed.rebuilds > 0
