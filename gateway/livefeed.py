"""The live feed: every gateway tails the chunk topic and fans records out to its viewers.

    <env>.koda.run-chunks ──the no-group tail (topics/kafka/tail.py)──▶ batches
        ──call_soon_threadsafe──▶ event loop: viewers[run_id] ──▶ each viewer's queue

* **Where it starts.** At start-up every partition is assigned at its current high
  watermark, resolved before :meth:`LiveFeed.start` returns, so any record produced
  after the gateway accepts connections is seen. Partitions that appear later (the
  topic grew, or did not exist at start-up) are assigned from their beginning.
  Discovery runs every ``feed_discovery_interval_s`` (every 0.5 s while nothing is
  assigned). Nothing is committed: the feed is not a consumer group member.
* **Only watched runs cost anything.** The tail's thread routes by key
  (``<run_id>:<seq>``) and skips records of runs nobody on this gateway watches
  before decoding them. A watched record's SSE frame is built once in the thread and
  shared by every viewer of the run.
* **Bounded everywhere.** librdkafka's pre-fetch queue is capped; the thread stops
  handing batches to the loop while 16 are unprocessed (so a busy loop pauses
  fetching instead of growing memory); each viewer's queue holds at
  most ``sse_queue_bytes`` bytes of frames. A viewer whose queue would overflow is cut
  off (its queue freed at once); the stream then tells the client to reconnect, and it
  resumes from Postgres with Last-Event-ID. A slow viewer never blocks the others.
* **Bad records.** A watched record is decoded and checked before it becomes a frame:
  it must be a ``run.chunk/1`` value of the run and seq its key names, with a kind
  koda writes. Anything else (undecodable, nested too deep, forged for another run)
  is dropped with a warning and ``koda_records_skipped_total{reason="bad_chunk_record"}``;
  no record can raise out of the tail's thread, so none rebuilds the consumer or
  costs other records of its batch. A viewer missing a seq backfills it from Postgres.
* **Broker restarts.** librdkafka reconnects by itself and keeps the positions; a fatal
  consumer error, or no broker answering for 15 s, rebuilds the consumer at the
  positions already read. Records missed
  in any such window are not lost to viewers: a skipped seq triggers a backfill from
  Postgres, and an idle stream re-reads Postgres every keep-alive interval.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from koda_runtime import metrics
from koda_runtime.errors import RecordError
from koda_runtime.gateway.eventstream import TERMINAL_KINDS, event_frame
from koda_runtime.lifecycle.chunks import split_chunk_key
from koda_runtime.settings import Settings
from koda_runtime.topics.catalogue import RUN_CHUNKS
from koda_runtime.topics.kafka.tail import REBUILD_AFTER_S, TailEvents, TopicTail
from koda_runtime.topics.records.codec import decode_keyed_chunk

log = logging.getLogger(__name__)

ROLE = "gateway-feed"
START_TIMEOUT_S = 5.0
# Bad records are logged at most this often (each is counted): a flood of forged
# records must not flood the log.
BAD_RECORD_LOG_EVERY_S = 10.0
EVENTS = TailEvents(
    error="live_feed_error",
    restart="live_feed_restart",
    not_ready="live_feed_not_ready",
    partitions_added="live_feed_partitions_added",
    errors_metric=metrics.LIVE_FEED_ERRORS,
)


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
    """Tails the chunk topic; :meth:`subscribe` returns a run's viewer.

    ``config`` is merged over the tail's librdkafka configuration; ``rebuild_after_s``
    is how long no broker may answer before the tail rebuilds its consumer.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        config: dict[str, Any] | None = None,
        rebuild_after_s: float = REBUILD_AFTER_S,
    ) -> None:
        self.topic = settings.names.topic(RUN_CHUNKS)
        self._viewers: dict[str, set[Viewer]] = {}
        self._tail: TopicTail[tuple[str, LiveEvent]] = TopicTail(
            settings,
            ROLE,
            self.topic,
            # A position lost to truncation resumes at the end: viewers backfill gaps.
            start="end",
            route=self._route,
            deliver=self._dispatch,
            events=EVENTS,
            discovery_interval_s=settings.feed_discovery_interval_s,
            config=config,
            rebuild_after_s=rebuild_after_s,
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._bad_logged = 0.0  # when a bad record was last logged (the tail's thread)
        self.bad_records = 0

    # --- the event loop's side ----------------------------------------------------

    async def start(self) -> bool:
        """Start tailing; wait (up to ``START_TIMEOUT_S``) until partitions are assigned.

        True once they are: every record produced from now on reaches the viewers.
        With the broker unreachable it returns False after the timeout and the tail
        keeps trying; the gateway still serves (replay from Postgres works without Kafka).
        """
        self._loop = asyncio.get_running_loop()
        self._tail.start()
        return await self._tail.wait_ready(START_TIMEOUT_S)

    async def stop(self) -> None:
        """Cut every viewer, stop the tail and close its consumer."""
        self.close_all("shutdown")
        await self._tail.stop()

    @property
    def rebuilds(self) -> int:
        """How many times the tail rebuilt its consumer (a fatal error, or no broker)."""
        return self._tail.rebuilds

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
        for run_id, event in batch:
            viewers = self._viewers.get(run_id)
            if viewers:
                for viewer in tuple(viewers):
                    viewer.offer(event)

    # --- the tail's thread ----------------------------------------------------------

    def _route(self, messages: list[Any]) -> list[tuple[str, LiveEvent]]:
        # Reads ``_viewers`` while the loop changes it: a membership test of a dict is
        # atomic under the GIL, and a run subscribed a moment late is backfilled.
        metrics.LIVE_FEED_RECORDS.inc(len(messages))
        batch: list[tuple[str, LiveEvent]] = []
        for m in messages:
            try:
                routed = self._route_one(m)
            except Exception as exc:  # noqa: BLE001 - one record never costs the batch
                self._bad_record(m, f"{type(exc).__name__}: {exc}")
                continue
            if routed is not None:
                batch.append(routed)
        return batch

    def _route_one(self, m: Any) -> tuple[str, LiveEvent] | None:
        key, value = m.key(), m.value()
        if key is None or value is None:
            return None  # tombstones of compacted runs
        try:
            run_id, seq = split_chunk_key(key.decode("utf-8", "replace"))
        except ValueError:
            return None
        if seq is None or run_id not in self._viewers:
            return None
        try:
            chunk = decode_keyed_chunk(run_id, seq, value)
        except RecordError as exc:
            self._bad_record(m, f"{exc.reason}: {exc.detail}")
            return None
        return run_id, LiveEvent(seq, chunk.kind, event_frame(seq, chunk.kind, value))

    def _bad_record(self, m: Any, why: str) -> None:
        self.bad_records += 1
        metrics.RECORDS_SKIPPED.labels(reason="bad_chunk_record").inc()
        now = time.monotonic()
        if now - self._bad_logged >= BAD_RECORD_LOG_EVERY_S:
            self._bad_logged = now
            log.warning(
                "event=live_feed_bad_record partition=%s offset=%s skipped=%d: %s",
                m.partition(),
                m.offset(),
                self.bad_records,
                why[:300],
            )
