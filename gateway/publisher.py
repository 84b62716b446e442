"""The gateway's producer: confluent-kafka bridged to asyncio.

librdkafka delivers acknowledgements through callbacks served by ``poll()``. A
daemon thread polls; each callback resolves the asyncio future that
:meth:`RunPublisher.publish` returned, via ``call_soon_threadsafe``. ``produce()``
itself never blocks the event loop: it only enqueues (or fails at once with a
full queue).

The producer is idempotent with ``acks=all`` and the murmur2 partitioner
(:func:`koda.kafka.producer_config`). Topic auto-creation is off here: a run
record for a missing topic must fail, not create a one-partition topic that
breaks per-user order.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from gateway.exceptions import PublishError
from koda import metrics
from koda.kafka import producer_config
from koda.settings import Settings
from schemas.records import RUN_REQUESTED, RunRequested, headers_for
from topics.catalogue import RUNS

log = logging.getLogger(__name__)

ROLE = "gateway"


@dataclass(frozen=True)
class Delivery:
    """Where the broker stored a record."""

    topic: str
    partition: int
    offset: int


class RunPublisher:
    """Produces ``run.requested`` records keyed by user id to the runs topic."""

    def __init__(self, settings: Settings, *, config: dict[str, Any] | None = None) -> None:
        self.topic = settings.names.topic(RUNS)
        self._config = dict(config or producer_config(settings, ROLE))
        self._config.setdefault("allow.auto.create.topics", False)
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
            raise PublishError(f"cannot create the Kafka producer: {exc}") from exc
        self._stopping.clear()
        self._thread = threading.Thread(
            target=self._poll_forever, name="koda-gateway-producer-poll", daemon=True
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

    async def check(self, timeout_s: float = 2.0) -> None:
        """Raise PublishError unless a broker answers and knows the runs topic."""
        producer = self._producer
        if producer is None:
            raise PublishError("the producer is not started")
        try:
            meta = await asyncio.to_thread(producer.list_topics, self.topic, timeout_s)
        except KafkaException as exc:
            raise PublishError(f"no broker answered within {timeout_s}s: {exc}") from exc
        topic = meta.topics.get(self.topic)
        if topic is None or topic.error is not None or not topic.partitions:
            raise PublishError(f"topic {self.topic} is not available on the broker")

    def publish(self, record: RunRequested) -> asyncio.Future[Delivery]:
        """Enqueue ``record`` (key = user id); the future resolves on the broker's ack.

        The future fails with PublishError when the record cannot be enqueued or
        is not acknowledged within the producer's ``message.timeout.ms``.
        """
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Delivery] = loop.create_future()
        producer = self._producer
        if producer is None:
            future.set_exception(PublishError("the producer is not started"))
            return future
        started = time.monotonic()

        def on_delivery(err: KafkaError | None, msg: Message) -> None:
            # Runs on the poll thread: hand the result to the loop that waits for it.
            outcome: Delivery | PublishError
            if err is not None:
                outcome = PublishError(f"delivery of run {record.run_id} failed: {err.str()}")
            else:
                outcome = Delivery(
                    msg.topic() or self.topic, msg.partition() or 0, msg.offset() or 0
                )
            try:
                loop.call_soon_threadsafe(_settle, future, outcome, started)
            except RuntimeError:
                pass  # the loop is closed: nobody is waiting any more

        headers: list[tuple[str, str | bytes | None]] = list(headers_for(RUN_REQUESTED))
        try:
            producer.produce(
                self.topic,
                key=record.user_id.encode(),
                value=record.encode(),
                headers=headers,
                on_delivery=on_delivery,
            )
        except (BufferError, KafkaException) as exc:
            metrics.PUBLISH.labels(outcome="failed").inc()
            future.set_exception(PublishError(f"cannot enqueue run {record.run_id}: {exc}"))
        return future

    def send(
        self,
        topic: str,
        key: bytes,
        value: bytes,
        headers: list[tuple[str, str | bytes | None]],
        partition: int | None = None,
    ) -> asyncio.Future[Delivery]:
        """Enqueue one record for another koda topic (run control, a gateway-written
        chunk); the future resolves on the broker's ack or fails with PublishError."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Delivery] = loop.create_future()
        producer = self._producer
        if producer is None:
            future.set_exception(PublishError("the producer is not started"))
            return future

        def on_delivery(err: KafkaError | None, msg: Message) -> None:
            outcome: Delivery | PublishError
            if err is not None:
                outcome = PublishError(f"delivery to {topic} failed: {err.str()}")
            else:
                outcome = Delivery(msg.topic() or topic, msg.partition() or 0, msg.offset() or 0)
            try:
                loop.call_soon_threadsafe(_resolve, future, outcome)
            except RuntimeError:
                pass

        try:
            if partition is None:
                producer.produce(
                    topic, key=key, value=value, headers=headers, on_delivery=on_delivery
                )
            else:
                producer.produce(
                    topic,
                    key=key,
                    value=value,
                    headers=headers,
                    on_delivery=on_delivery,
                    partition=partition,
                )
        except (BufferError, KafkaException) as exc:
            future.set_exception(PublishError(f"cannot enqueue a record for {topic}: {exc}"))
        return future


def _resolve(future: asyncio.Future[Delivery], outcome: Delivery | PublishError) -> None:
    if future.done():
        return
    if isinstance(outcome, PublishError):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


def _settle(
    future: asyncio.Future[Delivery], outcome: Delivery | PublishError, started: float
) -> None:
    metrics.PUBLISH_SECONDS.observe(time.monotonic() - started)
    if isinstance(outcome, PublishError):
        metrics.PUBLISH.labels(outcome="failed").inc()
        if not future.done():
            future.set_exception(outcome)
    else:
        metrics.PUBLISH.labels(outcome="delivered").inc()
        if not future.done():
            future.set_result(outcome)
