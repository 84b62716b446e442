"""The no-group tail: every partition of one topic, read in a thread, handed to the loop.

    <topic> ──librdkafka consumer in a daemon thread (assign, no group, no commits)──▶
        route(messages) in the thread ──call_soon_threadsafe──▶ deliver(batch) on the loop

Used by the gateway's live feed (the chunk topic, from the end) and its worker table
(the workers topic, from the beginning), and by every worker's twin watch (the
workers topic, from the end). It never joins a consumer group and never commits:
each reader assigns every partition itself, so nothing it does moves a partition
between workers.

* **Where it starts.** ``start="end"``: each partition at its high watermark read
  when the tail first sees it, resolved before :meth:`TopicTail.wait_ready` returns,
  so every record produced after that is seen. ``start="beginning"``: everything the
  topic still holds. Partitions that appear later (the topic grew, or did not exist
  at first) are read from their beginning either way: all of it is new. Discovery
  runs every ``discovery_interval_s`` (every 0.5 s while nothing is assigned).
* **Positions survive everything.** librdkafka reconnects by itself across a broker
  restart and keeps the positions; a fatal consumer error rebuilds the consumer at
  the positions already read (backoff doubling to 10 s). A record is handed over
  once per tail.
* **A client that lost every broker is rebuilt.** After a broker restart librdkafka can
  be left with no broker it will talk to (a restarting node's first metadata answers
  can list no brokers, and the client drops the ones it knew), so every metadata
  request fails with ``_TRANSPORT`` while new clients connect at once. A failed
  discovery is retried every second, and once none has succeeded for
  ``rebuild_after_s`` (15 s by default) the consumer is rebuilt at its positions.
* **Bounded.** librdkafka's pre-fetch queue is capped, and the thread stops fetching
  while ``MAX_PENDING_BATCHES`` batches wait for the loop: a busy loop pauses the
  tail, it does not grow memory.
* **Errors** are counted (``errors_metric``) and logged at most every
  ``ERROR_LOG_INTERVAL_S`` under the tail's own event names (:class:`TailEvents`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

from confluent_kafka import OFFSET_BEGINNING, OFFSET_END, Consumer, KafkaError, TopicPartition
from prometheus_client import Counter

from koda_runtime import metrics
from koda_runtime.errors import KodaError
from koda_runtime.kafka import consumer_config
from koda_runtime.settings import Settings

log = logging.getLogger(__name__)

T = TypeVar("T")

POLL_S = 0.2
TAIL_FETCH_WAIT_MS = 500
MAX_BATCH = 500
MAX_PENDING_BATCHES = 16
METADATA_TIMEOUT_S = 5.0
# Reads of a partition's end at start-up that may fail (no leader yet) before the tail
# starts at librdkafka's lazily resolved end instead: about 10 s at one try per 0.5 s.
END_TRIES = 20
ERROR_LOG_INTERVAL_S = 10.0
RESTART_BACKOFF_MAX_S = 10.0
# A tail whose metadata requests have all failed for this long rebuilds its consumer;
# failed discoveries are retried every DISCOVERY_RETRY_S meanwhile.
REBUILD_AFTER_S = 15.0
DISCOVERY_RETRY_S = 1.0


class ClientStalled(KodaError, RuntimeError):
    """The tail's consumer has reached no broker for ``rebuild_after_s``: rebuild it."""


@dataclass(frozen=True)
class TailEvents:
    """The log event names (and error counter) one tail reports under."""

    error: str
    restart: str
    not_ready: str
    partitions_added: str
    errors_metric: Counter | None = None


class LoopFeed(Generic[T]):
    """Batches from a client's thread to ``deliver`` on the event loop, in order.

    At most ``limit`` batches wait for the loop: above that :meth:`hand_over` holds the
    thread (so a busy loop slows fetching, not memory) until the loop catches up or
    ``stopping`` is set. :meth:`release` lets a held thread go at once (on stop).
    """

    def __init__(
        self, deliver: Callable[[list[T]], None], limit: int, stopping: threading.Event
    ) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self._deliver = deliver
        self._limit = limit
        self._stopping = stopping
        self._pending = 0
        self._lock = threading.Lock()
        self._drained = threading.Event()

    def release(self) -> None:
        self._drained.set()

    def hand_over(self, batch: list[T]) -> None:
        """In the thread: queue ``batch`` for the loop, then wait while it is behind."""
        loop = self.loop
        if loop is None or loop.is_closed():
            return
        with self._lock:
            self._pending += 1
        try:
            loop.call_soon_threadsafe(self._on_loop, batch)
        except RuntimeError:
            return  # the loop closed under us: the owner is stopping
        while self._pending > self._limit and not self._stopping.is_set():
            self._drained.clear()
            self._drained.wait(0.1)

    def _on_loop(self, batch: list[T]) -> None:
        try:
            self._deliver(batch)
        finally:
            with self._lock:
                self._pending -= 1
            self._drained.set()


class TopicTail(Generic[T]):
    """Tails ``topic`` (a full name) in a daemon thread without a consumer group.

    ``route(messages)`` runs in the thread on every fetched batch of records (errors
    already taken out) and returns what the loop gets; ``deliver(items)`` runs on the
    event loop :meth:`start` was called in, once per non-empty result. ``on_ready``
    runs on the loop once, with the number of partitions, when they are first assigned
    at their start positions. ``config`` is merged over the tail's librdkafka
    configuration.
    """

    def __init__(
        self,
        settings: Settings,
        role: str,
        topic: str,
        *,
        start: Literal["beginning", "end"],
        route: Callable[[list[Any]], list[T]],
        deliver: Callable[[list[T]], None],
        events: TailEvents,
        discovery_interval_s: float,
        on_ready: Callable[[int], None] | None = None,
        config: dict[str, Any] | None = None,
        rebuild_after_s: float = REBUILD_AFTER_S,
    ) -> None:
        self.topic = topic
        self.role = role
        self.rebuild_after_s = rebuild_after_s
        # Consumers built after the first (a fatal error, or no broker reached for
        # rebuild_after_s); read by tests and logged.
        self.rebuilds = 0
        self.start_at = start
        self.discovery_interval_s = discovery_interval_s
        self._route = route
        self._events = events
        self._on_ready = on_ready
        conf = consumer_config(settings, role, settings.names.group(role)) | {
            "enable.auto.offset.store": False,
            # A position that fell out of the log restarts where a first read would.
            "auto.offset.reset": "earliest" if start == "beginning" else "latest",
            "enable.partition.eof": False,
            # The broker answers a fetch as soon as any record arrives (fetch.min.bytes 1):
            # this bounds only an empty poll. 100 ms cost the broker a tenth of a core per
            # idle gateway (ten empty fetches a second per tail); 500 is librdkafka's default.
            "fetch.wait.max.ms": TAIL_FETCH_WAIT_MS,
            "queued.max.messages.kbytes": 16 * 1024,
            "topic.metadata.refresh.interval.ms": 30_000,
        }
        self._config = conf | (config or {})
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._ready = threading.Event()
        self._feed = LoopFeed(deliver, MAX_PENDING_BATCHES, self._stopping)
        # Owned by the tail's thread.
        self._assigned: set[int] = set()
        self._positions: dict[int, int] = {}
        self._start_offsets: dict[int, int] = {}
        self._end_misses = 0
        self._initialised = False
        self._announced = False
        self._last_error_log = 0.0
        self._unreachable_since: float | None = None
        self._reached = False  # the current consumer has answered a discovery

    # --- the event loop's side ----------------------------------------------------

    def start(self) -> None:
        """Start the thread (connects in the background; never fails its owner's start).

        Call it from the event loop that ``deliver`` must run on.
        """
        if self._thread is not None:
            return
        self._loop = self._feed.loop = asyncio.get_running_loop()
        self._stopping.clear()
        self._thread = threading.Thread(target=self._run, name=f"koda-tail-{self.topic}")
        self._thread.daemon = True
        self._thread.start()

    async def wait_ready(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until the partitions are assigned at their start
        positions; False (logged) when the broker did not answer in time, and the
        thread keeps trying."""
        if await asyncio.to_thread(self._ready.wait, timeout_s):
            return True
        log.warning(
            "event=%s topic=%s waited_s=%.0f", self._events.not_ready, self.topic, timeout_s
        )
        return False

    async def stop(self) -> None:
        """Stop the thread and close the consumer (waits at most 10 s)."""
        self._stopping.set()
        self._feed.release()
        thread, self._thread = self._thread, None
        if thread is not None:
            await asyncio.to_thread(thread.join, 10.0)

    # --- the tail's thread ----------------------------------------------------------

    def _run(self) -> None:
        backoff = 0.5
        built = 0
        while not self._stopping.is_set():
            consumer: Consumer | None = None
            try:
                consumer = Consumer(self._config)
                if built:
                    self.rebuilds += 1
                    metrics.KAFKA_CLIENTS_REBUILT.labels(client=self.role).inc()
                built += 1
                self._reached = False
                self._consume(consumer)
            except Exception as exc:  # noqa: BLE001 - the tail must outlive any error
                self._count_error()
                if self._reached:
                    backoff = 0.5  # this consumer worked for a while: a new outage
                log.warning(
                    "event=%s topic=%s rebuilds=%d error=%s",
                    self._events.restart,
                    self.topic,
                    self.rebuilds,
                    exc,
                )
                self._stopping.wait(backoff)
                backoff = min(backoff * 2, RESTART_BACKOFF_MAX_S)
            finally:
                if consumer is not None:
                    try:
                        consumer.close()
                    except Exception:  # noqa: BLE001, S110 - closing a broken consumer
                        pass

    def _consume(self, consumer: Consumer) -> None:
        # A rebuilt consumer resumes where the last one stopped.
        self._assigned = set()
        next_discovery = 0.0
        while not self._stopping.is_set():
            now = time.monotonic()
            if now >= next_discovery:
                if self._discover(consumer):
                    interval = self.discovery_interval_s if self._assigned else 0.5
                else:
                    interval = min(self.discovery_interval_s, DISCOVERY_RETRY_S)
                next_discovery = now + interval
            msg = consumer.poll(POLL_S)
            if msg is None:
                continue
            records = []
            for m in [msg, *consumer.consume(MAX_BATCH - 1, 0)]:
                err = m.error()
                if err is not None:
                    self._on_error(err)
                    continue
                self._positions[m.partition() or 0] = (m.offset() or 0) + 1
                records.append(m)
            batch = self._route(records) if records else []
            if batch:
                self._feed.hand_over(batch)

    def _discover(self, consumer: Consumer) -> bool:
        """Assign partitions not assigned yet; False when no broker answered (and raise
        :class:`ClientStalled` once none has for ``rebuild_after_s``)."""
        try:
            md = consumer.list_topics(self.topic, timeout=METADATA_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - the broker may be away; try later
            self._on_error(exc)
            now = time.monotonic()
            if self._unreachable_since is None:
                self._unreachable_since = now
            elif now - self._unreachable_since >= self.rebuild_after_s:
                self._unreachable_since = now  # the next consumer gets its own allowance
                raise ClientStalled(
                    f"no broker answered for {self.rebuild_after_s:.0f} s: {exc}"
                ) from exc
            return False
        self._unreachable_since = None
        self._reached = True
        topic = md.topics.get(self.topic)
        if topic is None or topic.error is not None or not topic.partitions:
            # The broker answered: whatever partitions appear later are new to us.
            self._initialised = True
            self._ready.set()
            self._log_error(f"topic {self.topic} is not available")
            return True
        new = sorted(set(topic.partitions) - self._assigned)
        if not new:
            return True
        known = {p: self._offset_for(consumer, p) for p in new}
        offsets = [(p, o) for p, o in known.items() if o is not None]
        if len(offsets) < len(new):
            # A partition's end is not known yet (a topic just created has no leader
            # for a moment): assign nothing and ask again at the next discovery, 0.5 s
            # while nothing is assigned. Ready before the ends are known would let the
            # records produced meanwhile slip past a lazily resolved end.
            return True
        assignment = [TopicPartition(self.topic, p, offset) for p, offset in offsets]
        consumer.incremental_assign(assignment)
        self._assigned.update(new)
        if self._initialised:
            log.info(
                "event=%s topic=%s partitions=%s", self._events.partitions_added, self.topic, new
            )
        self._initialised = True
        self._ready.set()
        if not self._announced:
            self._announced = True
            self._call_on_loop(self._on_ready, len(self._assigned))
        return True

    def _call_on_loop(self, fn: Callable[[int], None] | None, arg: int) -> None:
        loop = self._loop
        if fn is None or loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(fn, arg)
        except RuntimeError:
            pass  # the loop closed under us: the owner is stopping

    def _offset_for(self, consumer: Consumer, partition: int) -> int | None:
        """Where ``partition`` starts; None while its end cannot be read yet (asked again
        at the next discovery, up to ``END_TRIES`` times, then left to librdkafka)."""
        if partition in self._positions:
            return self._positions[partition]
        if partition not in self._start_offsets:
            if self._initialised or self.start_at == "beginning":
                # From the beginning, or appeared after start-up: all of it is new here.
                self._start_offsets[partition] = OFFSET_BEGINNING
            else:
                try:
                    _, high = consumer.get_watermark_offsets(
                        TopicPartition(self.topic, partition), timeout=METADATA_TIMEOUT_S
                    )
                    self._start_offsets[partition] = high
                except Exception as exc:  # noqa: BLE001 - the partition may have no leader yet
                    self._end_misses += 1
                    if self._end_misses < END_TRIES:
                        return None
                    # Resolved lazily by librdkafka: records produced before it resolves
                    # are not seen by this tail (their viewers resume from Postgres).
                    self._log_error(f"partition {partition}'s end is unknown: {exc}")
                    self._start_offsets[partition] = OFFSET_END
        return self._start_offsets[partition]

    def _on_error(self, err: Any) -> None:
        self._count_error()
        if isinstance(err, KafkaError) and err.fatal():
            raise RuntimeError(f"fatal consumer error: {err.str()}")
        self._log_error(err.str() if isinstance(err, KafkaError) else str(err))

    def _count_error(self) -> None:
        if self._events.errors_metric is not None:
            self._events.errors_metric.inc()

    def _log_error(self, text: str) -> None:
        now = time.monotonic()
        if now - self._last_error_log >= ERROR_LOG_INTERVAL_S:
            self._last_error_log = now
            log.warning("event=%s topic=%s error=%s", self._events.error, self.topic, text)
