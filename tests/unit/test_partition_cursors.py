"""The read and commit cursors that keep a dropped record from being skipped."""

from __future__ import annotations

import asyncio

from koda_runtime.processors.cursor import PartitionCursors


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Broker:
    """Stands in for the base lookup and the consumer seek."""

    def __init__(self, base: int) -> None:
        self.base = base
        self.lookups = 0
        self.seeks: list[tuple[int, int]] = []

    async def lookup(self, partition: int) -> int:
        self.lookups += 1
        return self.base

    async def seek(self, partition: int, offset: int) -> None:
        self.seeks.append((partition, offset))


def make(base: int = 0, **kw: float) -> tuple[PartitionCursors, Broker, FakeClock]:
    broker, clock = Broker(base), FakeClock()
    return PartitionCursors(broker.lookup, broker.seek, clock=clock, **kw), broker, clock  # type: ignore[arg-type]


def feed(cursors: PartitionCursors, offsets: list[int], generation: int = 1) -> list[int]:
    """The offsets the chain would receive, in order."""

    async def go() -> list[int]:
        got = []
        for o in offsets:
            if await cursors.admit(3, o, generation):
                cursors.advance(3, o)
                got.append(o)
        return got

    return asyncio.run(go())


def test_records_in_order_from_the_base_all_pass() -> None:
    cursors, broker, _ = make(base=5)
    assert feed(cursors, [5, 6, 7]) == [5, 6, 7]
    assert broker.lookups == 1 and broker.seeks == []


def test_a_record_after_a_dropped_one_sends_the_consumer_back() -> None:
    # Nothing committed: the base is the log start, 0. Offset 0 was dropped by the
    # consumer around a rebalance, so the first record to arrive is 1.
    cursors, broker, _ = make(base=0)
    assert feed(cursors, [1, 2]) == []
    assert broker.seeks == [(3, 0)]  # once: 2 arrives within the re-seek window
    assert feed(cursors, [0, 1, 2]) == [0, 1, 2]


def test_redelivered_records_are_dropped() -> None:
    cursors, _, _ = make(base=0)
    assert feed(cursors, [0, 1, 0, 1, 2]) == [0, 1, 2]


def test_a_new_generation_looks_the_base_up_again() -> None:
    cursors, broker, _ = make(base=0)
    feed(cursors, [0, 1])
    broker.base = 1
    assert feed(cursors, [1, 2], generation=2) == [1, 2]
    assert broker.lookups == 2


def test_stale_records_keep_arriving_then_the_missing_one() -> None:
    cursors, broker, clock = make(base=10, reseek_after_s=2.0)
    assert feed(cursors, [12]) == []
    clock.now = 1.0
    assert feed(cursors, [13]) == []  # inside the window: no second seek
    clock.now = 3.0
    assert feed(cursors, [14]) == []  # window over, still missing: seek again
    assert broker.seeks == [(3, 10), (3, 10)]
    assert feed(cursors, [10, 11, 12]) == [10, 11, 12]


def test_offsets_that_hold_no_record_are_accepted_after_the_rewinds() -> None:
    # Offset 7 is a transaction marker: every seek back to it delivers 8 first.
    cursors, broker, clock = make(base=7, reseek_after_s=1.0, max_rewinds=3)
    for t in range(4):
        clock.now = t * 1.5
        got = feed(cursors, [8])
    assert len(broker.seeks) == 3
    assert got == [8]
    # ...and the commit cursor steps over the hole once 8 is acked.
    assert cursors.take_commit(3, [8]) == 9


def test_a_commit_must_start_at_the_commit_cursor() -> None:
    cursors, _, _ = make(base=0)
    feed(cursors, [0, 1, 2])
    acked = [1, 2]
    assert cursors.take_commit(3, acked) is None  # 0 is not done: commit nothing
    assert acked == [1, 2]
    acked = [0, 1, 2]
    assert cursors.take_commit(3, acked) == 3
    assert acked == []


def test_a_commit_stops_at_the_first_gap_in_the_acks() -> None:
    cursors, _, _ = make(base=0)
    feed(cursors, [0, 1, 2, 3])
    acked = [0, 1, 3]
    assert cursors.take_commit(3, acked) == 2
    assert acked == [3]
    assert cursors.take_commit(3, acked) is None
    acked = [2, 3]
    assert cursors.take_commit(3, acked) == 4


def test_acks_below_the_commit_cursor_are_discarded() -> None:
    cursors, _, _ = make(base=4)  # committed at 4 by an earlier owner
    feed(cursors, [4])
    acked = [2, 3, 4]  # late acks of an earlier assignment
    assert cursors.take_commit(3, acked) == 5
    assert acked == []


def test_no_commit_for_a_partition_without_a_cursor() -> None:
    cursors, _, _ = make(base=0)
    feed(cursors, [0])
    cursors.forget([3])
    assert cursors.take_commit(3, [0]) is None


def test_a_lost_last_record_is_found_by_the_tail_watch() -> None:
    # Offsets 4 and 5 were dropped and nothing follows them: admit never sees a hole.
    cursors, broker, _ = make(base=0)
    feed(cursors, [0, 1, 2, 3])

    async def position(partition: int) -> int:
        return 6

    asyncio.run(cursors.watch([3], 1, position))
    assert broker.seeks == []  # behind once: could still be on its way
    asyncio.run(cursors.watch([3], 1, position))
    assert broker.seeks == [(3, 4)]
    assert feed(cursors, [4, 5]) == [4, 5]


def test_the_tail_watch_leaves_a_partition_that_progresses_alone() -> None:
    cursors, broker, _ = make(base=0)
    feed(cursors, [0])
    positions = iter([3, 3, 3])

    async def position(partition: int) -> int:
        return next(positions)

    asyncio.run(cursors.watch([3], 1, position))
    feed(cursors, [1])  # progress between passes
    asyncio.run(cursors.watch([3], 1, position))
    feed(cursors, [2])  # caught up with the position
    asyncio.run(cursors.watch([3], 1, position))
    assert broker.seeks == []


def test_a_partition_whose_every_record_was_dropped_is_found_by_the_tail_watch() -> None:
    # Records 0..4 arrived before the worker knew it held the partition and were
    # dropped: no record was admitted, so no hole was ever seen.
    cursors, broker, _ = make(base=0)

    async def position(partition: int) -> int:
        return 5

    asyncio.run(cursors.watch([3], 1, position))
    asyncio.run(cursors.watch([3], 1, position))
    assert broker.seeks == [(3, 0)]
    assert feed(cursors, [0, 1, 2, 3, 4]) == [0, 1, 2, 3, 4]


def test_a_failed_base_lookup_is_not_repeated_at_once() -> None:
    cursors, broker, clock = make(base=0, reseek_after_s=2.0)
    calls = 0

    async def failing(partition: int) -> int:
        nonlocal calls
        calls += 1
        raise RuntimeError("leader not available")

    cursors._lookup_base = failing

    async def admit(offset: int) -> object:
        try:
            return await cursors.admit(3, offset, 1)
        except Exception as exc:  # noqa: BLE001
            return type(exc).__name__

    assert asyncio.run(admit(0)) == "RuntimeError"
    assert asyncio.run(admit(1)) == "TopicError"  # no second broker call yet
    assert calls == 1
    clock.now = 2.5
    cursors._lookup_base = broker.lookup
    assert asyncio.run(admit(0)) is True
