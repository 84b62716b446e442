"""Reading koda's topics for a replay with confluent-kafka, without disturbing anyone.

The consumer never subscribes, so it never joins a group and never triggers a rebalance:
it ``assign()`` s the partitions itself.

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

from confluent_kafka import Consumer, KafkaException, Message, TopicPartition

from koda.errors import TopicError
from koda.kafka import consumer_config
from koda.settings import Settings
from topics.replay.positions import Earliest, FromOffsets, FromTimestamp, StartSpec

ROLE = "replay"
ONE_SHOT_GROUP = "replay-reader"
TIMEOUT_S = 15.0

TP = tuple[str, int]


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


class TopicReader:
    """One consumer over ``topics`` (full names)."""

    def __init__(self, settings: Settings, topics: list[str], job: str | None) -> None:
        names = settings.names
        self.topics = topics
        self.job = job
        self.group = names.replay_group(job) if job else names.group(ONE_SHOT_GROUP)
        if self.group == names.group(settings.worker_group):
            raise TopicError(f"replay group {self.group} is the workers' group: pick another job")
        self.bootstrap = settings.kafka_bootstrap
        conf = consumer_config(settings, ROLE, self.group) | {
            "enable.partition.eof": True,
            "enable.auto.offset.store": False,
            "fetch.wait.max.ms": 100,
            "queued.max.messages.kbytes": 65536,
        }
        self.consumer = Consumer(conf)

    def _fail(self, what: str, exc: Exception) -> TopicError:
        return TopicError(f"{what} on {self.bootstrap} failed: {exc}; is Kafka reachable?")

    def plan(self, start: StartSpec) -> Plan:
        """Where each partition starts and ends; raises TopicError for a missing topic."""
        try:
            meta = self.consumer.list_topics(timeout=TIMEOUT_S)
        except KafkaException as exc:
            raise self._fail("listing topics", exc) from exc
        tps: list[TP] = []
        for topic in self.topics:
            info = meta.topics.get(topic)
            if info is None or info.error is not None:
                raise TopicError(
                    f"topic {topic} does not exist on {self.bootstrap}: run `koda topics apply`"
                )
            tps += [(topic, p) for p in sorted(info.partitions)]
        plan = Plan()
        lows: dict[TP, int] = {}
        try:
            for tp in tps:
                low, high = self.consumer.get_watermark_offsets(
                    TopicPartition(*tp), timeout=TIMEOUT_S
                )
                lows[tp], plan.ends[tp] = low, high
            committed = self._committed(tps) if self.job else {}
            wanted = self._starts(start, tps, lows, plan.ends)
        except KafkaException as exc:
            raise self._fail("reading offsets", exc) from exc
        for tp in tps:
            if committed.get(tp, -1) >= 0:
                plan.committed[tp] = committed[tp]
                first = committed[tp]
            else:
                first = wanted[tp]
            plan.starts[tp] = min(max(first, lows[tp]), plan.ends[tp])
        return plan

    def _committed(self, tps: list[TP]) -> dict[TP, int]:
        got = self.consumer.committed([TopicPartition(*tp) for tp in tps], timeout=TIMEOUT_S)
        return {(x.topic, x.partition): x.offset for x in got}

    def _starts(
        self, start: StartSpec, tps: list[TP], lows: Mapping[TP, int], ends: Mapping[TP, int]
    ) -> dict[TP, int]:
        if isinstance(start, Earliest):
            return dict(lows)
        if isinstance(start, FromOffsets):
            return {tp: start.offsets.get(tp, lows[tp]) for tp in tps}
        assert isinstance(start, FromTimestamp)
        asked = [TopicPartition(t, p, start.ms) for t, p in tps]
        found = self.consumer.offsets_for_times(asked, timeout=TIMEOUT_S)
        # -1: no record at or after the time: nothing to read there.
        return {
            (x.topic, x.partition): x.offset if x.offset >= 0 else ends[(x.topic, x.partition)]
            for x in found
        }

    def assign(self, plan: Plan) -> None:
        self.consumer.assign([TopicPartition(t, p, plan.starts[(t, p)]) for t, p in plan.starts])

    def poll(self, max_records: int, timeout_s: float) -> list[Message]:
        try:
            return list(self.consumer.consume(num_messages=max_records, timeout=timeout_s))
        except KafkaException as exc:
            raise self._fail("reading", exc) from exc

    def pause(self, tp: TP) -> None:
        self.consumer.pause([TopicPartition(*tp)])

    def high_watermark(self, tp: TP) -> int | None:
        """The last high watermark the fetches reported (no request); None when unknown."""
        _, high = self.consumer.get_watermark_offsets(TopicPartition(*tp), cached=True)
        return high if high >= 0 else None

    def commit(self, positions: Mapping[TP, int]) -> None:
        """Commit the next offset to read per partition to the job's group (synchronous)."""
        if not positions:
            return
        offsets = [TopicPartition(t, p, o) for (t, p), o in positions.items()]
        try:
            self.consumer.commit(offsets=offsets, asynchronous=False)
        except KafkaException as exc:
            raise self._fail(f"committing offsets of {self.group}", exc) from exc

    def close(self) -> None:
        self.consumer.close()


def partition_of(msg: Message) -> TP:
    return (msg.topic() or "", msg.partition() or 0)
