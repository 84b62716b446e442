"""The bounded reader: read partitions from a start to the end offsets seen at the start.

One librdkafka consumer that ``assign()`` s the partitions itself (never subscribes, so
it never joins a group or causes a rebalance). The end of each partition is its high
watermark read when the read was planned; records produced later are left for the next
read. Used by ``koda chunks outputs`` (topics/chunklog.py), the dead-letter commands
(topics/dlq.py) and ``koda replay`` (topics/replay/, which also reads unbounded with
``--follow`` and commits a named job's offsets through the same consumer).

A partition is done once a record at or past its end arrived, or the consumer reports
the partition's end (``enable.partition.eof``) at or past it: the end of a compacted
topic may be a gap, with no record at ``end - 1``.

    TopicError   a topic is missing, the broker did not answer, or a fatal read error
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator, Mapping
from itertools import repeat
from operator import is_not
from typing import Any, cast

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition

from koda_runtime.errors import TopicError
from koda_runtime.kafka import consumer_config
from koda_runtime.settings import Settings

log = logging.getLogger(__name__)

TP = tuple[str, int]
TIMEOUT_S = 15.0
POLL_S = 0.5


class BoundedReader:
    """One consumer for bounded (or, with ``ends=None``, unbounded) reads.

    ``group`` is only where a named job stores offsets (:meth:`commit`); librdkafka
    insists on one even when nothing is committed. ``config`` is merged over the
    reader's librdkafka configuration. Each broker request waits at most ``timeout_s``.
    Errors librdkafka retries are logged under ``read_error_event``.
    """

    def __init__(
        self,
        settings: Settings,
        role: str,
        group: str,
        *,
        config: Mapping[str, Any] | None = None,
        timeout_s: float = TIMEOUT_S,
        read_error_event: str = "topic_read_error",
    ) -> None:
        self.read_error_event = read_error_event
        self.bootstrap = settings.kafka_bootstrap
        self.group = group
        self.timeout_s = timeout_s
        conf = consumer_config(settings, role, group) | {
            "enable.partition.eof": True,
            "enable.auto.offset.store": False,
        }
        self.consumer = Consumer(conf | dict(config or {}))
        self.ends: dict[TP, int] | None = None
        self.positions: dict[TP, int] = {}
        self.open: set[TP] = set()

    # --- planning -------------------------------------------------------------------

    def partitions(self, topic: str) -> list[TP]:
        """The partitions of ``topic``; raises TopicError when it does not exist."""
        try:
            meta = self.consumer.list_topics(topic, timeout=self.timeout_s)
        except KafkaException as exc:
            raise self._fail("listing topics", exc) from exc
        info = meta.topics.get(topic)
        if info is None or info.error is not None:
            raise TopicError(
                f"topic {topic} does not exist on {self.bootstrap}: run `koda topics apply`"
            )
        return [(topic, p) for p in sorted(info.partitions)]

    def watermarks(self, tp: TP) -> tuple[int, int]:
        """The partition's log start and end offset, asked of its leader; asked again
        while the leader is not known yet (a topic just created, a broker just
        restarted), for at most ``timeout_s``."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                low, high = self.consumer.get_watermark_offsets(
                    TopicPartition(*tp), timeout=self.timeout_s
                )
                return int(low), int(high)
            except KafkaException as exc:
                error = exc.args[0] if exc.args else None
                retriable = isinstance(error, KafkaError) and (
                    error.retriable() or error.code() == KafkaError.NOT_LEADER_FOR_PARTITION
                )
                if not retriable or time.monotonic() > deadline:
                    raise self._fail(f"reading offsets of {tp[0]}[{tp[1]}]", exc) from exc
                time.sleep(0.2)  # a leader election takes a moment; ask again

    def committed(self, tps: Iterable[TP]) -> dict[TP, int]:
        """The group's committed offset per partition (negative where there is none)."""
        try:
            got = self.consumer.committed(
                [TopicPartition(*tp) for tp in tps], timeout=self.timeout_s
            )
        except KafkaException as exc:
            raise self._fail(f"reading the offsets of {self.group}", exc) from exc
        return {(x.topic, x.partition): x.offset for x in got}

    def offsets_for_times(self, tps: Iterable[TP], ms: int) -> dict[TP, int]:
        """Per partition the first offset at or after ``ms`` (epoch ms); -1 where none."""
        asked = [TopicPartition(t, p, ms) for t, p in tps]
        try:
            found = self.consumer.offsets_for_times(asked, timeout=self.timeout_s)
        except KafkaException as exc:
            raise self._fail("looking offsets up by time", exc) from exc
        return {(x.topic, x.partition): x.offset for x in found}

    # --- reading --------------------------------------------------------------------

    def assign(self, starts: Mapping[TP, int], ends: Mapping[TP, int] | None) -> None:
        """Read each partition of ``starts`` from its start up to (not including) its
        end in ``ends``; ``ends=None`` reads on without an end. A partition whose start
        is at its end is done at once (and paused)."""
        self.ends = None if ends is None else dict(ends)
        self.positions = dict(starts)
        self.open = {tp for tp in starts if self.ends is None or starts[tp] < self.ends[tp]}
        self.consumer.assign([TopicPartition(t, p, o) for (t, p), o in starts.items()])
        for tp in set(starts) - self.open:
            self.consumer.pause([TopicPartition(*tp)])

    def poll(self, max_records: int, timeout_s: float) -> list[Message]:
        """Up to ``max_records`` records inside the bounds, waiting up to ``timeout_s``.

        Moves :attr:`positions` (the next offset per partition) and closes partitions
        that reached their end. Errors librdkafka retries are logged; a fatal one
        raises TopicError.
        """
        try:
            batch = self.consumer.consume(num_messages=max_records, timeout=timeout_s)
        except KafkaException as exc:
            raise self._fail("reading", exc) from exc
        if self._all_inside(batch):
            return batch
        records = []
        is_open, ends = self.open, self.ends
        nexts: dict[TP, int] = {}  # the next offset per partition, applied after the loop
        for msg in batch:
            err = msg.error()
            tp = (msg.topic() or "", msg.partition() or 0)
            offset = msg.offset() or 0
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    # Everything before the end was delivered ahead of this event.
                    if tp in is_open:
                        nexts[tp] = max(nexts.get(tp, 0), offset)
                    continue
                if err.fatal():
                    raise TopicError(f"reading {tp[0] or 'the topics'} failed: {err.str()}")
                log.warning(
                    "event=%s topic=%s partition=%d error=%s",
                    self.read_error_event,
                    *tp,
                    err.str(),
                )
                continue
            if tp not in is_open:
                continue  # fetched before its partition reached the end
            if ends is not None and offset >= ends[tp]:
                self._close(tp)
                continue
            records.append(msg)
            nexts[tp] = offset + 1  # a partition's records come in offset order
        for tp, offset in nexts.items():
            self._advance(tp, offset)  # positions only move forward: max of the two
        return records

    def _all_inside(self, batch: list[Message]) -> bool:
        """True when every message of ``batch`` is a record of an open partition below
        its end; then the positions are moved past them. The common case of a poll,
        checked without a Python frame per record (a replay polls 20,000 at a time);
        otherwise :meth:`poll` looks at each one."""
        # is_not, not ==: a KafkaError compared with None raises.
        if not batch or any(map(is_not, map(Message.error, batch), repeat(None))):
            return False  # an error or a partition's end among them
        # Without an error a message has its topic, partition and offset; a partition's
        # records come in offset order, so the dict keeps each partition's last one.
        tps = zip(map(Message.topic, batch), map(Message.partition, batch), strict=True)
        last = cast("dict[TP, int]", dict(zip(tps, map(Message.offset, batch), strict=True)))
        ends = self.ends
        if not all(
            tp in self.open and (ends is None or offset < ends[tp]) for tp, offset in last.items()
        ):
            return False
        for tp, offset in last.items():
            self._advance(tp, offset + 1)
        return True

    def records(self, *, idle_timeout_s: float = TIMEOUT_S) -> Iterator[Message]:
        """Every record up to the ends, in offset order per partition. Raises TopicError
        when no progress is made for ``idle_timeout_s`` (a read with ``ends=None``
        never ends)."""
        deadline = time.monotonic() + idle_timeout_s
        while self.open:
            if time.monotonic() > deadline:
                left = ", ".join(f"{t}[{p}]" for t, p in sorted(self.open))
                raise TopicError(f"reading {left} made no progress for {idle_timeout_s:.0f}s")
            before = dict(self.positions)
            batch = self.poll(500, POLL_S)
            if batch or self.positions != before:
                deadline = time.monotonic() + idle_timeout_s
            yield from batch

    def high_watermark(self, tp: TP) -> int | None:
        """The last high watermark the fetches reported (no request); None when unknown."""
        _, high = self.consumer.get_watermark_offsets(TopicPartition(*tp), cached=True)
        return high if high >= 0 else None

    def commit(self, positions: Mapping[TP, int]) -> None:
        """Commit the next offset to read per partition to ``group`` (synchronous)."""
        if not positions:
            return
        offsets = [TopicPartition(t, p, o) for (t, p), o in positions.items()]
        try:
            self.consumer.commit(offsets=offsets, asynchronous=False)
        except KafkaException as exc:
            raise self._fail(f"committing offsets of {self.group}", exc) from exc

    def close(self) -> None:
        self.consumer.close()

    # --- internals ------------------------------------------------------------------

    def _end(self, tp: TP) -> int | None:
        return None if self.ends is None else self.ends[tp]

    def _advance(self, tp: TP, offset: int) -> None:
        end = self._end(tp)
        if end is not None:
            offset = min(offset, end)
        self.positions[tp] = max(self.positions[tp], offset)
        if end is not None and self.positions[tp] >= end:
            self._close(tp)

    def _close(self, tp: TP) -> None:
        if tp in self.open:
            self.open.discard(tp)
            self.consumer.pause([TopicPartition(*tp)])

    def _fail(self, what: str, exc: Exception) -> TopicError:
        return TopicError(f"{what} on {self.bootstrap} failed: {exc}; is Kafka reachable?")
