"""Offset commits after work: a commit the broker refused is sent again.

The commit cursor moves on when a commit is taken, before the broker answers. A chaos
run's last check found a partition whose final commit was refused (the coordinator
was loading after a broker kill) and which then received no further record: its
committed offset stayed six records behind the work. The next flush must send it again.
"""

from __future__ import annotations

import asyncio

from koda_runtime.processors.commits import OffsetCommits
from koda_runtime.processors.cursor import PartitionCursors, Start, decode_done, encode_done
from koda_runtime.topics.kafka.intake import Fetched
from koda_runtime.topics.kafka.offsets import METADATA_MAX_CHARS


class Broker:
    """The group coordinator: refuses the next ``refuse`` commits, records the rest."""

    def __init__(self) -> None:
        self.refuse = 0
        self.sent: list[dict[int, int]] = []
        self.committed: dict[int, int] = {}
        self.metadata: dict[int, str] = {}

    async def base(self, partition: int) -> Start:
        offset = self.committed.get(partition, 0)
        return Start(offset, decode_done(offset, self.metadata.get(partition)))

    async def seek(self, partition: int, offset: int) -> None:
        raise AssertionError("no record is dropped in these tests")

    async def commit(self, offsets: dict[int, int], metadata: dict[int, str] | None = None) -> bool:
        self.sent.append(dict(offsets))
        if self.refuse:
            self.refuse -= 1
            return False
        self.committed.update(offsets)
        self.metadata.update(metadata or {})
        return True


def record(partition: int, offset: int) -> Fetched:
    return Fetched("runs", partition, offset, b"k", b"v", [], 1)


def worked(commits: OffsetCommits, cursors: PartitionCursors, partition: int, n: int) -> None:
    """Records 0..n-1 of ``partition`` read and acked, as the chains do after their work."""

    async def go() -> None:
        for offset in range(n):
            assert await cursors.admit(partition, offset, 1)
            cursors.advance(partition, offset)
            commits.ack(record(partition, offset))

    asyncio.run(go())


def setup() -> tuple[OffsetCommits, PartitionCursors, Broker]:
    broker = Broker()
    cursors = PartitionCursors(broker.base, broker.seek)
    return OffsetCommits(cursors, broker.commit), cursors, broker


def test_a_refused_commit_is_sent_again_with_no_new_record() -> None:
    commits, cursors, broker = setup()
    worked(commits, cursors, 18, 6)
    broker.refuse = 1
    asyncio.run(commits.flush())
    assert broker.sent == [{18: 6}] and broker.committed == {}
    asyncio.run(commits.flush())  # nothing new was acked
    assert broker.sent == [{18: 6}, {18: 6}]
    assert broker.committed == {18: 6}
    asyncio.run(commits.flush())  # confirmed: not sent a third time
    assert len(broker.sent) == 2


def test_a_later_ack_supersedes_the_refused_offset() -> None:
    commits, cursors, broker = setup()
    worked(commits, cursors, 3, 2)
    broker.refuse = 2
    asyncio.run(commits.flush())

    async def more() -> None:
        for offset in (2, 3):
            assert await cursors.admit(3, offset, 1)
            cursors.advance(3, offset)
            commits.ack(record(3, offset))

    asyncio.run(more())
    asyncio.run(commits.flush())  # refused again, now with the newer offset
    asyncio.run(commits.flush())
    assert broker.sent == [{3: 2}, {3: 4}, {3: 4}]
    assert broker.committed == {3: 4}


def test_a_revoked_partitions_refused_commit_is_not_sent_again() -> None:
    commits, cursors, broker = setup()
    worked(commits, cursors, 7, 3)
    broker.refuse = 1
    asyncio.run(commits.flush())
    cursors.forget([7])
    commits.forget([7])  # revoked: the next owner starts from the committed offset
    asyncio.run(commits.flush())
    assert broker.sent == [{7: 3}]


def acked(commits: OffsetCommits, cursors: PartitionCursors, partition: int, *ended: int) -> None:
    """Records 0..max(ended) of ``partition`` read; only ``ended`` acked (the others still
    run on their users' chains)."""

    async def go() -> None:
        for offset in range(max(ended) + 1):
            assert await cursors.admit(partition, offset, 1)
            cursors.advance(partition, offset)
        for offset in ended:
            commits.ack(record(partition, offset))

    asyncio.run(go())


def test_a_commit_names_the_records_that_ended_above_the_low_water_mark() -> None:
    commits, cursors, broker = setup()
    acked(commits, cursors, 4, 0, 1, 3, 4, 5, 8)  # 2 still runs: the low-water mark is 2
    asyncio.run(commits.flush())
    assert broker.committed == {4: 2}
    assert broker.metadata[4] == "koda1:1-3,6"
    assert decode_done(2, broker.metadata[4]) == {3, 4, 5, 8}
    asyncio.run(commits.flush())  # nothing new: nothing sent
    assert len(broker.sent) == 1
    commits.ack(record(4, 6))  # ended above the mark: the same offset, new metadata
    asyncio.run(commits.flush())
    assert broker.sent[-1] == {4: 2} and broker.metadata[4] == "koda1:1-4,6"


def test_the_next_owner_acks_what_ended_under_the_previous_one_without_running_it() -> None:
    commits, cursors, broker = setup()
    acked(commits, cursors, 4, 0, 1, 3, 5)
    asyncio.run(commits.flush())
    cursors.forget([4])
    commits.forget([4])  # revoked; assigned again, as to a new owner (generation 2)
    nxt = PartitionCursors(broker.base, broker.seek)
    after = OffsetCommits(nxt, broker.commit)
    ran: list[int] = []

    async def next_owner() -> None:
        for offset in range(2, 7):
            assert await nxt.admit(4, offset, 2)
            nxt.advance(4, offset)
            if nxt.ended_before(4, offset):
                after.ack(record(4, offset))
            else:
                ran.append(offset)

    asyncio.run(next_owner())
    assert ran == [2, 4, 6]  # 3 and 5 had ended: acked as they are
    for offset in ran:
        after.ack(record(4, offset))
    asyncio.run(after.flush())
    assert broker.committed[4] == 7 and broker.metadata[4] == ""


def test_done_offsets_survive_their_encoding_and_stop_at_the_size_bound() -> None:
    done = [10, 11, 12, 15, 20, 21]
    assert encode_done(10, done) == "koda1:0-2,5,10-11"
    assert decode_done(10, encode_done(10, done)) == set(done)
    assert decode_done(10, None) == frozenset() and decode_done(10, "other") == frozenset()
    assert decode_done(10, "koda1:x") == frozenset() and decode_done(10, "koda1:5-1") == set()
    many = list(range(0, 40_000, 2))  # no two adjacent: one range each
    text = encode_done(0, many)
    assert len(text) <= METADATA_MAX_CHARS
    kept = decode_done(0, text)
    assert kept and kept == set(many[: len(kept)])  # the lowest kept, the rest met again
