"""A background reader of ``<env>.koda.workers``, the heartbeat topic.

Both sides of the heartbeat read it: every gateway builds its worker table from the
beginning (``GET /admin/workers``), and every worker watches, from the end, for beats
under its own id that another process sent. Neither joins a consumer group or
commits: each reader assigns every partition itself.

The reader keeps its position across a lost connection (it reconnects with capped
backoff and goes on where it stopped), so a record is handed over once per reader;
``apply`` gets the record's key, value and offset (offsets order the records of
one key: the topic keeps a key on one partition).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Literal

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError

from koda.kafka import aiokafka_security
from koda.settings import Settings
from topics.catalogue import WORKERS

log = logging.getLogger(__name__)

POLL_TIMEOUT_MS = 1000
RETRY_MAX_S = 10.0

ApplyFn = Callable[[bytes | None, bytes | None, int], None]


class WorkerLogTail:
    """Tails the workers topic in the background, handing every record to ``apply``.

    ``start`` is where a first connection begins: ``"beginning"`` (everything the
    compacted topic still holds) or ``"end"`` (only records produced from now on).
    ``after_poll`` runs after every poll, records or not.
    """

    def __init__(
        self,
        settings: Settings,
        role: str,
        apply: ApplyFn,
        *,
        start: Literal["beginning", "end"] = "beginning",
        after_poll: Callable[[], object] | None = None,
    ) -> None:
        self.settings = settings
        self.topic = settings.names.topic(WORKERS)
        self.role = role
        self.start_at = start
        self._apply = apply
        self._after_poll = after_poll
        self._positions: dict[int, int] = {}
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start tailing (connects in the background; never fails its owner's start)."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"{self.role}-workers-tail")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _consumer(self) -> AIOKafkaConsumer:
        return AIOKafkaConsumer(
            bootstrap_servers=self.settings.kafka_bootstrap,
            client_id=self.settings.names.client_id(self.role, "workers-tail"),
            group_id=None,
            enable_auto_commit=False,
            # A position that fell out of the log restarts where a first connection would.
            auto_offset_reset="earliest" if self.start_at == "beginning" else "latest",
            **aiokafka_security(self.settings),
        )

    async def _position(self, consumer: AIOKafkaConsumer, tps: list[TopicPartition]) -> None:
        fresh = [tp for tp in tps if tp.partition not in self._positions]
        for tp in tps:
            if tp.partition in self._positions:
                consumer.seek(tp, self._positions[tp.partition])
        if fresh and self.start_at == "beginning":
            await consumer.seek_to_beginning(*fresh)
        elif fresh:
            await consumer.seek_to_end(*fresh)
            for tp in fresh:  # "the end" is now, not wherever a reconnect finds it
                self._positions[tp.partition] = await consumer.position(tp)

    async def _run(self) -> None:
        delay = 0.5
        while True:
            consumer = self._consumer()
            try:
                await consumer.start()
                partitions = consumer.partitions_for_topic(self.topic) or {0}
                tps = [TopicPartition(self.topic, p) for p in sorted(partitions)]
                consumer.assign(tps)
                await self._position(consumer, tps)
                delay = 0.5
                while True:
                    batches = await consumer.getmany(timeout_ms=POLL_TIMEOUT_MS)
                    for tp, records in batches.items():
                        for record in records:
                            self._apply(record.key, record.value, record.offset)
                            self._positions[tp.partition] = record.offset + 1
                    if self._after_poll is not None:
                        self._after_poll()
            except (KafkaError, OSError) as exc:
                log.warning("event=workers_tail_failed topic=%s error=%r", self.topic, exc)
            finally:
                with contextlib.suppress(Exception):
                    await consumer.stop()
            await asyncio.sleep(delay)
            delay = min(RETRY_MAX_S, delay * 2)
