"""Reading koda's topics for a replay, without disturbing anyone.

The replay reads through the bounded reader (topics/kafka/bounded.py): one
confluent-kafka consumer that never subscribes, so it never joins a group and never
triggers a rebalance.

* One-shot (no ``--job``): nothing is committed. librdkafka insists on a ``group.id``;
  it gets ``Names.group("replay-reader")``, a group that is never joined or committed.
* A named job (``--job NAME``): its group is ``Names.replay_group(NAME)``
  (``<env>.koda.replay.<name>``, never the workers' group). The group only stores
  offsets: the replay commits the next offset of each partition after the sink's
  transaction holding those rows has committed. A crash between the two re-reads
  at most one batch on restart, and the upserts make the re-read harmless.

The end of a bounded replay is each partition's high watermark read at the start;
records produced later are left for the next run (or read with ``--follow``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from koda_runtime.errors import TopicError
from koda_runtime.settings import Settings
from koda_runtime.topics.kafka.bounded import TP, BoundedReader
from koda_runtime.topics.replay.positions import Earliest, FromOffsets, FromTimestamp, StartSpec

ROLE = "replay"
ONE_SHOT_GROUP = "replay-reader"
TIMEOUT_S = 15.0


@dataclass
class Plan:
    """Per partition: the first offset to read, and the end (high watermark at start)."""

    starts: dict[TP, int] = field(default_factory=dict)
    ends: dict[TP, int] = field(default_factory=dict)
    committed: dict[TP, int] = field(default_factory=dict)  # a job's commits it resumes from

    @property
    def resumed(self) -> int:
        return len(self.committed)

    @property
    def backlog(self) -> int:
        """Offsets between the starts and the ends (records, less compaction's gaps)."""
        return sum(max(0, self.ends[tp] - self.starts[tp]) for tp in self.starts)


def open_reader(settings: Settings, job: str | None) -> BoundedReader:
    """The replay's reader: the job's group (or the one-shot group, never committed)."""
    names = settings.names
    group = names.replay_group(job) if job else names.group(ONE_SHOT_GROUP)
    if group == names.group(settings.worker_group):
        raise TopicError(f"replay group {group} is the workers' group: pick another job")
    return BoundedReader(
        settings,
        ROLE,
        group,
        config={"fetch.wait.max.ms": 100, "queued.max.messages.kbytes": 65536},
        timeout_s=TIMEOUT_S,
        read_error_event="replay_read_error",
    )


def plan(reader: BoundedReader, topics: list[str], start: StartSpec, *, job: bool) -> Plan:
    """Where each partition of ``topics`` (full names) starts and ends; a job resumes
    from its committed offsets. Raises TopicError for a missing topic."""
    tps: list[TP] = []
    for topic in topics:
        tps += reader.partitions(topic)
    result = Plan()
    lows: dict[TP, int] = {}
    for tp in tps:
        lows[tp], result.ends[tp] = reader.watermarks(tp)
    committed = reader.committed(tps) if job else {}
    wanted = _starts(reader, start, tps, lows, result.ends)
    for tp in tps:
        if committed.get(tp, -1) >= 0:
            result.committed[tp] = committed[tp]
            first = committed[tp]
        else:
            first = wanted[tp]
        result.starts[tp] = min(max(first, lows[tp]), result.ends[tp])
    return result


def _starts(
    reader: BoundedReader,
    start: StartSpec,
    tps: list[TP],
    lows: Mapping[TP, int],
    ends: Mapping[TP, int],
) -> dict[TP, int]:
    if isinstance(start, Earliest):
        return dict(lows)
    if isinstance(start, FromOffsets):
        return {tp: start.offsets.get(tp, lows[tp]) for tp in tps}
    assert isinstance(start, FromTimestamp)
    found = reader.offsets_for_times(tps, start.ms)
    # -1: no record at or after the time: nothing to read there.
    return {tp: offset if offset >= 0 else ends[tp] for tp, offset in found.items()}
