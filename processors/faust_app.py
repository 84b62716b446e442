"""The Faust app that hosts the worker: koda's idempotent producer, a boot strategy
without Faust's consumer, the start and stop order of the worker's services
(:class:`KodaApp`), the bounded stop (:func:`end_after`) and Faust's configuration
(:func:`faust_settings`).

The runs topic is not consumed through Faust: aiokafka speaks only Kafka's eager
rebalance protocol, under which every join or leave revokes every partition from every
member (docs/decisions/0003-incremental-rebalances.md). Faust starts no consumer here
(:class:`ProducerBoot`); it runs the producer (chunks, events, heartbeats), the timers
and the worker's lifecycle, and koda's group member joins through librdkafka on an
incremental protocol (topics/kafka/intake.py). A partition that stays with its worker
is never revoked, so its runs go on; one that moves is drained up to the handoff
ceiling and committed in the revoke hook (processors/rebalance.py), before librdkafka
lets the next owner have it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import faust
from faust.app.base import BootStrategy
from faust.transport.drivers import aiokafka as faust_aiokafka

from koda_runtime.kafka import aiokafka_security
from koda_runtime.processors.control import ControlListener
from koda_runtime.processors.dispatch import Dispatcher
from koda_runtime.processors.groupcommit import GroupWriter
from koda_runtime.processors.memory.distiller import MemoryDistiller
from koda_runtime.processors.ops import WorkerOps
from koda_runtime.processors.rebalance import WorkerRuntime
from koda_runtime.settings import Settings
from koda_runtime.topics.kafka.intake import RunsIntake
from koda_runtime.topics.kafka.offsets import GroupOffsetReader

log = logging.getLogger("koda.worker")

# How long a stopping worker waits for its runs consumer to leave the group after the
# drain and the final commit. Past it the process ends anyway: its partitions move when
# the broker expires the member (one session timeout), and their next owner reads from
# the final commit.
LEAVE_CLOSE_S = 5.0
# How long a stopping worker waits for the records it produced to be delivered.
PRODUCER_FLUSH_S = 3.0
# Everything a stopping worker does after its drain (final commit, leaving the group,
# flushing, the heartbeat tombstone, closing its clients) fits in this, or the process
# ends anyway (see :func:`end_after`).
STOP_AFTER_DRAIN_S = 15.0


class IdempotentProducer(faust_aiokafka.Producer):
    def _settings_extra(self) -> dict[str, Any]:
        return {**super()._settings_extra(), "acks": "all", "enable_idempotence": True}

    async def flush(self) -> None:
        """Faust's flush on stop, bounded: with the broker away it would wait for good.
        What it gives up is safe to lose: a run's records are acked only after their
        deliveries, so the next owner meets an undelivered run again; heartbeats and
        probes are rewritten by the next process."""
        try:
            await asyncio.wait_for(super().flush(), PRODUCER_FLUSH_S)
        except TimeoutError:
            log.warning("event=producer_flush_timeout waited_s=%.0f", PRODUCER_FLUSH_S)


class KodaTransport(faust_aiokafka.Transport):
    Producer = IdempotentProducer


class ProducerBoot(BootStrategy):
    """Faust without its consumer (and so without its conductor and tables): the runs
    topic has koda's own group member."""

    enable_kafka_consumer = False


@dataclass(frozen=True)
class WorkerServices:
    """What the Faust app starts and stops around its own services.

    ``runtime``: the rebalance hooks' state. ``intake``: the runs topic's group member.
    ``dispatcher``: its records onto the chains. ``control``: the run-control tail.
    ``ops``: heartbeat, probes and lag. ``offsets``: the cursors' offsets reader.
    ``group_writer``: the executor's group commit, closed after the final commit.
    ``prepare_group``: sets the group's own configuration before this member joins.
    ``distiller``: distils done runs' memories off their path (None: the handler does
    not remember); started with the worker, so an idle worker still finishes the
    distillations a killed one left.
    """

    runtime: WorkerRuntime
    intake: RunsIntake
    dispatcher: Dispatcher
    control: ControlListener
    ops: WorkerOps
    offsets: GroupOffsetReader
    group_writer: GroupWriter
    prepare_group: Callable[[], Awaitable[object]]
    distiller: MemoryDistiller | None = None


class KodaApp(faust.App):
    """The Faust app with koda's producer, and the worker's services started and
    stopped around it.

    It is built first, from configuration alone: the parts that produce are given
    :meth:`produce`, which reaches Faust's producer (created when the app runs). The
    services it starts and stops are built from those parts, so they are handed to it
    last (:meth:`host`), before it runs.
    """

    BootStrategy = ProducerBoot

    def __init__(self, id: str, **options: Any) -> None:
        super().__init__(id, **options)
        self._services: WorkerServices | None = None

    def host(self, services: WorkerServices) -> None:
        """The worker's services this app starts and stops; given once, before it runs."""
        if self._services is not None:
            raise RuntimeError("the worker's services were already given to this app")
        self._services = services

    @property
    def services(self) -> WorkerServices:
        if self._services is None:
            raise RuntimeError(
                "the Faust app has no worker services: build the worker with"
                " processors/bootstrap.py build_worker, which hosts them before it runs"
            )
        return self._services

    def produce(self, **record: Any) -> Any:
        """Send one record through Faust's producer (``producer.send``'s arguments)."""
        return self.producer.send(**record)

    def _new_transport(self) -> Any:
        return KodaTransport(self.conf.broker_consumer, self)

    def _new_producer(self) -> Any:
        return IdempotentProducer(self.transport, loop=self.loop, beacon=self.beacon)

    async def on_started(self) -> None:
        await super().on_started()
        s = self.services
        await s.control.start()
        await s.ops.start()
        # Last: records need the producer, the control tail and the fences' store.
        await s.prepare_group()
        s.dispatcher.task.start()
        s.runtime.commits.task.start()
        s.runtime.gauges.start()
        s.intake.start()
        if s.distiller is not None:
            s.distiller.start()

    async def leave(self) -> None:
        """The graceful end of the runs: stop taking records, drain every held partition
        up to the ceiling, commit, then leave the group (nothing is left to revoke)."""
        s = self.services
        rt = s.runtime
        rt.chains.accepting = False
        try:
            await rt.on_revoked(rt.chains.held())
            end_after(STOP_AFTER_DRAIN_S)
            # A periodic commit still waiting for the broker gives way to the final one.
            await rt.commits.task.stop()
            await rt.commits.flush()
        finally:
            await rt.commits.task.stop()
            await rt.gauges.stop()
            await s.intake.stop(LEAVE_CLOSE_S)
            await s.dispatcher.task.stop()

    async def on_stop(self) -> None:
        # Heartbeat tombstone and health server go last: after the drain and the
        # final commit (in leave(), on the app's shutdown signal), while the producer
        # still runs.
        s = self.services
        try:
            if s.distiller is not None:
                await s.distiller.stop()
            await super().on_stop()
        finally:
            await s.ops.stop(crashed=self.crashed)
            await s.offsets.aclose()
            await s.group_writer.close()
            # Last: a cancel arriving while the drain waits for runs must still reach them.
            await s.control.stop()


def end_after(seconds: float) -> threading.Timer:
    """End this process (exit status 0) if it is still running ``seconds`` from now.

    Called once a stopping worker has drained: everything it owes is durable by then
    (the runs' rows and, acked only after their deliveries, their records; the offsets
    it could not commit are read again by the next owner, which skips what is done).
    What is left is courtesy (leaving the group, a heartbeat tombstone) and each step
    has its own bound, but with the broker or the database away those bounds add up
    past an orchestrator's grace period, and a client's close can wait for its request
    timeout: the deadline makes SIGTERM's end a promise."""

    def end() -> None:
        log.warning("event=stop_overdue waited_s=%.0f: ending the process", seconds)
        for stream in (sys.stderr, sys.stdout):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001, S110 - ending regardless
                pass
        os._exit(0)

    timer = threading.Timer(seconds, end)
    timer.daemon = True
    timer.start()
    return timer


def faust_settings(settings: Settings, datadir: str) -> dict[str, Any]:
    """The Faust configuration derived from koda's settings."""
    hosts = ";".join(f"kafka://{h}" for h in settings.kafka_bootstrap.split(","))
    broker_credentials: faust.SASLCredentials | faust.SSLCredentials | None = None
    sec = aiokafka_security(settings)
    # Faust picks the protocol from the credentials: SASL without an ssl_context is
    # SASL_PLAINTEXT and no credentials is PLAINTEXT, whatever the protocol setting says.
    if sec.get("sasl_mechanism"):
        broker_credentials = faust.SASLCredentials(
            username=sec.get("sasl_plain_username"),
            password=sec.get("sasl_plain_password"),
            mechanism=sec["sasl_mechanism"],
            ssl_context=sec.get("ssl_context"),
        )
    elif sec.get("ssl_context") is not None:
        broker_credentials = faust.SSLCredentials(sec["ssl_context"])
    return {
        "broker": hosts,
        "broker_credentials": broker_credentials,
        "key_serializer": "raw",
        "value_serializer": "raw",
        "topic_allow_declare": False,
        "topic_disable_leader": True,
        "web_enabled": False,
        "datadir": datadir,
        "broker_request_timeout": max(settings.rebalance_timeout_s, settings.session_timeout_s)
        + 10,
        "producer_acks": -1,
        "producer_linger_ms": 2,
    }
