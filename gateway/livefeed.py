"""The live feed: every gateway tails the chunk topic and fans records out to its viewers.

    <env>.koda.run-chunks ──consumer thread (assign every partition, no group)──▶ batches
        ──call_soon_threadsafe──▶ event loop: viewers[run_id] ──▶ each viewer's queue

* **Where it starts.** At start-up every partition is assigned at its current high
  watermark, resolved before :meth:`LiveFeed.start` returns, so any record produced
  after the gateway accepts connections is seen. Partitions that appear later (the
  topic grew, or did not exist at start-up) are assigned from their beginning.
  Discovery runs every ``feed_discovery_interval_s`` (every 0.5 s while nothing is
  assigned). Nothing is committed: the feed
  is not a consumer group member, and ``group.id`` is only a librdkafka formality.
* **Only watched runs cost anything.** The thread routes by key
  (``<run_id>:<seq>``) and skips records of runs nobody on this gateway watches
  before decoding them. A watched record's SSE frame is built once in the thread and
  shared by every viewer of the run.
* **Bounded everywhere.** librdkafka's pre-fetch queue is capped; the thread stops
  handing batches to the loop while ``MAX_PENDING_BATCHES`` are unprocessed (so a
  busy loop pauses fetching instead of growing memory); each viewer's queue holds at
  most ``sse_queue_bytes`` bytes of frames. A viewer whose queue would overflow is cut
  off (its queue freed at once); the stream then tells the client to reconnect, and it
  resumes from Postgres with Last-Event-ID. A slow viewer never blocks the others.
* **Broker restarts.** librdkafka reconnects by itself and keeps the positions; a fatal
  consumer error rebuilds the consumer at the positions already read. Records missed
  in any such window are not lost to viewers: a skipped seq triggers a backfill from
  Postgres, and an idle stream re-reads Postgres every keep-alive interval.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, OFFSET_END, Consumer, KafkaError, TopicPartition

from gateway.eventstream import TERMINAL_KINDS, event_frame
from koda import metrics
from koda.kafka import consumer_config
from koda.lifecycle.chunks import split_chunk_key
from koda.settings import Settings
from topics.catalogue import RUN_CHUNKS

log = logging.getLogger(__name__)

ROLE = "gateway-feed"
POLL_S = 0.2
MAX_BATCH = 500
MAX_PENDING_BATCHES = 16
START_TIMEOUT_S = 5.0
METADATA_TIMEOUT_S = 5.0
ERROR_LOG_INTERVAL_S = 10.0
RESTART_BACKOFF_MAX_S = 10.0


@dataclass(frozen=True, slots=True)
class LiveEvent:
    """One chunk-topic record of a watched run, ready to write: ``frame`` is its SSE frame."""

    seq: int
    kind: str
    frame: bytes

    @property
    def terminal(self) -> bool:
        return self.kind in TERMINAL_KINDS


class Viewer:
    """One SSE stream's live queue: at most ``max_bytes`` bytes of frames, or it is cut."""

    __slots__ = ("_bytes", "_queue", "_wake", "cut", "max_bytes", "run_id")

    def __init__(self, run_id: str, max_bytes: int) -> None:
        self.run_id = run_id
        self.max_bytes = max_bytes
        self.cut: str | None = None
        self._queue: deque[LiveEvent] = deque()
        self._bytes = 0
        self._wake = asyncio.Event()

    def offer(self, event: LiveEvent) -> None:
        """Queue ``event``; cut the viewer off instead if its queue would overflow."""
        if self.cut is not None:
            return
        size = len(event.frame)
        # An empty queue always takes one event, however large: progress is possible.
        if self._queue and self._bytes + size > self.max_bytes:
            self.cut_off("overflow")
            return
        self._queue.append(event)
        self._bytes += size
        metrics.SSE_QUEUED_BYTES.inc(size)
        self._wake.set()

    def cut_off(self, reason: str) -> None:
        """Stop the stream (overflow, shutdown, disconnected); frees the queue now."""
        if self.cut is None:
            self.cut = reason
            self.release()
        self._wake.set()

    def release(self) -> None:
        if self._bytes:
            metrics.SSE_QUEUED_BYTES.dec(self._bytes)
        self._queue.clear()
        self._bytes = 0

    async def next_batch(self, timeout_s: float) -> list[LiveEvent]:
        """Every queued event, waiting up to ``timeout_s`` for one; [] on timeout or cut."""
        if not self._queue and self.cut is None:
            self._wake.clear()
            try:
                async with asyncio.timeout(timeout_s):
                    await self._wake.wait()
            except TimeoutError:
                return []
        if self.cut is not None:
            return []
        batch = list(self._queue)
        self.release()
        return batch


class LiveFeed:
    """Tails the chunk topic in a daemon thread; :meth:`subscribe` returns a run's viewer."""

    def __init__(self, settings: Settings, *, config: dict[str, Any] | None = None) -> None:
        self.topic = settings.names.topic(RUN_CHUNKS)
        self.discovery_interval_s = settings.feed_discovery_interval_s
        conf = dict(config or consumer_config(settings, ROLE, settings.names.group(ROLE)))
        conf.update(
            {
                "enable.auto.commit": False,
                "enable.auto.offset.store": False,
                # A position lost to truncation resumes at the end: viewers backfill gaps.
                "auto.offset.reset": "latest",
                "enable.partition.eof": False,
                "allow.auto.create.topics": False,
                "fetch.wait.max.ms": 100,
                "queued.max.messages.kbytes": 16 * 1024,
                "topic.metadata.refresh.interval.ms": 30_000,
            }
        )
        self._config = conf
        self._viewers: dict[str, set[Viewer]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._ready = threading.Event()
        self._pending = 0
        self._pending_lock = threading.Lock()
        self._drained = threading.Event()
        # Owned by the feed thread.
        self._assigned: set[int] = set()
        self._positions: dict[int, int] = {}
        self._start_offsets: dict[int, int] = {}
        self._initialised = False
        self._last_error_log = 0.0

    # --- the event loop's side ----------------------------------------------------

    async def start(self) -> None:
        """Start the thread; wait (up to ``START_TIMEOUT_S``) until partitions are assigned.

        With the broker unreachable it returns after the timeout and the thread keeps
        trying; the gateway still serves (replay from Postgres works without Kafka).
        """
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._stopping.clear()
        self._thread = threading.Thread(target=self._run, name="koda-live-feed", daemon=True)
        self._thread.start()
        if not await asyncio.to_thread(self._ready.wait, START_TIMEOUT_S):
            log.warning(
                "event=live_feed_not_ready topic=%s waited_s=%.0f", self.topic, START_TIMEOUT_S
            )

    async def stop(self) -> None:
        """Cut every viewer, stop the thread and close the consumer."""
        self.close_all("shutdown")
        self._stopping.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            await asyncio.to_thread(thread.join, 10.0)

    @property
    def ready(self) -> bool:
        """Partitions are assigned (the feed sees every record produced from now on)."""
        return self._ready.is_set()

    @property
    def viewer_count(self) -> int:
        return sum(len(v) for v in self._viewers.values())

    def subscribe(self, run_id: str, max_bytes: int) -> Viewer:
        """A new viewer of ``run_id``; it receives every record consumed from now on."""
        viewer = Viewer(run_id, max_bytes)
        self._viewers.setdefault(run_id, set()).add(viewer)
        return viewer

    def unsubscribe(self, viewer: Viewer) -> None:
        viewers = self._viewers.get(viewer.run_id)
        if viewers is not None:
            viewers.discard(viewer)
            if not viewers:
                del self._viewers[viewer.run_id]
        viewer.release()

    def close_all(self, reason: str) -> None:
        """Cut every viewer (they tell their clients to reconnect elsewhere)."""
        for viewers in list(self._viewers.values()):
            for viewer in list(viewers):
                viewer.cut_off(reason)

    def close_all_threadsafe(self, reason: str) -> None:
        """:meth:`close_all` from any thread (or a signal handler), run on the loop."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self.close_all, reason)
        except RuntimeError:
            pass  # the loop closed meanwhile

    def _dispatch(self, batch: list[tuple[str, LiveEvent]]) -> None:
        try:
            for run_id, event in batch:
                viewers = self._viewers.get(run_id)
                if viewers:
                    for viewer in tuple(viewers):
                        viewer.offer(event)
        finally:
            with self._pending_lock:
                self._pending -= 1
            self._drained.set()

    # --- the feed thread ------------------------------------------------------------

    def _run(self) -> None:
        backoff = 0.5
        while not self._stopping.is_set():
            consumer: Consumer | None = None
            try:
                consumer = Consumer(self._config)
                self._consume(consumer)
                backoff = 0.5
            except Exception as exc:  # noqa: BLE001 - the feed must outlive any error
                metrics.LIVE_FEED_ERRORS.inc()
                log.warning("event=live_feed_restart topic=%s error=%s", self.topic, exc)
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
                interval = self.discovery_interval_s if self._assigned else 0.5
                next_discovery = now + interval
                self._discover(consumer)
            msg = consumer.poll(POLL_S)
            if msg is None:
                continue
            messages = [msg, *consumer.consume(MAX_BATCH - 1, 0)]
            batch = self._route(messages)
            if batch:
                self._hand_over(batch)

    def _route(self, messages: list[Any]) -> list[tuple[str, LiveEvent]]:
        batch: list[tuple[str, LiveEvent]] = []
        read = 0
        for m in messages:
            err = m.error()
            if err is not None:
                self._on_error(err)
                continue
            read += 1
            self._positions[m.partition()] = m.offset() + 1
            key, value = m.key(), m.value()
            if key is None or value is None:
                continue  # tombstones of compacted runs
            try:
                run_id, seq = split_chunk_key(key.decode("utf-8", "replace"))
            except ValueError:
                continue
            if seq is None or run_id not in self._viewers:
                continue
            try:
                kind = json.loads(value)["kind"]
            except (ValueError, KeyError, TypeError):
                log.warning(
                    "event=live_feed_bad_record partition=%s offset=%s", m.partition(), m.offset()
                )
                continue
            if not isinstance(kind, str):
                continue
            batch.append((run_id, LiveEvent(seq, kind, event_frame(seq, kind, value))))
        if read:
            metrics.LIVE_FEED_RECORDS.inc(read)
        return batch

    def _hand_over(self, batch: list[tuple[str, LiveEvent]]) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with self._pending_lock:
            self._pending += 1
        try:
            loop.call_soon_threadsafe(self._dispatch, batch)
        except RuntimeError:
            return  # the loop closed under us: the gateway is stopping
        # Backpressure: a loop that falls behind pauses fetching, not memory.
        while self._pending > MAX_PENDING_BATCHES and not self._stopping.is_set():
            self._drained.clear()
            self._drained.wait(0.1)

    def _discover(self, consumer: Consumer) -> None:
        try:
            md = consumer.list_topics(self.topic, timeout=METADATA_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - the broker may be away; try later
            self._on_error(exc)
            return
        topic = md.topics.get(self.topic)
        if topic is None or topic.error is not None or not topic.partitions:
            # The broker answered: whatever partitions appear later are new to us.
            self._initialised = True
            self._ready.set()
            self._log_error(f"topic {self.topic} is not available")
            return
        new = sorted(set(topic.partitions) - self._assigned)
        if not new:
            return
        assignment = [TopicPartition(self.topic, p, self._offset_for(consumer, p)) for p in new]
        consumer.incremental_assign(assignment)
        self._assigned.update(new)
        if self._initialised:
            log.info("event=live_feed_partitions_added topic=%s partitions=%s", self.topic, new)
        self._initialised = True
        self._ready.set()

    def _offset_for(self, consumer: Consumer, partition: int) -> int:
        if partition in self._positions:
            return self._positions[partition]
        if partition not in self._start_offsets:
            if self._initialised:
                # Appeared after start-up: everything on it is new to this gateway.
                self._start_offsets[partition] = OFFSET_BEGINNING
            else:
                try:
                    _, high = consumer.get_watermark_offsets(
                        TopicPartition(self.topic, partition), timeout=METADATA_TIMEOUT_S
                    )
                    self._start_offsets[partition] = high
                except Exception:  # noqa: BLE001 - resolved lazily by librdkafka instead
                    self._start_offsets[partition] = OFFSET_END
        return self._start_offsets[partition]

    def _on_error(self, err: Any) -> None:
        metrics.LIVE_FEED_ERRORS.inc()
        if isinstance(err, KafkaError) and err.fatal():
            raise RuntimeError(f"fatal consumer error: {err.str()}")
        self._log_error(err.str() if isinstance(err, KafkaError) else str(err))

    def _log_error(self, text: str) -> None:
        now = time.monotonic()
        if now - self._last_error_log >= ERROR_LOG_INTERVAL_S:
            self._last_error_log = now
            log.warning("event=live_feed_error topic=%s error=%s", self.topic, text)
