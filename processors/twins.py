"""Two live workers under one id: each notices the beats it did not send.

A worker id should name one process. Two processes sharing one (a copied
``KODA_WORKER_ID``, a static instance id given to two pods) write one key on the
compacted workers topic, so each beat overwrites the other's and the table shows
one worker where two run; Postgres's ``worker_id`` columns and the logs cannot
tell them apart either. Every beat carries its process's ``instance``, drawn at
start, so each worker reads the workers topic from the end (from when it started:
a predecessor's old beats under a stable id are not a twin) and treats a beat under
its own id with another instance as a twin. It logs an error naming both hosts and
pids (again at most every ``RELOG_S`` per twin while the twin beats) and counts
``koda_worker_id_twin_beats_total``; the gateways report the conflict too
(``GET /admin/workers``). It changes nothing else: the consumer group, not the
worker id, decides who runs what.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from koda_runtime.errors import RecordError
from koda_runtime.metrics import WORKER_ID_TWIN_BEATS
from koda_runtime.processors.heartbeat import Heartbeat
from koda_runtime.settings import Settings
from koda_runtime.topics.records.heartbeats import Beat, decode_beat
from koda_runtime.topics.workerlog import worker_log_tail

log = logging.getLogger("koda.worker")

RELOG_S = 60.0


class TwinWatch:
    """Watches ``<env>.koda.workers`` for beats under ``heartbeat``'s id from elsewhere."""

    def __init__(
        self,
        settings: Settings,
        heartbeat: Heartbeat,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.me = heartbeat
        self._key = heartbeat.worker_id.encode()
        self._clock = clock
        self._logged_at: dict[str, float] = {}
        self.twins: dict[str, Beat] = {}
        self.tail = worker_log_tail(settings, "worker", self.apply, start="end")

    def apply(self, key: bytes | None, value: bytes | None, offset: int = -1) -> None:
        """Look at one workers-topic record; only beats under this worker's id matter."""
        if key != self._key or value is None:
            return
        try:
            beat = decode_beat(key, value)
        except RecordError:
            return  # the gateways log invalid beats
        if beat is None or beat.instance == self.me.instance:
            return
        WORKER_ID_TWIN_BEATS.inc()
        name = beat.instance or beat.who
        self.twins[name] = beat
        now = self._clock()
        last = self._logged_at.get(name)
        if last is not None and now - last < RELOG_S:
            return
        self._logged_at[name] = now
        log.error(
            "event=worker_id_conflict worker_id=%s host=%s pid=%s other_host=%s other_pid=%s "
            "other_instance=%s offset=%s: another live process beats under this worker's "
            "id; its runs, heartbeats and logs cannot be told apart from this one's. "
            "Give each worker its own KODA_WORKER_ID, or leave it unset",
            self.me.worker_id,
            self.me.host,
            self.me.pid,
            beat.host,
            beat.pid if beat.pid is not None else "unknown",
            beat.instance or "unknown",
            offset,
        )

    def start(self) -> None:
        self.tail.start()

    async def stop(self) -> None:
        await self.tail.stop()
