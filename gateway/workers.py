"""The gateway's view of the workers, built by tailing ``<env>.koda.workers``.

Every gateway reads the compacted workers topic from its beginning, without a
consumer group (gateways never share, join or commit anything), and keeps each
worker's latest beat; a tombstone removes the worker. The table answers
``GET /admin/workers`` and the ``koda_workers{state}`` gauge. It is for people
and alerts, never for routing, and never a readiness dependency: a gateway
whose tail cannot reach the broker still takes runs.

Age is measured from the beat's ``beat_at`` (the worker's clock) to the
gateway's clock, so hosts need synchronised clocks (NTP); a beat from the
future counts as fresh. Rows of workers that vanished without a tombstone
(SIGKILL, a lost node) stay, stale, for ``KODA_BEAT_FORGET_AFTER`` s and are
then dropped so a replaced pod does not keep the status degraded forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from datetime import UTC, datetime
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError

from koda import metrics
from koda.errors import RecordError
from koda.kafka import aiokafka_security
from koda.settings import Settings
from schemas.heartbeats import Beat, decode_beat
from topics.catalogue import WORKERS

log = logging.getLogger(__name__)

POLL_TIMEOUT_MS = 1000
RETRY_MAX_S = 10.0


class WorkerTable:
    """The latest beat per worker, and the status computed from it (no I/O)."""

    def __init__(self, stale_after_s: float, forget_after_s: float = 0.0) -> None:
        self.stale_after_s = stale_after_s
        self.forget_after_s = forget_after_s
        self._beats: dict[str, Beat] = {}

    def apply(self, key: bytes | None, value: bytes | None) -> None:
        """Fold one workers-topic record in; an invalid record is logged and skipped."""
        try:
            beat = decode_beat(key, value)
        except RecordError as exc:
            log.warning("event=heartbeat_invalid reason=%s detail=%s", exc.reason, exc.detail)
            return
        if beat is None:
            if key is not None:
                self._beats.pop(key.decode("utf-8", "replace"), None)
            return
        self._beats[beat.worker_id] = beat

    def report(self, expected: int, now: datetime | None = None) -> dict[str, Any]:
        """``{status, expected, alive, stale, workers: [...]}`` as of ``now`` (default: now).

        ``status`` is ``degraded`` when fewer than ``expected`` workers are alive or
        any is stale, else ``ok``.
        """
        now = now or datetime.now(UTC)
        workers = []
        for worker_id in sorted(self._beats):
            beat = self._beats[worker_id]
            age_s = max(0.0, (now - beat.beat_at).total_seconds())
            if self.forget_after_s and age_s > self.forget_after_s:
                del self._beats[worker_id]
                continue
            workers.append(
                {
                    "worker_id": beat.worker_id,
                    "lastBeatMs": int(age_s * 1000),
                    "in_flight": beat.in_flight,
                    "version": beat.version,
                    "partitions": list(beat.partitions),
                    "host": beat.host,
                    "stale": age_s > self.stale_after_s,
                }
            )
        stale = sum(1 for w in workers if w["stale"])
        alive = len(workers) - stale
        return {
            "status": "degraded" if alive < expected or stale else "ok",
            "expected": expected,
            "alive": alive,
            "stale": stale,
            "workers": workers,
        }


class WorkerDirectory:
    """Tails the workers topic in the background into a :class:`WorkerTable`."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.topic = settings.names.topic(WORKERS)
        self.expected = settings.expected_workers
        self.table = WorkerTable(settings.beat_stale_after_s, settings.beat_forget_after_s)
        self._task: asyncio.Task[None] | None = None

    def report(self) -> dict[str, Any]:
        report = self.table.report(self.expected)
        metrics.WORKERS.labels(state="alive").set(report["alive"])
        metrics.WORKERS.labels(state="stale").set(report["stale"])
        metrics.WORKERS_EXPECTED.set(self.expected)
        return report

    def start(self) -> None:
        """Start tailing (connects in the background; never fails the gateway's start)."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="gateway-workers-tail")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _consumer(self) -> AIOKafkaConsumer:
        return AIOKafkaConsumer(
            bootstrap_servers=self.settings.kafka_bootstrap,
            client_id=self.settings.names.client_id("gateway", "workers-tail"),
            group_id=None,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            **aiokafka_security(self.settings),
        )

    async def _run(self) -> None:
        delay = 0.5
        while True:
            consumer = self._consumer()
            try:
                await consumer.start()
                partitions = consumer.partitions_for_topic(self.topic) or {0}
                consumer.assign([TopicPartition(self.topic, p) for p in sorted(partitions)])
                await consumer.seek_to_beginning()
                delay = 0.5
                while True:
                    batches = await consumer.getmany(timeout_ms=POLL_TIMEOUT_MS)
                    for records in batches.values():
                        for record in records:
                            self.table.apply(record.key, record.value)
                    self.report()
            except (KafkaError, OSError) as exc:
                log.warning("event=workers_tail_failed topic=%s error=%r", self.topic, exc)
            finally:
                with contextlib.suppress(Exception):
                    await consumer.stop()
            await asyncio.sleep(delay)
            delay = min(RETRY_MAX_S, delay * 2)
