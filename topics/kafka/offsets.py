"""The group's committed offsets and the partitions' watermarks, read from the broker.

Through a librdkafka *consumer* that never subscribes (so it never joins the group),
in one thread of its own, and not through aiokafka's consumer inside Faust: there a
``ListOffsets`` request queues behind the long-polling fetch and takes up to 1.5 s.
Not through the AdminClient either: librdkafka's admin requests abort or crash the
whole process when they time out across a broker restart (``rd_kafka_enq_once_del_
source_return: Assertion `eonce->refcnt > 0' failed``, librdkafka issue 4605; seen
here killing every worker at once when the broker came back).

The worker's partition cursors ask it where an assignment starts, the worker's lag
gauge and the gateway's ``GET /admin/lag`` ask it how far the group is behind
(:meth:`GroupOffsetReader.lags`, the one lag formula). Each keeps one reader, and
with it one client, for its lifetime.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from confluent_kafka import Consumer, TopicPartition

from koda_runtime.kafka import consumer_config
from koda_runtime.settings import Settings

T = TypeVar("T")

# Each call blocks the reader's own thread at most this long (seconds).
REQUEST_TIMEOUT_S = 5.0

# Offsets at or above a committed offset whose records had ended when it was committed,
# carried in the commit's metadata: ``koda1:`` then ranges relative to the committed
# offset (``0-2,5``). Kafka keeps at most ``offset.metadata.max.bytes`` (4096 by default)
# per partition; past METADATA_MAX_CHARS the highest ranges are left out, and their
# records are read and met again (a run already terminal is skipped).
METADATA_PREFIX = "koda1:"
METADATA_MAX_CHARS = 3000


@dataclass(frozen=True)
class Start:
    """Where an assignment of a partition starts: the committed offset (or the log
    start) and the offsets above it whose records had already ended."""

    offset: int
    done: frozenset[int] = frozenset()


def encode_done(commit: int, done: list[int]) -> str:
    """``done`` (sorted offsets above ``commit``) as commit metadata."""
    parts: list[str] = []
    size = len(METADATA_PREFIX)
    i = 0
    while i < len(done):
        j = i
        while j + 1 < len(done) and done[j + 1] == done[j] + 1:
            j += 1
        lo, hi = done[i] - commit, done[j] - commit
        part = str(lo) if lo == hi else f"{lo}-{hi}"
        if size + len(part) + 1 > METADATA_MAX_CHARS:
            break
        parts.append(part)
        size += len(part) + 1
        i = j + 1
    return METADATA_PREFIX + ",".join(parts) if parts else ""


def decode_done(commit: int, metadata: str | None) -> frozenset[int]:
    """The offsets :func:`encode_done` wrote; nothing for metadata koda did not write."""
    if not metadata or not metadata.startswith(METADATA_PREFIX):
        return frozenset()
    out: set[int] = set()
    try:
        for part in metadata[len(METADATA_PREFIX) :].split(","):
            lo, _, hi = part.partition("-")
            a = int(lo)
            b = int(hi) if hi else a
            if a < 0 or b < a or b - a > 1_000_000:
                return frozenset()
            out.update(range(commit + a, commit + b + 1))
    except ValueError:
        return frozenset()
    return frozenset(out)


@dataclass(frozen=True)
class PartitionLag:
    """Where the group stands on one partition: ``lag`` = end − committed (− the log
    start when the group committed nothing there)."""

    partition: int
    start: int
    end: int
    committed: int | None

    @property
    def lag(self) -> int:
        return max(0, self.end - (self.start if self.committed is None else self.committed))


class GroupOffsetReader:
    """Reads ``group``'s committed offsets and the watermarks of ``topic``'s partitions."""

    def __init__(self, settings: Settings, role: str, topic: str, group: str) -> None:
        self.settings, self.role, self.topic, self.group = settings, role, topic, group
        self._consumer: Consumer | None = None
        # One thread: calls on the consumer never overlap, and close() runs after them.
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"koda-{role}")

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """Run a blocking method of this reader on its thread."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    def _client(self) -> Consumer:
        if self._consumer is None:
            conf = consumer_config(self.settings, self.role, self.group)
            self._consumer = Consumer(conf | {"socket.timeout.ms": int(REQUEST_TIMEOUT_S * 1000)})
        return self._consumer

    def committed(self, partitions: Iterable[int]) -> dict[int, int | None]:
        """Blocking: the committed offset per partition; None where the group has none."""
        tps = [TopicPartition(self.topic, p) for p in partitions]
        got = self._client().committed(tps, timeout=REQUEST_TIMEOUT_S)
        return {tp.partition: (tp.offset if tp.offset >= 0 else None) for tp in got}

    def watermarks(self, partition: int) -> tuple[int, int]:
        """Blocking: (log start, end offset) of the partition, asked of its leader."""
        low, high = self._client().get_watermark_offsets(
            TopicPartition(self.topic, partition), timeout=REQUEST_TIMEOUT_S, cached=False
        )
        return int(low), int(high)

    def start_offset(self, partition: int) -> int:
        """Blocking: where a new assignment of ``partition`` starts reading.

        The group's committed offset (asked of the group coordinator only); the log
        start when the group has none (asked of the partition's leader).
        """
        committed = self.committed([partition]).get(partition)
        if committed is not None:
            return committed
        low, _ = self.watermarks(partition)
        return low

    def start(self, partition: int) -> Start:
        """Blocking: :meth:`start_offset`, with the offsets above it whose records had
        ended (the worker's commit metadata, processors/cursor.py)."""
        tp = TopicPartition(self.topic, partition)
        (got,) = self._client().committed([tp], timeout=REQUEST_TIMEOUT_S)
        if got.offset >= 0:
            return Start(got.offset, decode_done(got.offset, got.metadata))
        low, _ = self.watermarks(partition)
        return Start(low)

    def lags(self, partitions: Iterable[int]) -> list[PartitionLag]:
        """Blocking: the group's committed offsets, then each partition's watermarks."""
        wanted = sorted(set(partitions))
        committed = self.committed(wanted)
        rows = []
        for p in wanted:
            low, high = self.watermarks(p)
            rows.append(PartitionLag(p, low, high, committed.get(p)))
        return rows

    def _close(self) -> None:
        consumer, self._consumer = self._consumer, None
        if consumer is not None:
            consumer.close()

    async def aclose(self) -> None:
        """Close the client once the calls queued before it are done (each at most
        ``REQUEST_TIMEOUT_S``), then let the thread go."""
        await self.run(self._close)
        self._thread.shutdown(wait=False)
