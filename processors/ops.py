"""What a worker does for operators, beside running runs: heartbeats, probes, lag.

``WorkerOps`` is built with the Faust app (processors/bootstrap.py) and follows its
lifecycle: :meth:`WorkerOps.start` once the app has started, :meth:`WorkerOps.stop`
at the very end of a graceful shutdown, after the drain and the final commit, so the
tombstone is the worker's last word. A crashed worker writes no tombstone: it goes
stale, which is what it should look like.
"""

from __future__ import annotations

import logging

from koda_runtime.processors.health import GroupMembership, HealthServer, LoopProbe
from koda_runtime.processors.heartbeat import Heartbeat
from koda_runtime.processors.lag import LagMonitor
from koda_runtime.processors.twins import TwinWatch

log = logging.getLogger("koda.worker")


class WorkerOps:
    """Heartbeat and its twin watch, the health server (None: ``KODA_WORKER_PORT`` 0),
    the loop probe and the group membership it answers from, and lag sampling."""

    def __init__(
        self,
        *,
        heartbeat: Heartbeat,
        twins: TwinWatch,
        lag: LagMonitor,
        loop_probe: LoopProbe,
        membership: GroupMembership,
        server: HealthServer | None,
    ) -> None:
        self.heartbeat = heartbeat
        self.twins = twins
        self.lag = lag
        self.loop_probe = loop_probe
        self.membership = membership
        self.server = server
        self.started = False

    async def start(self) -> None:
        """Start the probes and the server, then beat at once and every interval."""
        if self.started:
            return
        self.started = True
        self.loop_probe.start()
        if self.server is not None:
            await self.server.start()
        self.twins.start()
        self.heartbeat.start()
        self.lag.start()

    async def stop(self, *, crashed: bool = False) -> None:
        """Stop everything; deregister with a tombstone unless the app crashed."""
        if not self.started:
            return
        self.started = False
        await self.lag.stop()
        await self.twins.stop()
        if crashed:
            await self.heartbeat.stop()
        else:
            await self.heartbeat.tombstone()
        if self.server is not None:
            await self.server.stop()
        await self.loop_probe.stop()
