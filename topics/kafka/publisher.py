"""The producer of run records: ``run.requested`` records through the asyncio producer
bridge (topics/kafka/producer.py), for the gateway's admission, the scheduler's fires
and the sweeper (each process builds its own, with its own client role).

The producer is idempotent with ``acks=all`` and the murmur2 partitioner
(:func:`koda_runtime.kafka.producer_config`). Topic auto-creation is off: a run record for a
missing topic must fail, not create a one-partition topic that breaks per-user order.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from koda_runtime import metrics
from koda_runtime.errors import KodaError, PublishError
from koda_runtime.kafka import producer_config
from koda_runtime.settings import Settings
from koda_runtime.topics.catalogue import RUNS
from koda_runtime.topics.kafka.producer import AsyncProducer, Delivery
from koda_runtime.topics.records.codec import RUN_REQUESTED, RunRequested, headers_for

ROLE = "gateway"

__all__ = ["Delivery", "RunPublisher"]


class RunPublisher:
    """Produces ``run.requested`` records keyed by user id to the runs topic."""

    def __init__(self, settings: Settings, *, config: dict[str, Any] | None = None) -> None:
        self.topic = settings.names.topic(RUNS)
        conf = dict(config or producer_config(settings, ROLE))
        conf.setdefault("allow.auto.create.topics", False)
        self._producer = AsyncProducer(conf, error=PublishError, name="gateway")
        # ``send(topic, key, value, headers, partition=None)``: one record for another
        # koda topic (run control, a gateway-written chunk); the future resolves on the
        # broker's ack or fails with PublishError.
        self.send = self._producer.produce

    async def start(self) -> None:
        """Create the producer and start the poll thread (no broker round trip yet)."""
        await self._producer.start()

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Deliver what is queued (up to ``timeout_s``), then stop polling."""
        await self._producer.stop(timeout_s)

    async def check(self, timeout_s: float = 2.0) -> None:
        """Raise PublishError unless a broker answers and knows the runs topic."""
        await self._producer.check(self.topic, timeout_s)

    def publish(
        self, record: RunRequested, traceparent: str | None = None
    ) -> asyncio.Future[Delivery]:
        """Enqueue ``record`` (key = user id); the future resolves on the broker's ack.
        ``traceparent``: the run's W3C trace context, sent as the record's header.

        The future fails with PublishError when the record cannot be enqueued or
        is not acknowledged within the producer's ``message.timeout.ms``.
        """
        started = time.monotonic()

        def settle(outcome: Delivery | KodaError) -> None:
            metrics.PUBLISH_SECONDS.observe(time.monotonic() - started)
            failed = isinstance(outcome, KodaError)
            metrics.PUBLISH.labels(outcome="failed" if failed else "delivered").inc()

        future = self._producer.produce(
            self.topic,
            key=record.user_id.encode(),
            value=record.encode(),
            headers=list(headers_for(RUN_REQUESTED, traceparent)),
            what=f"run {record.run_id}",
            settle=settle,
        )
        if future.done() and future.exception() is not None:
            metrics.PUBLISH.labels(outcome="failed").inc()  # not even enqueued
        return future
