"""Everything the worker produces: chunks, run events and dead letters.

Records go through the Faust app's producer (aiokafka, idempotent, acks=all).
``send`` returns delivery futures; a run is acked only after all of its
futures resolved, so a committed offset never precedes its output on the topic.

A dead letter is bounded (schemas/records.py cuts the original's key, headers and
value to fit the producer). Should the broker refuse it anyway (a size or record
error, never a timeout or a lost connection), a bare letter without the original's
value and headers is tried; refused too, the record is skipped: an error log naming
its partition and offset, ``koda_records_skipped_total{reason="dead_letter_refused"}``
and the alert ``KodaRecordsSkipped``. A partition never stalls on its dead letter.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from aiokafka.errors import (
    CorruptRecordException,
    MessageSizeTooLargeError,
    RecordListTooLargeError,
    RecordTooLargeError,
    UnsupportedForMessageFormatError,
)

from koda_runtime.lifecycle.chunks import Chunk, chunk_key
from koda_runtime.metrics import DEAD_LETTERS, RECORDS_SKIPPED
from koda_runtime.processors.ports import Record
from koda_runtime.settings import Settings
from koda_runtime.topics.catalogue import RUN_CHUNKS, RUN_EVENTS, RUNS_DLQ
from koda_runtime.topics.records.codec import (
    DEAD_LETTER,
    RUN_CHUNK,
    RUN_EVENT,
    chunk_value,
    dead_letter_key,
    dead_letter_value,
    event_value,
    headers_for,
)

SendFn = Callable[..., Awaitable[Any]]

log = logging.getLogger("koda.worker")

# What the producer or the broker answers for a record it will never take, however often
# it is sent: too large, or a record the broker cannot store. Timeouts and lost
# connections are not among them (the chain retries those).
REFUSALS: tuple[type[BaseException], ...] = (
    MessageSizeTooLargeError,
    RecordListTooLargeError,
    RecordTooLargeError,
    CorruptRecordException,
    UnsupportedForMessageFormatError,
)


def refused(exc: BaseException) -> bool:
    """True when ``exc`` (or what it wraps, as Faust's ProducerSendError does) is a
    refusal of the record itself (:data:`REFUSALS`)."""
    seen: BaseException | None = exc
    for _ in range(8):  # a short chain of causes; never loop on a cycle
        if seen is None:
            return False
        if isinstance(seen, REFUSALS):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


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
        DLQ writer). Returns normally too when the broker refused even the bare letter:
        then the record is skipped (logged, counted). Any other failure (broker
        unreachable, timeout) raises: the record is tried again."""
        last: BaseException | None = None
        for bare in (False, True):
            value = dead_letter_value(
                key=record.key,
                value=record.value,
                headers=record.headers,
                topic=record.topic,
                partition=record.partition,
                offset=record.offset,
                attempts=attempts,
                reason=reason,
                error=error,
                bare=bare,
            )
            try:
                fut = await self._send(
                    topic=self.dlq_topic,
                    key=dead_letter_key(record.key),
                    value=value,
                    partition=None,
                    timestamp=None,
                    headers=headers_for(DEAD_LETTER),
                )
                await fut
            except Exception as exc:
                if not refused(exc):
                    raise
                last = exc
                log.warning(
                    "dead letter refused by the broker%s partition=%d offset=%d bytes=%d: %s",
                    " (bare)" if bare else ", trying it without the original's bytes",
                    record.partition,
                    record.offset,
                    len(value),
                    exc,
                )
                continue
            DEAD_LETTERS.labels(reason=reason).inc()
            return
        RECORDS_SKIPPED.labels(reason="dead_letter_refused").inc()
        log.error(
            "event=record_skipped reason=dead_letter_refused topic=%s partition=%d offset=%d "
            "dead_letter_reason=%s: the broker refused its dead letter (%s); the record is "
            "passed over, its bytes stay on %s until retention",
            record.topic,
            record.partition,
            record.offset,
            reason,
            last,
            record.topic,
        )
