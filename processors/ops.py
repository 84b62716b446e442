"""What a worker does for operators, beside running runs: heartbeats, probes, lag.

``WorkerOps`` is built with the Faust app (``processors.app.build_worker``) and
follows its lifecycle: :meth:`start` once the app has started, :meth:`stop` at
the very end of a graceful shutdown, after the drain and the final commit, so
the tombstone is the worker's last word. A crashed worker writes no tombstone:
it goes stale, which is what it should look like.
"""

from __future__ import annotations

import logging
from typing import Any

from koda.settings import Settings
from processors.health import GroupMembership, HealthServer, LoopProbe
from processors.heartbeat import Heartbeat
from processors.identity import TwinWatch
from processors.lag import LagMonitor

log = logging.getLogger("koda.worker")


def held_partitions(runtime: Any) -> list[int]:
    """The runs partitions a worker holds: fenced (assigned) or with a chain (draining)."""
    held = set(getattr(runtime, "fences", None) or ())
    chains = getattr(runtime, "chains", None)
    if chains is not None:
        held.update(chains.held())
    return sorted(held)


def in_flight(runtime: Any) -> int:
    chains = getattr(runtime, "chains", None)
    return int(chains.in_flight) if chains is not None else 0


class WorkerOps:
    """Heartbeat and its twin watch, health server (``KODA_WORKER_PORT``), lag sampling."""

    def __init__(self, settings: Settings, app: Any, runtime: Any) -> None:
        self.settings = settings
        self.membership = GroupMembership(stuck_after_s=settings.rebalance_timeout_s)
        app.sensors.add(self.membership)
        app.on_partitions_assigned.connect(self.membership.on_assigned)
        self.loop_probe = LoopProbe(settings.loop_stall_s)
        self.heartbeat = Heartbeat(
            settings,
            lambda **kw: app.producer.send(**kw),
            in_flight=lambda: in_flight(runtime),
            partitions=lambda: held_partitions(runtime),
        )
        self.twins = TwinWatch(settings, self.heartbeat)
        self.lag = LagMonitor(settings, lambda: held_partitions(runtime))
        self.server: HealthServer | None = None
        if settings.worker_port:
            self.server = HealthServer(
                settings.worker_host,
                settings.worker_port,
                live=self.loop_probe.check,
                ready=self.membership.check,
            )
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
