"""The gateway's view of the workers, built by tailing ``<env>.koda.workers``.

Every gateway reads the compacted workers topic from its beginning, without a
consumer group (gateways never share, join or commit anything), and keeps each
worker's latest beat; a tombstone removes the worker. The table answers
``GET /admin/workers`` and the ``koda_workers{state}`` gauge. It is for people
and alerts, never for routing, and never a readiness dependency: a gateway
whose tail cannot reach the broker still takes runs.

Age is measured from the beat's ``beat_at`` (the worker's clock) to the
gateway's clock, so hosts need synchronised clocks (NTP); a beat from the
future counts as fresh. Rows of workers that vanished without a tombstone
(SIGKILL, a lost node) stay, stale, for ``KODA_BEAT_FORGET_AFTER`` s and are
then dropped so a replaced pod does not keep the status degraded forever.

Two live processes beating under one worker id (a copied ``KODA_WORKER_ID``, two
workers of an older release on one host) share one key, so each beat would overwrite
the other's. Every beat carries its process's ``instance`` (drawn at start), and the
table keeps the instances of each id apart: two instances whose beats interleave on
the topic are a *conflict*, reported with both hosts and pids, and the status is
``degraded``. An instance whose beats all came before another's first one was that
process's predecessor (a restart under a stable id): it is dropped, not a conflict.
A tombstone removes the id with all its instances (it does not say which process
wrote it; a twin still alive reappears with its next beat).

The directory also answers ``GET /admin/lag`` (:meth:`WorkerDirectory.lag`): the worker
group's lag per runs partition, asked of the broker at each request through one
offsets reader (topics/kafka/offsets.py) kept for the gateway's lifetime.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from koda_runtime import metrics
from koda_runtime.errors import RecordError
from koda_runtime.settings import Settings
from koda_runtime.topics.catalogue import RUNS
from koda_runtime.topics.kafka.offsets import GroupOffsetReader, PartitionLag
from koda_runtime.topics.records.heartbeats import Beat, decode_beat
from koda_runtime.topics.workerlog import worker_log_tail

log = logging.getLogger(__name__)

# Instances remembered per worker id: a crash-looping worker under a stable id draws a
# new one at every start.
MAX_INSTANCES = 16


@dataclass
class _Instance:
    """One process beating under a worker id: its latest beat, and where its beats lie."""

    beat: Beat
    first: int
    last: int


def _overlapping(instances: dict[str, _Instance]) -> list[str]:
    """The instances whose beats interleave with another instance's: live twins.

    An instance whose beats all lie before (or after) every other's is a predecessor
    (or successor) of theirs, not a twin.
    """
    return [
        name
        for name, a in instances.items()
        if any(a.first <= b.last and b.first <= a.last for b in instances.values() if b is not a)
    ]


class WorkerTable:
    """The latest beat per worker and process, and the status computed from it (no I/O)."""

    def __init__(self, stale_after_s: float, forget_after_s: float = 0.0) -> None:
        self.stale_after_s = stale_after_s
        self.forget_after_s = forget_after_s
        self._workers: dict[str, dict[str, _Instance]] = {}
        self._next = 0

    def apply(self, key: bytes | None, value: bytes | None, offset: int | None = None) -> None:
        """Fold one workers-topic record in; an invalid record is logged and skipped.

        ``offset`` orders the records of one key (default: the order of the calls);
        applying a record twice changes nothing.
        """
        pos = self._next if offset is None else offset
        self._next = max(self._next, pos + 1)
        try:
            beat = decode_beat(key, value)
        except RecordError as exc:
            log.warning("event=heartbeat_invalid reason=%s detail=%s", exc.reason, exc.detail)
            return
        if beat is None:
            if key is not None:
                self._workers.pop(key.decode("utf-8", "replace"), None)
            return
        instances = self._workers.setdefault(beat.worker_id, {})
        was_conflict = len(_overlapping(instances)) > 1
        known = instances.get(beat.instance)
        if known is None:
            instances[beat.instance] = _Instance(beat, pos, pos)
        else:
            if pos >= known.last:
                known.beat = beat
            known.first, known.last = min(known.first, pos), max(known.last, pos)
        # Predecessors are kept (one may yet wake up and beat again), a bounded number.
        for name in sorted(instances, key=lambda n: instances[n].last)[:-MAX_INSTANCES]:
            del instances[name]
        live = _overlapping(instances)
        if len(live) > 1 and not was_conflict:
            log.error(
                "event=worker_id_conflict worker_id=%s processes=%s: more than one live "
                "process beats under this worker id; give each worker its own KODA_WORKER_ID",
                beat.worker_id,
                ",".join(sorted(instances[n].beat.who for n in live)),
            )

    def report(self, expected: int, now: datetime | None = None) -> dict[str, Any]:
        """``{status, expected, alive, stale, conflicts, workers: [...]}`` as of ``now``.

        One row per worker id: its latest beat. ``conflicts`` lists the ids that more
        than one live process beats under, with every such process. ``status`` is
        ``degraded`` when fewer than ``expected`` workers are alive, any is stale, or
        any id is in conflict; else ``ok``.
        """
        now = now or datetime.now(UTC)
        workers = []
        conflicts = []
        for worker_id in sorted(self._workers):
            instances = self._workers[worker_id]
            ages = {
                name: max(0.0, (now - inst.beat.beat_at).total_seconds())
                for name, inst in instances.items()
            }
            if self.forget_after_s:
                for name in [n for n, age in ages.items() if age > self.forget_after_s]:
                    del instances[name], ages[name]
                if not instances:
                    del self._workers[worker_id]
                    continue
            latest = max(instances, key=lambda n: instances[n].last)
            beat = instances[latest].beat
            twins = _overlapping(instances)
            workers.append(
                {
                    "worker_id": beat.worker_id,
                    "lastBeatMs": int(ages[latest] * 1000),
                    "in_flight": beat.in_flight,
                    "version": beat.version,
                    "partitions": list(beat.partitions),
                    "host": beat.host,
                    "pid": beat.pid,
                    "instance": beat.instance,
                    "stale": ages[latest] > self.stale_after_s,
                    "conflict": bool(twins),
                }
            )
            if twins:
                conflicts.append(
                    {
                        "worker_id": worker_id,
                        "processes": [
                            {
                                "host": instances[name].beat.host,
                                "pid": instances[name].beat.pid,
                                "instance": instances[name].beat.instance,
                                "lastBeatMs": int(ages[name] * 1000),
                                "stale": ages[name] > self.stale_after_s,
                            }
                            for name in sorted(twins, key=lambda n: instances[n].first)
                        ],
                    }
                )
        stale = sum(1 for w in workers if w["stale"])
        alive = len(workers) - stale
        return {
            "status": "degraded" if alive < expected or stale or conflicts else "ok",
            "expected": expected,
            "alive": alive,
            "stale": stale,
            "conflicts": conflicts,
            "workers": workers,
        }


class WorkerDirectory:
    """Tails the workers topic in the background into a :class:`WorkerTable`, and reads
    the workers' lag on request."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.expected = settings.expected_workers
        self.table = WorkerTable(settings.beat_stale_after_s, settings.beat_forget_after_s)
        self.tail = worker_log_tail(settings, "gateway", self._apply, start="beginning")
        self.topic = self.tail.topic
        self.runs_topic = settings.names.topic(RUNS)
        self.group = settings.names.group(settings.worker_group)
        # Connects on the first request; one client for the gateway's lifetime.
        self._offsets = GroupOffsetReader(settings, "console-lag", self.runs_topic, self.group)

    def _apply(self, key: bytes | None, value: bytes | None, offset: int) -> None:
        self.table.apply(key, value, offset)
        self.report()

    async def lag(self) -> list[PartitionLag]:
        """The worker group's lag on every runs partition, asked of the broker now;
        raises ``confluent_kafka.KafkaException`` when the broker does not answer."""
        return await self._offsets.run(self._offsets.lags, range(self.settings.partitions))

    def report(self) -> dict[str, Any]:
        report = self.table.report(self.expected)
        metrics.WORKERS.labels(state="alive").set(report["alive"])
        metrics.WORKERS.labels(state="stale").set(report["stale"])
        metrics.WORKERS_EXPECTED.set(self.expected)
        metrics.WORKER_ID_CONFLICTS.set(len(report["conflicts"]))
        return report

    def start(self) -> None:
        """Start tailing (connects in the background; never fails the gateway's start)."""
        self.tail.start()

    async def stop(self) -> None:
        await self.tail.stop()
        await self._offsets.aclose()
