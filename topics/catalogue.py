"""The catalogue: every koda topic with its key, partitions and cleanup policy.

Names come from :mod:`koda_runtime.naming` only. The runs, run-control, run-chunks and
run-events topics share one partition count so a user's records land in the
same partition number everywhere (co-partitioning).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from koda_runtime.settings import Settings

DAY_MS = 24 * 3600 * 1000
RUNS_MAX_MESSAGE_BYTES = 2 * 1024 * 1024

# Catalogue base names (the part after "<env>.koda."); resolved by Names.topic().
RUNS = "runs"
RUN_CONTROL = "run-control"
RUN_CHUNKS = "run-chunks"
RUN_EVENTS = "run-events"
RUNS_DLQ = "runs-dlq"
WORKERS = "workers"
WORKER_GROUP = "workers"


@dataclass(frozen=True)
class TopicSpec:
    """One topic as it must exist on the broker."""

    base: str
    name: str
    partitions: int
    replication_factor: int
    config: dict[str, str] = field(default_factory=dict)

    @property
    def cleanup_policy(self) -> str:
        return self.config.get("cleanup.policy", "delete")


def catalogue(settings: Settings) -> list[TopicSpec]:
    """Every topic koda needs, named for ``settings``' environment and namespace."""
    names = settings.names
    rf = settings.replication_factor
    isr = str(min(settings.min_insync_replicas, rf))
    p = settings.partitions

    def spec(base: str, partitions: int, **config: str) -> TopicSpec:
        config = {"min.insync.replicas": isr, **config}
        return TopicSpec(base, names.topic(base), partitions, rf, dict(config))

    return [
        spec(
            RUNS,
            p,
            **{
                "cleanup.policy": "delete",
                "retention.ms": str(7 * DAY_MS),
                # Outside producers may write large records; the worker dead-letters
                # anything over its own limit instead of choking on it.
                "max.message.bytes": str(RUNS_MAX_MESSAGE_BYTES),
            },
        ),
        spec(RUN_CONTROL, p, **{"cleanup.policy": "delete", "retention.ms": str(DAY_MS)}),
        spec(
            RUN_CHUNKS,
            p,
            **{
                "cleanup.policy": "compact",
                "min.compaction.lag.ms": str(60_000),
                "delete.retention.ms": str(DAY_MS),
                "segment.ms": str(3600_000),
            },
        ),
        spec(RUN_EVENTS, p, **{"cleanup.policy": "delete", "retention.ms": str(30 * DAY_MS)}),
        spec(
            RUNS_DLQ,
            1,
            **{
                "cleanup.policy": "delete",
                "retention.ms": str(30 * DAY_MS),
                # At least the runs topic's: a dead letter carries a record of it (cut to
                # fit the worker's producer, schemas/records.py DEAD_LETTER_MAX_BYTES).
                "max.message.bytes": str(RUNS_MAX_MESSAGE_BYTES),
            },
        ),
        spec(WORKERS, 1, **{"cleanup.policy": "compact", "segment.ms": str(3600_000)}),
    ]


def murmur2(data: bytes) -> int:
    """Kafka's murmur2 (the Java client's default partitioner hash), as a signed 32-bit int."""
    length = len(data)
    seed = 0x9747B28C
    m = 0x5BD1E995
    r = 24
    h = (seed ^ length) & 0xFFFFFFFF
    length4 = length // 4
    for i in range(length4):
        i4 = i * 4
        k = (
            (data[i4 + 0] & 0xFF)
            + ((data[i4 + 1] & 0xFF) << 8)
            + ((data[i4 + 2] & 0xFF) << 16)
            + ((data[i4 + 3] & 0xFF) << 24)
        )
        k = (k * m) & 0xFFFFFFFF
        k ^= k >> r
        k = (k * m) & 0xFFFFFFFF
        h = (h * m) & 0xFFFFFFFF
        h ^= k
    extra = length % 4
    if extra >= 3:
        h ^= (data[(length & ~3) + 2] & 0xFF) << 16
    if extra >= 2:
        h ^= (data[(length & ~3) + 1] & 0xFF) << 8
    if extra >= 1:
        h ^= data[length & ~3] & 0xFF
        h = (h * m) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * m) & 0xFFFFFFFF
    h ^= h >> 15
    return h


def partition_for_key(key: bytes, partitions: int) -> int:
    """The partition Java, aiokafka and librdkafka's ``murmur2_random`` pick for ``key``."""
    return (murmur2(key) & 0x7FFFFFFF) % partitions
