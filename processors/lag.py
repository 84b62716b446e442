"""``koda_consumer_lag{topic,partition}``: records behind the group's committed offset.

Every ``KODA_LAG_INTERVAL`` s the worker asks the broker, for each runs partition
it holds, for the end offset (high watermark) and the group's committed offset;
lag = end − committed (− the log start when nothing was committed yet). Asking
the broker, not Faust's in-memory positions, makes the figure what an outside
lag exporter would report. Partitions this worker no longer holds are removed
from the gauge so two workers never report the same partition.

The broker is asked through topics/kafka/offsets.py's reader (a librdkafka consumer
that never subscribes, in a thread of its own), not through the AdminClient, whose
``list_offsets`` also crashed the process while partition leaders were being
elected. A metric must never stop a worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable

from confluent_kafka import KafkaException

from koda_runtime.background import BackgroundTask
from koda_runtime.metrics import CONSUMER_LAG
from koda_runtime.topics.kafka.offsets import GroupOffsetReader

log = logging.getLogger("koda.worker")


class LagMonitor:
    """Samples, every ``interval_s``, the lag of the partitions ``partitions()`` returns
    into the gauge, through ``reader`` (the runs topic and the workers' group), which it
    closes when it stops."""

    def __init__(
        self,
        reader: GroupOffsetReader,
        partitions: Callable[[], Iterable[int]],
        *,
        interval_s: float,
    ) -> None:
        self.topic = reader.topic
        self.interval_s = interval_s
        self._partitions = partitions
        # A pass stops at the first failure, so a broker outage costs one timeout per pass.
        self._reader = reader
        self._reported: set[int] = set()
        self._task = BackgroundTask("koda-lag-monitor", self.run)

    async def sample(self) -> dict[int, int]:
        """Measure and publish the lag of every held partition; returns it."""
        held = sorted(set(self._partitions()))
        for gone in self._reported - set(held):
            with contextlib.suppress(KeyError):
                CONSUMER_LAG.remove(self.topic, str(gone))
        self._reported &= set(held)
        if not held:
            return {}
        rows = await self._reader.run(self._reader.lags, held)
        lags = {row.partition: row.lag for row in rows}
        for p, lag in lags.items():
            CONSUMER_LAG.labels(topic=self.topic, partition=str(p)).set(lag)
        self._reported |= set(held)
        return lags

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
        self._task.start()

    async def stop(self) -> None:
        await self._task.stop()
        for p in self._reported:
            with contextlib.suppress(KeyError):
                CONSUMER_LAG.remove(self.topic, str(p))
        self._reported.clear()
        # Queued behind a sample still running in the thread (at most two timeouts).
        await self._reader.aclose()
