"""Partition epochs: the owner token of each runs partition (``partition_epochs``).

Fencing (docs/design.md §6): every assignment of a runs partition bumps its epoch; the
worker carries that epoch as its :class:`Fence`. A fenced write (schemas/runs/worker.py,
schemas/journal.py) succeeds only while the partition's epoch is still the writer's
and the run's ``fence`` column is that epoch, and locks the epoch row ``FOR SHARE``:
a new owner's bump waits for an in-flight write of the old owner to finish and then
sees it; afterwards the old owner's writes match zero rows.

The fenced statements join ``partition_epochs`` themselves (one statement, one round
trip); this module holds the bump on assignment and the ownership check.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine


@dataclass(frozen=True)
class Fence:
    """The owner token of one partition: carried into every conditional write."""

    topic: str
    partition: int
    epoch: int


BUMP_EPOCHS = text(
    """
    INSERT INTO partition_epochs (topic, partition, epoch, worker_id)
    SELECT :topic, p, 1, :worker FROM unnest(CAST(:parts AS int[])) AS p
    ON CONFLICT (topic, partition) DO UPDATE
       SET epoch = partition_epochs.epoch + 1,
           worker_id = EXCLUDED.worker_id, assigned_at = now()
    RETURNING partition, epoch
    """
)

HOLDS_EPOCH = text(
    """
    SELECT 1 FROM partition_epochs
     WHERE topic = :topic AND partition = :partition AND epoch = :epoch
    """
)


async def bump_epochs(
    engine: AsyncEngine, topic: str, partitions: Sequence[int], worker_id: str
) -> dict[int, int]:
    """Take ownership of ``partitions``: their epochs grow by one; returns the new ones."""
    if not partitions:
        return {}
    async with engine.begin() as conn:
        rows = await conn.execute(
            BUMP_EPOCHS,
            {"topic": topic, "parts": sorted(partitions), "worker": worker_id},
        )
        return {int(p): int(e) for p, e in rows}


async def holds(engine: AsyncEngine, fence: Fence) -> bool:
    """Whether ``fence`` is still its partition's epoch: no other worker has taken the
    partition since this one did."""
    async with engine.connect() as conn:
        row = await conn.execute(
            HOLDS_EPOCH,
            {"topic": fence.topic, "partition": fence.partition, "epoch": fence.epoch},
        )
        return row.first() is not None
