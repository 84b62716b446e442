"""The runs topic's records onto the partition chains (:class:`Dispatcher`).

The intake (topics/kafka/intake.py) hands over each fetched batch; the dispatcher
places each record with the partition cursors (exactly once, no hole) and queues it on
its partition's chain (processors/chains.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from koda_runtime.background import BackgroundTask
from koda_runtime.processors.rebalance import WorkerRuntime
from koda_runtime.topics.kafka.intake import Fetched

log = logging.getLogger("koda.worker")


class Dispatcher:
    """Takes the intake's batches in fetch order and queues each record on its
    partition's chain, exactly once and without a hole (the partition cursors)."""

    def __init__(
        self,
        runtime: WorkerRuntime,
        generation: Callable[[int], int | None],
        queue: asyncio.Queue[list[Fetched]],
    ) -> None:
        """``queue``: the batches the intake delivers (built before the intake, which
        puts into it); ``generation``: the intake's current assignment number of a
        partition."""
        self.runtime = runtime
        self.generation = generation
        self.queue = queue
        self.task = BackgroundTask("runs-dispatcher", self._run)

    def current(self, item: Fetched) -> bool:
        """A record of the partition's current assignment here. One fetched before the
        partition was revoked (or revoked and assigned again) belongs to its owner."""
        return (
            item.partition in self.runtime.assigned
            and self.generation(item.partition) == item.generation
        )

    async def _run(self) -> None:
        while True:
            batch = await self.queue.get()
            for item in batch:
                await self.dispatch(item)

    async def dispatch(self, item: Fetched) -> None:
        rt = self.runtime
        if not self.current(item) or not await self._admit(item):
            return
        if not self.current(item):
            return  # the assignment changed while the cursor looked its base up
        if rt.cursors.ended_before(item.partition, item.offset):
            # Ended under an earlier owner (the commit's metadata says so): acked as is.
            rt.cursors.advance(item.partition, item.offset)
            rt.commits.ack(item)
            return
        created = item.created or None  # no timestamp: the queue age counts from now
        if rt.chains.dispatch(item, item.partition, item.offset, item.key, created):
            rt.cursors.advance(item.partition, item.offset)

    async def _admit(self, item: Fetched) -> bool:
        try:
            return await self.runtime.cursors.admit(item.partition, item.offset, item.generation)
        except Exception as exc:  # noqa: BLE001 - the broker may be restarting
            # Never wait here: every partition's records queue behind this one. The
            # record is dropped; the tail check finds the partition behind its consumer
            # position once the broker answers again and seeks back for it.
            log.warning("cannot place partition=%d offset=%d: %s", item.partition, item.offset, exc)
            return False
