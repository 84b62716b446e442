"""Create the catalogue's topics idempotently and report drift, through AdminClient."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from confluent_kafka import KafkaError, KafkaException

# confluent-kafka's stubs do not list these in admin's __all__; they are its public API.
from confluent_kafka.admin import (  # type: ignore[attr-defined]
    AdminClient,
    ConfigResource,
    NewTopic,
    ResourceType,
)

from koda_runtime.errors import TopicError
from koda_runtime.kafka import common_config
from koda_runtime.settings import Settings
from koda_runtime.topics.catalogue import TopicSpec, catalogue

ADMIN_TIMEOUT_S = 30.0
# Only these configs are compared by `check`: they change semantics if they drift.
CHECKED_CONFIGS = ("cleanup.policy",)


@dataclass(frozen=True)
class Drift:
    """One difference between the catalogue and the broker."""

    topic: str
    what: str
    expected: str
    actual: str

    def __str__(self) -> str:
        return f"{self.topic}: {self.what} expected {self.expected}, found {self.actual}"


def admin_client(settings: Settings) -> AdminClient:
    conf: dict[str, Any] = {
        **common_config(settings),
        "client.id": settings.names.client_id("admin", settings.worker_id.lower()[:40] or "cli"),
    }
    return AdminClient(conf)


def _existing(admin: AdminClient) -> dict[str, int]:
    try:
        md = admin.list_topics(timeout=ADMIN_TIMEOUT_S)
    except KafkaException as exc:
        raise TopicError(
            f"cannot list topics: {exc}; is Kafka reachable at KODA_KAFKA_BOOTSTRAP?"
        ) from exc
    # A topic whose leaders are still being elected reports an error but exists.
    return {
        name: len(t.partitions)
        for name, t in md.topics.items()
        if t.error is None or t.error.code() != KafkaError.UNKNOWN_TOPIC_OR_PART
    }


def apply_topics(settings: Settings, specs: list[TopicSpec] | None = None) -> list[str]:
    """Create every missing topic of the catalogue; return the names created.

    Existing topics are left alone (drift is reported by :func:`check_topics`, never
    "fixed" silently: a partition change is a migration).
    """
    specs = catalogue(settings) if specs is None else specs
    admin = admin_client(settings)
    existing = _existing(admin)
    missing = [s for s in specs if s.name not in existing]
    if not missing:
        return []
    futures = admin.create_topics(
        [
            NewTopic(
                s.name,
                num_partitions=s.partitions,
                replication_factor=s.replication_factor,
                config=dict(s.config),
            )
            for s in missing
        ],
        operation_timeout=ADMIN_TIMEOUT_S,
        request_timeout=ADMIN_TIMEOUT_S,
    )
    created = []
    for name, fut in futures.items():
        try:
            fut.result()
            created.append(name)
        except KafkaException as exc:
            err = exc.args[0]
            if err.name() == "TOPIC_ALREADY_EXISTS":
                continue  # another process won the race: still idempotent
            raise TopicError(f"cannot create topic {name}: {err.str()}") from exc
    return created


def check_topics(settings: Settings, specs: list[TopicSpec] | None = None) -> list[Drift]:
    """Compare the broker with the catalogue: missing topics, partition counts, cleanup."""
    specs = catalogue(settings) if specs is None else specs
    admin = admin_client(settings)
    existing = _existing(admin)
    drifts: list[Drift] = []
    present: list[TopicSpec] = []
    for s in specs:
        if s.name not in existing:
            drifts.append(Drift(s.name, "topic", "present", "missing"))
            continue
        if existing[s.name] != s.partitions:
            drifts.append(Drift(s.name, "partitions", str(s.partitions), str(existing[s.name])))
        present.append(s)
    if not present:
        return drifts
    resources = [ConfigResource(ResourceType.TOPIC, s.name) for s in present]
    futures = admin.describe_configs(resources, request_timeout=ADMIN_TIMEOUT_S)
    by_name = {s.name: s for s in present}
    for res, fut in futures.items():
        try:
            configs = fut.result()
        except KafkaException as exc:
            raise TopicError(f"cannot describe topic {res.name}: {exc}") from exc
        s = by_name[res.name]
        for key in CHECKED_CONFIGS:
            expected = s.config.get(key, "delete")
            actual = configs[key].value if key in configs else "<unset>"
            if actual != expected:
                drifts.append(Drift(s.name, key, expected, str(actual)))
    return drifts


def delete_topics(settings: Settings, specs: list[TopicSpec] | None = None) -> list[str]:
    """Delete the catalogue's topics that exist (all their records); return the names.

    Destructive: the CLI demands ``--confirm-prod`` in prod before calling this.
    """
    specs = catalogue(settings) if specs is None else specs
    admin = admin_client(settings)
    existing = _existing(admin)
    doomed = [s.name for s in specs if s.name in existing]
    if not doomed:
        return []
    futures = admin.delete_topics(
        doomed, operation_timeout=ADMIN_TIMEOUT_S, request_timeout=ADMIN_TIMEOUT_S
    )
    deleted = []
    for name, fut in futures.items():
        try:
            fut.result()
            deleted.append(name)
        except KafkaException as exc:
            err = exc.args[0]
            if err.code() == KafkaError.UNKNOWN_TOPIC_OR_PART:
                continue  # deleted meanwhile by someone else
            raise TopicError(f"cannot delete topic {name}: {err.str()}") from exc
    return sorted(deleted)
