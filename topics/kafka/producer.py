"""The asyncio producer bridge: confluent-kafka's producer, its acknowledgements as futures.

librdkafka delivers acknowledgements through callbacks served by ``poll()``. A daemon
thread polls; each callback resolves the asyncio future that
:meth:`AsyncProducer.produce` returned, via ``call_soon_threadsafe``. ``produce()``
itself never blocks the event loop: it only enqueues (or fails at once with a full
queue). Used by the run publisher (topics/kafka/publisher.py).

Failures are raised as (or fail the future with) ``error``, the caller's own
:class:`~koda_runtime.errors.KodaError` branch, so the bridge adds no error type of its own.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from koda_runtime.errors import KodaError, TopicError

log = logging.getLogger(__name__)

Headers = list[tuple[str, str | bytes | None]]


@dataclass(frozen=True)
class Delivery:
    """Where the broker stored a record."""

    topic: str
    partition: int
    offset: int


class AsyncProducer:
    """A librdkafka producer with ``config`` (see koda/kafka.py), bridged to asyncio."""

    def __init__(
        self, config: dict[str, Any], *, error: type[KodaError] = TopicError, name: str = "koda"
    ) -> None:
        self._config = dict(config)
        self._error = error
        self._name = name
        self._producer: Producer | None = None
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    async def start(self) -> None:
        """Create the producer and start the poll thread (no broker round trip yet)."""
        if self._producer is not None:
            return
        try:
            self._producer = Producer(self._config)
        except KafkaException as exc:
            raise self._error(f"cannot create the Kafka producer: {exc}") from exc
        self._stopping.clear()
        self._thread = threading.Thread(
            target=self._poll_forever, name=f"koda-{self._name}-producer-poll", daemon=True
        )
        self._thread.start()

    def _poll_forever(self) -> None:
        producer = self._producer
        assert producer is not None
        while not self._stopping.is_set():
            producer.poll(0.1)

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Deliver what is queued (up to ``timeout_s``), then stop polling."""
        producer = self._producer
        if producer is None:
            return
        remaining = await asyncio.to_thread(producer.flush, timeout_s)
        if remaining:
            log.warning("event=producer_flush_incomplete undelivered=%d", remaining)
        self._stopping.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 5.0)
        self._producer = None

    async def check(self, topic: str, timeout_s: float = 2.0) -> None:
        """Raise ``error`` unless a broker answers and knows ``topic``."""
        producer = self._producer
        if producer is None:
            raise self._error("the producer is not started")
        try:
            meta = await asyncio.to_thread(producer.list_topics, topic, timeout_s)
        except KafkaException as exc:
            raise self._error(f"no broker answered within {timeout_s}s: {exc}") from exc
        info = meta.topics.get(topic)
        if info is None or info.error is not None or not info.partitions:
            raise self._error(f"topic {topic} is not available on the broker")

    def produce(
        self,
        topic: str,
        key: bytes,
        value: bytes,
        headers: Headers,
        partition: int | None = None,
        *,
        what: str = "",
        settle: Callable[[Delivery | KodaError], None] | None = None,
    ) -> asyncio.Future[Delivery]:
        """Enqueue one record; the future resolves on the broker's ack.

        The future fails with ``error`` when the record cannot be enqueued or is not
        acknowledged within the producer's ``message.timeout.ms``. ``what`` names the
        record in those errors (default: "a record for <topic>"). ``settle`` runs on
        the loop with the broker's answer, even when nobody waits for the future any
        more.
        """
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Delivery] = loop.create_future()
        producer = self._producer
        if producer is None:
            future.set_exception(self._error("the producer is not started"))
            return future
        what = what or f"a record for {topic}"

        def on_delivery(err: KafkaError | None, msg: Message) -> None:
            # Runs on the poll thread: hand the result to the loop that waits for it.
            outcome: Delivery | KodaError
            if err is not None:
                outcome = self._error(f"delivery of {what} failed: {err.str()}")
            else:
                outcome = Delivery(msg.topic() or topic, msg.partition() or 0, msg.offset() or 0)
            try:
                loop.call_soon_threadsafe(_resolve, future, outcome, settle)
            except RuntimeError:
                pass  # the loop is closed: nobody is waiting any more

        extra: dict[str, Any] = {} if partition is None else {"partition": partition}
        try:
            producer.produce(
                topic, key=key, value=value, headers=headers, on_delivery=on_delivery, **extra
            )
        except (BufferError, KafkaException) as exc:
            future.set_exception(self._error(f"cannot enqueue {what}: {exc}"))
        return future


def _resolve(
    future: asyncio.Future[Delivery],
    outcome: Delivery | KodaError,
    settle: Callable[[Delivery | KodaError], None] | None,
) -> None:
    if settle is not None:
        settle(outcome)
    if future.done():
        return
    if isinstance(outcome, KodaError):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)
