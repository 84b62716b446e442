"""Fencing of the runs partitions: the epochs this worker holds, and the fenced call a
partition chain makes for each record.

:class:`PartitionFences` takes a partition's epoch (its fencing token in
``partition_epochs``) when the partition is assigned, or on its first record if that
failed, and drops it when the partition is revoked. :class:`RecordProcessor` is what a
chain does with one record: look its partition's fence up and run the executor under it;
a write that finds the run no longer owned by the fence raises :class:`FencedOut`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from koda_runtime.errors import KodaError
from koda_runtime.lifecycle.handler import CancelToken
from koda_runtime.processors.ports import Record
from koda_runtime.schemas.epochs import Fence
from koda_runtime.schemas.runs.worker import RunStore
from koda_runtime.topics.kafka.intake import Fetched

if TYPE_CHECKING:
    from koda_runtime.processors.runner import RunExecutor

log = logging.getLogger("koda.worker")


class FencedOut(KodaError):
    """This worker lost the partition: its writes match zero rows; do not ack."""


class PartitionFences:
    """The fencing tokens (partition epochs) of the runs partitions this worker holds."""

    def __init__(self, store: RunStore, runs_topic: str, worker_id: str) -> None:
        self.store = store
        self.runs_topic = runs_topic
        self.worker_id = worker_id
        self.fences: dict[int, Fence] = {}
        # The runs partitions of the current assignment. Faust stamps records fetched just
        # before a rebalance with the *new* generation, so the generation alone does not
        # tell a record of a partition this worker just lost.
        self.assigned: set[int] = set()
        # Epoch bumps in progress. A record can arrive while on_assigned is still taking
        # the epochs (or before it starts); bumping a second time would fence out the run
        # that the first bump let start, and its chain would close for good.
        self.taking: dict[int, asyncio.Future[Fence]] = {}

    async def fence_for(self, partition: int) -> Fence:
        fence = self.fences.get(partition)
        if fence is not None:
            return fence
        if partition not in self.assigned:
            # Taking the epoch of a partition we do not hold would fence out its owner.
            raise FencedOut(f"partition {partition} is not assigned to this worker")
        pending = self.taking.get(partition)
        if pending is not None:
            return await asyncio.shield(pending)
        return (await self.take([partition]))[partition]

    async def take(self, partitions: list[int]) -> dict[int, Fence]:
        """Bump the epochs of ``partitions`` once; concurrent askers share the result."""
        loop = asyncio.get_running_loop()
        mine = {p: loop.create_future() for p in partitions}
        self.taking.update(mine)
        try:
            epochs = await self.store.bump_epochs(self.runs_topic, partitions, self.worker_id)
            fences = {p: Fence(self.runs_topic, p, e) for p, e in epochs.items()}
            self.fences.update(fences)
        except BaseException as exc:
            for fut in mine.values():
                fut.set_exception(exc)
                fut.exception()  # retrieved: nobody may be waiting
            raise
        finally:
            for p, fut in mine.items():
                if self.taking.get(p) is fut:
                    del self.taking[p]
        for p, fut in mine.items():
            fut.set_result(fences[p])
        return fences

    def untaken(self, partitions: list[int]) -> list[int]:
        """Those of ``partitions`` with no fence taken, or being taken, yet."""
        return [p for p in partitions if p not in self.fences and p not in self.taking]


class RecordProcessor:
    """What a partition chain does with one record: fence it, then run the executor."""

    def __init__(self, fences: PartitionFences, executor: RunExecutor) -> None:
        self.fences = fences
        self.executor = executor

    async def process(self, item: Fetched, partition: int, cancel: CancelToken) -> None:
        record = Record(item.topic, partition, item.offset, item.key, item.value, item.headers)
        fence = await self.fences.fence_for(partition)
        delay = 0.2
        while True:
            try:
                await self.executor.process(record, fence, cancel)
                return
            except FencedOut as exc:
                # A write found the run no longer owned by this fence. If another worker
                # has taken the partition, the chain closes (its records are that
                # worker's now). If the partition is still this worker's, only the run's
                # row moved on under it (a cancel or an end decided on another path, a
                # finish whose commit was acknowledged too late to be seen): closing
                # would stall the partition for good, so the record is processed again
                # and the executor finds the run as it now is (ended: acked).
                if partition not in self.fences.assigned or not await self.fences.store.holds(
                    fence
                ):
                    raise
                log.warning(
                    "run fenced out on a partition still held partition=%d offset=%d: %s;"
                    " processing the record again",
                    partition,
                    item.offset,
                    exc,
                )
                await asyncio.sleep(delay)
                delay = min(5.0, delay * 2)
