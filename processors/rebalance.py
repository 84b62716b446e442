"""The rebalance hooks of the runs partitions (:class:`WorkerRuntime`) and the names
the intake calls them by (:class:`RuntimeHooks`).

librdkafka's incremental protocol moves only what must move: an assigned partition gets
its fence, a revoked one is drained up to the handoff ceiling and committed before the
hook returns (so before its next owner may fetch it), a lost one is dropped at once.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from koda_runtime.background import BackgroundTask
from koda_runtime.metrics import HANDOFF_SECONDS, PARTITIONS_MOVED, REBALANCES
from koda_runtime.processors.chains import ChainSet
from koda_runtime.processors.commits import OffsetCommits
from koda_runtime.processors.cursor import PartitionCursors
from koda_runtime.processors.fences import PartitionFences
from koda_runtime.processors.health import GroupMembership
from koda_runtime.settings import Settings

log = logging.getLogger("koda.worker")

# How often the per-partition queue ages are measured for /metrics.
GAUGES_INTERVAL_S = 2.0


class WorkerRuntime:
    """What the dispatcher and the rebalance hooks share: the fences, the partition
    chains, the read/commit cursors and the offset commits of the runs partitions.

    It is the intake's :class:`~koda_runtime.topics.kafka.intake.RebalanceHooks`: each hook
    runs while librdkafka waits for it, so a revoked partition is handed on only after
    its drain and its final commit.
    """

    def __init__(
        self,
        settings: Settings,
        fences: PartitionFences,
        chains: ChainSet,
        cursors: PartitionCursors,
        commits: OffsetCommits,
        membership: GroupMembership,
    ) -> None:
        self.settings = settings
        self.fences = fences
        self.chains = chains
        self.cursors = cursors
        self.commits = commits
        self.membership = membership
        self.runs_topic = fences.runs_topic
        self.gauges = BackgroundTask("queue-gauges", self._gauges_every)

    async def _gauges_every(self) -> None:
        while True:
            self.chains.refresh_metrics()
            await asyncio.sleep(GAUGES_INTERVAL_S)

    @property
    def assigned(self) -> set[int]:
        return self.fences.assigned

    def held(self) -> list[int]:
        """The runs partitions this worker holds: fenced (assigned) or with chains
        (draining)."""
        return sorted(set(self.fences.fences) | set(self.chains.held()))

    def in_flight(self) -> int:
        return self.chains.in_flight

    async def assigned_hook(self, partitions: list[int]) -> None:
        """Partitions added to this worker's assignment (incremental: only the new ones)."""
        self.membership.on_rebalance_end(None, None)
        if not partitions:
            return
        REBALANCES.labels(event="assigned").inc()
        PARTITIONS_MOVED.labels(direction="in").inc(len(partitions))
        self.fences.assigned.update(partitions)
        log.info(
            "event=rebalance assigned=%s holding=%s worker_id=%s",
            partitions,
            sorted(self.fences.assigned),
            self.settings.worker_id,
        )
        # A partition whose first record already took (or is taking) its epoch in this
        # assignment keeps it; revoke dropped the fences of the previous one.
        todo = self.fences.untaken(partitions)
        if not todo:
            return
        try:
            await self.fences.take(todo)
        except Exception:  # noqa: BLE001 - fences are taken lazily on first record instead
            log.exception("could not take partition epochs; will retry on first record")
            return
        log.info("assigned partitions=%s worker_id=%s", partitions, self.settings.worker_id)

    async def revoked_hook(self, partitions: list[int]) -> None:
        """Partitions taken from this worker: drain them up to the ceiling, commit."""
        if not partitions:
            return
        self.membership.on_rebalance_start(None)
        PARTITIONS_MOVED.labels(direction="out").inc(len(partitions))
        await self.on_revoked(partitions)
        try:
            await self.commits.flush(partitions)
        finally:
            self._forget(partitions)

    async def lost_hook(self, partitions: list[int]) -> None:
        """Partitions this worker lost without a revoke (its membership expired): the
        next owner may be running them already, so nothing waits and nothing commits."""
        if not partitions:
            return
        PARTITIONS_MOVED.labels(direction="out").inc(len(partitions))
        log.warning(
            "event=partitions_lost partition lost partitions=%s: the group expired this"
            " member (paused or cut off past the session timeout)",
            partitions,
        )
        await self.on_revoked(partitions, ceiling_s=0.0)
        self._forget(partitions)

    def _forget(self, partitions: list[int]) -> None:
        self.cursors.forget(partitions)
        self.commits.forget(partitions)

    async def on_revoked(
        self, partitions: list[int], *, ceiling_s: float | None = None
    ) -> dict[str, Any]:
        REBALANCES.labels(event="revoked").inc()
        self.fences.assigned.difference_update(partitions)
        loop = asyncio.get_running_loop()
        started = loop.time()
        ceiling = self.settings.handoff_ceiling_s if ceiling_s is None else ceiling_s
        result = await self.chains.drain(partitions, ceiling)
        for p in partitions:
            self.fences.fences.pop(p, None)
        HANDOFF_SECONDS.observe(loop.time() - started)
        log.info("revoked partitions=%s drain=%s", partitions, result)
        return result


class RuntimeHooks:
    """The runtime's hooks under the names the intake calls.

    The intake and the runtime need each other: the runtime's chains, cursors and
    commits pause, seek and commit through the intake, and the intake calls these hooks.
    So the hooks are built first, empty, the intake with them, the runtime's parts with
    the intake, and the runtime is attached here (:meth:`attach`) before the intake
    starts: the one link built backwards.
    """

    def __init__(self) -> None:
        self._runtime: WorkerRuntime | None = None

    def attach(self, runtime: WorkerRuntime) -> None:
        if self._runtime is not None:
            raise RuntimeError("the rebalance hooks already have a worker runtime")
        self._runtime = runtime

    @property
    def runtime(self) -> WorkerRuntime:
        if self._runtime is None:
            raise RuntimeError(
                "a rebalance hook was called before its worker runtime was attached"
                " (processors/bootstrap.py attaches it before the intake starts)"
            )
        return self._runtime

    async def assigned(self, partitions: list[int]) -> None:
        await self.runtime.assigned_hook(partitions)

    async def revoked(self, partitions: list[int]) -> None:
        await self.runtime.revoked_hook(partitions)

    async def lost(self, partitions: list[int]) -> None:
        await self.runtime.lost_hook(partitions)
