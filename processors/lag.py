"""``koda_consumer_lag{topic,partition}``: records behind the group's committed offset.

Every ``KODA_LAG_INTERVAL`` s the worker asks the broker, for each runs partition
it holds, for the end offset (high watermark) and the group's committed offset;
lag = end − committed (− the log start when nothing was committed yet). Asking
the broker, not Faust's in-memory positions, makes the figure what an outside
lag exporter would report. Partitions this worker no longer holds are removed
from the gauge so two workers never report the same partition.

The broker is asked through processors/offsets.py's reader (a librdkafka consumer
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

from koda.metrics import CONSUMER_LAG
from koda.settings import Settings
from processors.offsets import GroupOffsetReader
from topics.catalogue import RUNS

log = logging.getLogger("koda.worker")


class LagMonitor:
    """Samples the lag of the partitions ``partitions()`` returns, into the gauge."""

    def __init__(self, settings: Settings, partitions: Callable[[], Iterable[int]]) -> None:
        self.settings = settings
        self.topic = settings.names.topic(RUNS)
        self.interval_s = settings.lag_interval_s
        self._partitions = partitions
        # A pass stops at the first failure, so a broker outage costs one timeout per pass.
        self._reader = GroupOffsetReader(
            settings, "lag", self.topic, settings.names.group(settings.worker_group)
        )
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
        lags = await self._reader.run(self._measure, held)
        for p, lag in lags.items():
            CONSUMER_LAG.labels(topic=self.topic, partition=str(p)).set(lag)
        self._reported |= set(held)
        return lags

    def _measure(self, held: list[int]) -> dict[int, int]:
        """Blocking: committed offsets of the group, then each partition's watermarks."""
        committed = self._reader.committed(held)
        lags: dict[int, int] = {}
        for p in held:
            low, high = self._reader.watermarks(p)
            position = committed.get(p)
            lags[p] = max(0, high - (low if position is None else position))
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
        await self._reader.aclose()
