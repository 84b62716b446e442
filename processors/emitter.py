"""Everything the worker produces: chunks, run events and dead letters.

Records go through the Faust app's producer (aiokafka, idempotent, acks=all).
``send`` returns delivery futures; a run is acked only after all of its
futures resolved, so a committed offset never precedes its output on the topic.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from koda_runtime.lifecycle.chunks import Chunk, chunk_key
from koda_runtime.metrics import DEAD_LETTERS
from koda_runtime.processors.ports import Record
from koda_runtime.schemas.records import (
    DEAD_LETTER,
    RUN_CHUNK,
    RUN_EVENT,
    chunk_value,
    dead_letter_value,
    event_value,
    headers_for,
)
from koda_runtime.settings import Settings
from koda_runtime.topics.catalogue import RUN_CHUNKS, RUN_EVENTS, RUNS_DLQ

SendFn = Callable[..., Awaitable[Any]]


class Emitter:
    """Produces koda's output records; ``send`` is ``producer.send`` (returns a future)."""

    def __init__(self, settings: Settings, send: SendFn) -> None:
        names = settings.names
        self._send = send
        self.chunks_topic = names.topic(RUN_CHUNKS)
        self.events_topic = names.topic(RUN_EVENTS)
        self.dlq_topic = names.topic(RUNS_DLQ)

    async def chunks(self, partition: int, chunks: Sequence[Chunk]) -> list[asyncio.Future[Any]]:
        """Queue ``chunks`` into the run's partition of the chunk topic; return futures."""
        futures = []
        headers = headers_for(RUN_CHUNK)
        for c in chunks:
            fut = await self._send(
                topic=self.chunks_topic,
                key=chunk_key(c.run_id, c.seq).encode(),
                value=chunk_value(c.run_id, c.seq, c.kind.value, c.content, c.attempt),
                partition=partition,
                timestamp=None,
                headers=headers,
            )
            futures.append(fut)
        return futures

    async def event(
        self, partition: int, run_id: str, event: str, **fields: Any
    ) -> asyncio.Future[Any]:
        """A status transition or usage record for the warehouse (key = run_id)."""
        fut: asyncio.Future[Any] = await self._send(
            topic=self.events_topic,
            key=run_id.encode(),
            value=event_value(run_id, event, **fields),
            partition=partition,
            timestamp=None,
            headers=headers_for(RUN_EVENT),
        )
        return fut

    async def dead_letter(self, record: Record, *, attempts: int, reason: str, error: str) -> None:
        """Write the dead letter of ``record`` and wait until the broker has it (the only
        DLQ writer)."""
        fut = await self._send(
            topic=self.dlq_topic,
            key=record.key,
            value=dead_letter_value(
                key=record.key,
                value=record.value,
                headers=record.headers,
                topic=record.topic,
                partition=record.partition,
                offset=record.offset,
                attempts=attempts,
                reason=reason,
                error=error,
            ),
            partition=None,
            timestamp=None,
            headers=headers_for(DEAD_LETTER),
        )
        await fut
        DEAD_LETTERS.labels(reason=reason).inc()
