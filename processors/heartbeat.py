"""The worker's heartbeat: a beat every ``KODA_BEAT_INTERVAL`` s, a tombstone on exit.

Beats go to the compacted ``<env>.koda.workers`` topic keyed by worker id
(docs/design.md §8). They are for people and alerts (the gateway's ``GET /admin/workers``), never
for routing: the consumer group alone decides who runs what. A worker that exits
gracefully writes a tombstone, so a planned shutdown disappears from the table
while a dead or frozen worker goes stale.

Beats are produced through the worker's own producer, so they stop when the
process stops (SIGSTOP, a frozen host), which is exactly what they must show.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
from collections.abc import Awaitable, Callable, Iterable
from datetime import UTC, datetime
from typing import Any

from koda_runtime.background import BackgroundTask
from koda_runtime.metrics import HEARTBEATS
from koda_runtime.settings import Settings
from koda_runtime.topics.catalogue import WORKERS
from koda_runtime.topics.records.heartbeats import Beat, beat_headers

log = logging.getLogger("koda.worker")

SendFn = Callable[..., Awaitable[Any]]
# The tombstone comes after a drain of up to 20 s inside a 25 s grace period: it may not
# wait long for a broker that does not answer (the row then simply goes stale).
TOMBSTONE_TIMEOUT_S = 2.0


class Heartbeat:
    """Produces this worker's beats; ``send`` is the producer's ``send`` (returns a future).

    ``in_flight`` and ``partitions`` are read at every beat. ``instance`` is drawn once
    per process (16 hex digits) unless given: with ``host`` and ``pid`` it tells this
    process apart from any other beating under the same worker id.
    """

    def __init__(
        self,
        settings: Settings,
        send: SendFn,
        *,
        in_flight: Callable[[], int],
        partitions: Callable[[], Iterable[int]],
        host: str | None = None,
        instance: str | None = None,
    ) -> None:
        self.topic = settings.names.topic(WORKERS)
        self.worker_id = settings.worker_id
        self.version = settings.version
        self.interval_s = settings.beat_interval_s
        self.host = host or socket.gethostname()
        self.pid = os.getpid()
        self.instance = instance or secrets.token_hex(8)
        self._send = send
        self._in_flight = in_flight
        self._partitions = partitions
        self._task = BackgroundTask("koda-heartbeat", self.run)

    def current(self) -> Beat:
        """The beat this worker would send now."""
        return Beat(
            worker_id=self.worker_id,
            beat_at=datetime.now(UTC),
            in_flight=self._in_flight(),
            version=self.version,
            partitions=tuple(sorted(set(self._partitions()))),
            host=self.host,
            pid=self.pid,
            instance=self.instance,
        )

    async def beat(self) -> None:
        """Produce one beat and wait for the broker (at most one interval); never raises."""
        try:
            await self._produce(self.current().encode())
        except Exception as exc:  # noqa: BLE001 - a missed beat must not stop the worker
            HEARTBEATS.labels(outcome="failed").inc()
            log.warning("event=heartbeat_failed worker_id=%s error=%r", self.worker_id, exc)
        else:
            HEARTBEATS.labels(outcome="sent").inc()

    async def tombstone(self) -> None:
        """Deregister: a null value under this worker's key (stop the beats first)."""
        await self.stop()
        try:
            await self._produce(None, timeout_s=TOMBSTONE_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - the worker still exits; the row goes stale
            log.warning(
                "event=heartbeat_tombstone_failed worker_id=%s error=%r", self.worker_id, exc
            )
        else:
            log.info("event=heartbeat_tombstone worker_id=%s", self.worker_id)

    async def _produce(self, value: bytes | None, timeout_s: float | None = None) -> None:
        async def produce() -> None:
            fut = await self._send(
                topic=self.topic,
                key=self.worker_id.encode(),
                value=value,
                partition=None,
                timestamp=None,
                headers=beat_headers(),
            )
            await fut

        await asyncio.wait_for(produce(), timeout=timeout_s or max(self.interval_s, 1.0))

    async def run(self) -> None:
        """Beat now, then every ``interval_s`` until cancelled."""
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            await self.beat()
            await asyncio.sleep(max(0.0, self.interval_s - (loop.time() - started)))

    def start(self) -> None:
        self._task.start()

    async def stop(self) -> None:
        """Stop beating; a beat already handed to the producer is still delivered first."""
        await self._task.stop()
