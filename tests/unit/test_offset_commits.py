"""Offset commits after work: a commit the broker refused is sent again.

The commit cursor moves on when a commit is taken, before the broker answers. A chaos
run's last check found a partition whose final commit was refused (the coordinator
was loading after a broker kill) and which then received no further record: its
committed offset stayed six records behind the work. The next flush must send it again.
"""

from __future__ import annotations

import asyncio

from koda_runtime.processors.app import OffsetCommits
from koda_runtime.processors.cursor import PartitionCursors
from koda_runtime.topics.kafka.intake import Fetched


class Broker:
    """The group coordinator: refuses the next ``refuse`` commits, records the rest."""

    def __init__(self) -> None:
        self.refuse = 0
        self.sent: list[dict[int, int]] = []
        self.committed: dict[int, int] = {}

    async def base(self, partition: int) -> int:
        return self.committed.get(partition, 0)

    async def seek(self, partition: int, offset: int) -> None:
        raise AssertionError("no record is dropped in these tests")

    async def commit(self, offsets: dict[int, int]) -> bool:
        self.sent.append(dict(offsets))
        if self.refuse:
            self.refuse -= 1
            return False
        self.committed.update(offsets)
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
