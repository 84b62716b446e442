"""``koda_consumer_lag{topic,partition}``: records behind the group's committed offset.

Every ``KODA_LAG_INTERVAL`` s the worker asks the broker, for each runs partition
it holds, for the end offset (high watermark) and the group's committed offset;
lag = end − committed (− the log start when nothing was committed yet). Asking
the broker, not Faust's in-memory positions, makes the figure what an outside
lag exporter would report. Partitions this worker no longer holds are removed
from the gauge so two workers never report the same partition.

The broker is asked through a librdkafka *consumer* that never subscribes
(``committed`` and ``get_watermark_offsets``, in one thread of its own), not through
the AdminClient: librdkafka's admin requests abort or crash the whole process when
they time out across a broker restart (``rd_kafka_enq_once_del_source_return:
Assertion `eonce->refcnt > 0' failed``, librdkafka issue 4605; seen here killing
every worker at once when the broker came back), and ``list_offsets`` crashed it
while partition leaders were being elected. A metric must never stop a worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

from confluent_kafka import Consumer, KafkaException, TopicPartition

from koda.kafka import consumer_config
from koda.metrics import CONSUMER_LAG
from koda.settings import Settings
from topics.catalogue import RUNS

log = logging.getLogger("koda.worker")

# Each call blocks the sampler's own thread at most this long (seconds); a pass stops
# at the first failure, so a broker outage costs one timeout per pass.
REQUEST_TIMEOUT_S = 5.0


class LagMonitor:
    """Samples the lag of the partitions ``partitions()`` returns, into the gauge."""

    def __init__(self, settings: Settings, partitions: Callable[[], Iterable[int]]) -> None:
        self.settings = settings
        self.topic = settings.names.topic(RUNS)
        self.group = settings.names.group(settings.worker_group)
        self.interval_s = settings.lag_interval_s
        self._partitions = partitions
        self._consumer: Consumer | None = None
        # One thread: calls on the consumer never overlap, and close() runs after them.
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="koda-lag")
        self._reported: set[int] = set()
        self._task: asyncio.Task[None] | None = None

    async def sample(self) -> dict[int, int]:
        """Measure and publish the lag of every held partition; returns it."""
        held = sorted(set(self._partitions()))
        for gone in self._reported - set(held):
            with contextlib.suppress(KeyError):
                CONSUMER_LAG.remove(self.topic, str(gone))
        self._reported &= set(held)
        if not held:
            return {}
        loop = asyncio.get_running_loop()
        lags = await loop.run_in_executor(self._thread, self._measure, held)
        for p, lag in lags.items():
            CONSUMER_LAG.labels(topic=self.topic, partition=str(p)).set(lag)
        self._reported |= set(held)
        return lags

    def _measure(self, held: list[int]) -> dict[int, int]:
        """Blocking: committed offsets of the group, then each partition's watermarks."""
        if self._consumer is None:
            # Never subscribes, so it never joins the group; it only reads its offsets.
            conf = consumer_config(self.settings, "lag", self.group)
            self._consumer = Consumer(conf | {"socket.timeout.ms": int(REQUEST_TIMEOUT_S * 1000)})
        consumer = self._consumer
        tps = [TopicPartition(self.topic, p) for p in held]
        committed = {
            tp.partition: tp.offset for tp in consumer.committed(tps, timeout=REQUEST_TIMEOUT_S)
        }
        lags: dict[int, int] = {}
        for p in held:
            low, high = consumer.get_watermark_offsets(
                TopicPartition(self.topic, p), timeout=REQUEST_TIMEOUT_S, cached=False
            )
            position = committed.get(p, -1)
            if position is None or position < 0:
                position = low
            lags[p] = max(0, high - position)
        return lags

    def _close(self) -> None:
        consumer, self._consumer = self._consumer, None
        if consumer is not None:
            consumer.close()

    async def run(self) -> None:
        while True:
            try:
                await self.sample()
            except (KafkaException, TimeoutError) as exc:
                log.warning("event=lag_sample_failed error=%s", exc)
            except Exception:  # noqa: BLE001 - a metric must never stop the worker
                log.exception("event=lag_sample_failed")
            await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        self._task = asyncio.create_task(self.run(), name="koda-lag-monitor")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for p in self._reported:
            with contextlib.suppress(KeyError):
                CONSUMER_LAG.remove(self.topic, str(p))
        self._reported.clear()
        # Queued behind a sample still running in the thread (at most two timeouts).
        await asyncio.get_running_loop().run_in_executor(self._thread, self._close)
        self._thread.shutdown(wait=False)
