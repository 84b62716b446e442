"""Per-partition read and commit cursors: no record is skipped, none is committed unread.

Faust drops fetched records in several places around a rebalance (a ``getmany`` batch
cut short when the generation changes, records fetched while flow is stopped, a
stale read offset left behind by the old batch), and its "seek back to committed"
moves only partitions that *have* a committed offset. A dropped record is not read
again in that assignment, and Faust would then commit the next record's offset past
it. Koda therefore keeps its own cursor per runs partition and generation:

* ``base``: where this assignment must start, the group's committed offset or the
  log start when there is none (looked up from the broker on the first record).
* ``next``: the offset the partition's chain must receive next. A record beyond it
  means records were dropped on the way: koda seeks the consumer back to ``next``
  and drops what arrives until ``next`` does. A record below it is a re-delivery.
  When the dropped record was the partition's last, no later record arrives to
  show the hole: ``watch``, run every few seconds, compares ``next`` with the
  consumer's position instead.
* ``commit``: the lowest offset not yet committed; a commit must start exactly there
  (``take_commit``), so a hole in the acks can never be committed over.
* ``done``: records of one partition end out of offset order (a chain per user key),
  so a commit also names, in its metadata, the offsets above it whose records had
  ended (:func:`encode_done`). The next owner acks those at once instead of meeting
  them again (``ended_before``): a record dead-lettered above a partition's low-water
  mark is not dead-lettered twice after a handoff.

An offset can hold no record at all (a transaction marker written by an outside
transactional producer). Such a hole survives every rewind; after ``max_rewinds``
rewinds in a row for the same offset koda accepts it, logs it, and lets the commit
cursor step over it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

from koda_runtime.errors import TopicError
from koda_runtime.metrics import OFFSET_REWINDS
from koda_runtime.topics.kafka.offsets import Start, decode_done, encode_done

__all__ = ["BaseLookup", "PartitionCursors", "Seek", "Start", "decode_done", "encode_done"]

log = logging.getLogger("koda.worker")

Seek = Callable[[int, int], Awaitable[None]]

BaseLookup = Callable[[int], Awaitable["int | Start"]]


@dataclass
class _Cursor:
    generation: int
    next: int
    commit: int
    rewound_at: float | None = None
    rewinds: int = 0
    holes: set[int] = field(default_factory=set)
    watched: int | None = None  # ``next`` at the last watch pass that found it behind
    done: set[int] = field(default_factory=set)  # ended before this assignment began


class PartitionCursors:
    """The read and commit positions of the runs partitions this worker holds.

    ``lookup_base(partition)`` returns the first offset to read in a new assignment;
    ``seek(partition, offset)`` moves the consumer. A rewind is repeated at most every
    ``reseek_after_s`` seconds (default 2) while stale records are still arriving; after
    ``max_rewinds`` (default 3) the missing offsets are taken to hold no records.
    """

    def __init__(
        self,
        lookup_base: BaseLookup,
        seek: Seek,
        *,
        reseek_after_s: float = 2.0,
        max_rewinds: int = 3,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._lookup_base = lookup_base
        self._seek = seek
        self._reseek_after_s = reseek_after_s
        self._max_rewinds = max_rewinds
        self._clock = clock
        self._cursors: dict[int, _Cursor] = {}
        self._retry_at: dict[int, float] = {}

    async def admit(self, partition: int, offset: int, generation: int) -> bool:
        """True if ``offset`` is the record the partition's chain must get next.

        Call ``advance`` once the record is queued. False means drop it: either the
        chain already has it, or records before it were lost on the way and the
        consumer has been sent back for them.
        """
        cur = await self._cursor(partition, generation)
        if offset == cur.next:
            cur.rewound_at = None
            cur.rewinds = 0
            return True
        if offset < cur.next:
            return False
        now = self._clock()
        if cur.rewound_at is not None and now - cur.rewound_at < self._reseek_after_s:
            return False  # still draining records fetched before the last seek
        if cur.rewinds >= self._max_rewinds:
            log.warning(
                "offsets %d..%d of partition=%d hold no records; continuing at offset=%d",
                cur.next,
                offset - 1,
                partition,
                offset,
            )
            cur.holes.update(range(cur.next, offset))
            cur.next = offset
            cur.rewound_at = None
            cur.rewinds = 0
            return True
        log.warning(
            "records missing before offset=%d partition=%d expected=%d: seeking back",
            offset,
            partition,
            cur.next,
        )
        cur.rewinds += 1
        await self._rewind(partition, cur)
        return False

    async def _rewind(self, partition: int, cur: _Cursor) -> None:
        """Send the consumer back to ``cur.next``; admit drops arrivals for a while."""
        OFFSET_REWINDS.inc()
        cur.rewound_at = self._clock()
        await self._seek(partition, cur.next)

    async def _cursor(self, partition: int, generation: int) -> _Cursor:
        cur = self._cursors.get(partition)
        if cur is not None and cur.generation == generation:
            return cur
        if self._clock() < self._retry_at.get(partition, 0.0):
            raise TopicError(f"start offset of partition {partition} unknown; retrying soon")
        try:
            found = await self._lookup_base(partition)
        except Exception:
            # Records of this partition are dropped without asking again for a while:
            # each lookup may wait out a request timeout, and the dispatcher waits with it.
            self._retry_at[partition] = self._clock() + self._reseek_after_s
            raise
        self._retry_at.pop(partition, None)
        start = found if isinstance(found, Start) else Start(found)
        cur = self._cursors.get(partition)  # made by someone else during the lookup?
        if cur is None or cur.generation != generation:
            cur = _Cursor(generation, start.offset, start.offset, done=set(start.done))
            self._cursors[partition] = cur
        return cur

    async def watch(
        self,
        partitions: Iterable[int],
        generation: int,
        position: Callable[[int], Awaitable[int | None]],
    ) -> None:
        """One pass of the tail check over the held ``partitions``; call it every few
        seconds.

        A record dropped on the way is noticed by ``admit`` when a later one arrives;
        when it was the partition's last record (or every record of the partition was
        dropped, so it has no cursor yet), nothing arrives. So: a partition whose
        consumer position is past ``next`` and made no progress since the last pass
        is sent back to ``next``.
        """
        for partition in list(partitions):
            cur = await self._cursor(partition, generation)
            pos = await position(partition)
            if pos is None or pos <= cur.next:
                cur.watched = None
                continue
            if cur.watched != cur.next:
                cur.watched = cur.next  # behind now: in flight, or lost; see next pass
                continue
            if self._cursors.get(partition) is not cur:
                continue  # revoked or re-assigned during the lookup
            log.warning(
                "consumer at offset=%d partition=%d but offset=%d never arrived: seeking back",
                pos,
                partition,
                cur.next,
            )
            cur.watched = None
            await self._rewind(partition, cur)

    def advance(self, partition: int, offset: int) -> None:
        """The chain has queued ``offset``: expect the one after it."""
        cur = self._cursors.get(partition)
        if cur is not None and offset == cur.next:
            cur.next = offset + 1

    def ended_before(self, partition: int, offset: int) -> bool:
        """Whether ``offset``'s record had ended before this assignment began (its
        commit's metadata said so): acked without being run again. Asked once per
        record, in offset order."""
        cur = self._cursors.get(partition)
        if cur is None or not cur.done:
            return False
        if offset in cur.done:
            cur.done.discard(offset)
            return True
        return False

    def commit_offset(self, partition: int) -> int | None:
        """The commit cursor of ``partition`` (None: no cursor in this assignment)."""
        cur = self._cursors.get(partition)
        return None if cur is None else cur.commit

    def take_commit(self, partition: int, acked: list[int]) -> int | None:
        """The offset to commit for ``partition`` given its sorted acked offsets.

        Removes what it consumes (and acks below the commit cursor, left over from an
        earlier assignment) from ``acked``. None when the acks do not start at the
        commit cursor, or when the partition has no cursor in this assignment.
        """
        cur = self._cursors.get(partition)
        if cur is None:
            return None
        stale = 0
        while stale < len(acked) and acked[stale] < cur.commit:
            stale += 1
        del acked[:stale]
        start = cur.commit
        taken = 0
        while True:
            if taken < len(acked) and acked[taken] == cur.commit:
                taken += 1
            elif cur.commit in cur.holes:
                cur.holes.discard(cur.commit)
            else:
                break
            cur.commit += 1
        del acked[:taken]
        return cur.commit if cur.commit > start else None

    def holds(self, partition: int) -> bool:
        """True while ``partition`` has a cursor (this assignment's)."""
        return partition in self._cursors

    def forget(self, partitions: Iterable[int]) -> None:
        """The partitions were revoked: the next assignment looks its base up again."""
        for p in partitions:
            self._cursors.pop(p, None)
