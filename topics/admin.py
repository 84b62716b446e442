"""Create the catalogue's topics idempotently and report drift, through AdminClient.

One setting of an existing topic is raised rather than reported: the dead-letter
topic's ``max.message.bytes`` is kept at least the runs topic's (the catalogue's value,
or the broker's when someone raised it there), so a dead letter of any runs record fits.
A DLQ created by an older release with a lower limit is altered by ``apply_topics``
(never lowered), and ``check_topics`` reports it until then.

``check_broker`` reads each broker's group settings (``describe_configs`` on the broker)
and reports those that refuse the workers' group timings: under the consumer protocol
(KIP-848) ``group.consumer.min/max.session.timeout.ms`` must allow
``KODA_SESSION_TIMEOUT`` and ``group.consumer.min/max.heartbeat.interval.ms``
``KODA_KAFKA_HEARTBEAT`` (Kafka's defaults, 45-60 s and 5-15 s, refuse koda's 10 s and
3 s); under ``classic``, ``group.min/max.session.timeout.ms`` (6 s-30 min) the session
timeout. A bound the broker does not describe (an older broker, or one that hides its
configs) is not checked, and said so.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from confluent_kafka import KafkaError, KafkaException

# confluent-kafka's stubs do not list these in admin's __all__; they are its public API.
from confluent_kafka.admin import (  # type: ignore[attr-defined]
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    NewTopic,
    ResourceType,
)

from koda_runtime.errors import TopicError
from koda_runtime.kafka import common_config
from koda_runtime.settings import Settings
from koda_runtime.topics.catalogue import RUNS, RUNS_DLQ, TopicSpec, catalogue

log = logging.getLogger("koda.topics")

ADMIN_TIMEOUT_S = 30.0
# Only these configs are compared by `check`: they change semantics if they drift.
CHECKED_CONFIGS = ("cleanup.policy",)
MAX_MESSAGE_BYTES = "max.message.bytes"


@dataclass(frozen=True)
class Drift:
    """One difference between the catalogue and the broker."""

    topic: str
    what: str
    expected: str
    actual: str

    def __str__(self) -> str:
        return f"{self.topic}: {self.what} expected {self.expected}, found {self.actual}"


@dataclass(frozen=True)
class GroupTiming:
    """One of the workers' group timings and the broker settings that bound it."""

    setting: str  # the koda setting it comes from
    ms: int  # its value, as koda sets it on the group (or the member, under classic)
    low: str  # the broker's minimum
    high: str  # the broker's maximum


@dataclass(frozen=True)
class BrokerRefusal:
    """A broker setting that refuses one of koda's group timings."""

    brokers: tuple[str, ...]
    config: str
    value: int
    timing: GroupTiming

    def __str__(self) -> str:
        t = self.timing
        side, fix = (
            ("above", f"lower it to at most {t.ms}")
            if self.config == t.low
            else ("below", f"raise it to at least {t.ms}")
        )
        who = "broker " + ",".join(self.brokers)
        return (
            f"{who}: {self.config}={self.value} is {side} {t.setting} ({t.ms} ms), which the"
            f" broker refuses for the workers' group: {fix}, or change {t.setting}"
        )


def group_timings(settings: Settings) -> list[GroupTiming]:
    """The timings the workers' group needs the brokers to allow, for its protocol."""
    session = int(settings.session_timeout_s * 1000)
    if settings.group_protocol == "classic":
        return [
            GroupTiming(
                "KODA_SESSION_TIMEOUT",
                session,
                "group.min.session.timeout.ms",
                "group.max.session.timeout.ms",
            )
        ]
    return [
        GroupTiming(
            "KODA_SESSION_TIMEOUT",
            session,
            "group.consumer.min.session.timeout.ms",
            "group.consumer.max.session.timeout.ms",
        ),
        GroupTiming(
            "KODA_KAFKA_HEARTBEAT",
            int(settings.heartbeat_interval_s * 1000),
            "group.consumer.min.heartbeat.interval.ms",
            "group.consumer.max.heartbeat.interval.ms",
        ),
    ]


def refused_timings(
    timings: list[GroupTiming], brokers: Mapping[str, Mapping[str, str | None]]
) -> tuple[list[BrokerRefusal], list[str]]:
    """``(refusals, unchecked)``: each broker bound (``brokers``: configs by broker id)
    that refuses a timing, brokers with the same value together; and the names of the
    bounds some broker did not describe."""
    refused: dict[tuple[str, int, GroupTiming], list[str]] = {}
    unchecked: set[str] = set()
    for broker, configs in sorted(brokers.items()):
        for t in timings:
            for config in (t.low, t.high):
                raw = configs.get(config)
                if raw is None:
                    unchecked.add(config)
                    continue
                value = int(raw)
                if value > t.ms if config == t.low else value < t.ms:
                    refused.setdefault((config, value, t), []).append(broker)
    refusals = [
        BrokerRefusal(tuple(ids), config, value, t) for (config, value, t), ids in refused.items()
    ]
    return refusals, sorted(unchecked)


def broker_configs(admin: AdminClient) -> dict[str, dict[str, str | None]]:
    """Every broker's configs (its defaults included), by broker id."""
    try:
        ids = sorted(admin.list_topics(timeout=ADMIN_TIMEOUT_S).brokers)
    except KafkaException as exc:
        raise TopicError(
            f"cannot list brokers: {exc}; is Kafka reachable at KODA_KAFKA_BOOTSTRAP?"
        ) from exc
    resources = [ConfigResource(ResourceType.BROKER, str(i)) for i in ids]
    futures = admin.describe_configs(resources, request_timeout=ADMIN_TIMEOUT_S)
    out: dict[str, dict[str, str | None]] = {}
    for res, fut in futures.items():
        try:
            configs = fut.result()
        except KafkaException as exc:
            # A managed Kafka may refuse DescribeConfigs on its brokers: unchecked, said so.
            log.warning(
                "cannot describe broker %s, its settings are not checked: %s", res.name, exc
            )
            configs = {}
        out[res.name] = {name: entry.value for name, entry in configs.items()}
    return out


def check_broker(settings: Settings) -> tuple[list[BrokerRefusal], list[str]]:
    """Report the broker settings that refuse the workers' group timings
    (:func:`refused_timings` over every broker's configs)."""
    return refused_timings(group_timings(settings), broker_configs(admin_client(settings)))


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
    "fixed" silently: a partition change is a migration), but for the dead-letter
    topic's ``max.message.bytes``, raised to the runs topic's when it is lower
    (:func:`raise_dlq_limit`).
    """
    specs = catalogue(settings) if specs is None else specs
    admin = admin_client(settings)
    existing = _existing(admin)
    missing = [s for s in specs if s.name not in existing]
    created = _create(admin, missing) if missing else []
    raise_dlq_limit(admin, specs, created)
    return created


def _create(admin: AdminClient, missing: list[TopicSpec]) -> list[str]:
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


def _describe(admin: AdminClient, names: list[str]) -> dict[str, dict[str, Any]]:
    """Each topic's configs as the broker has them (its defaults included)."""
    if not names:
        return {}
    resources = [ConfigResource(ResourceType.TOPIC, n) for n in names]
    futures = admin.describe_configs(resources, request_timeout=ADMIN_TIMEOUT_S)
    out: dict[str, dict[str, Any]] = {}
    for res, fut in futures.items():
        try:
            out[res.name] = fut.result()
        except KafkaException as exc:
            raise TopicError(f"cannot describe topic {res.name}: {exc}") from exc
    return out


def _limit(configs: dict[str, Any]) -> int | None:
    entry = configs.get(MAX_MESSAGE_BYTES)
    return None if entry is None or entry.value is None else int(entry.value)


def _dlq_floor(
    specs: list[TopicSpec], limits: dict[str, int | None]
) -> tuple[TopicSpec, int, int] | None:
    """``(dlq spec, its limit, the least it needs)`` when the DLQ's ``max.message.bytes``
    (``limits``: by topic name, as on the broker) is below the runs topic's there or
    either's in the catalogue; else None."""
    by_base = {s.base: s for s in specs}
    runs, dlq = by_base.get(RUNS), by_base.get(RUNS_DLQ)
    actual = None if dlq is None else limits.get(dlq.name)
    if runs is None or dlq is None or actual is None:
        return None
    wanted = [
        int(s.config[MAX_MESSAGE_BYTES]) for s in (runs, dlq) if MAX_MESSAGE_BYTES in s.config
    ]
    need = max([*wanted, limits.get(runs.name) or 0])
    return (dlq, actual, need) if actual < need else None


def raise_dlq_limit(
    admin: AdminClient, specs: list[TopicSpec], created: Collection[str] = ()
) -> int | None:
    """Raise the dead-letter topic's ``max.message.bytes`` to at least the runs topic's
    (on the broker, or in the catalogue when that is higher); return the new limit, or
    None when it was high enough (or either topic is not in ``specs``). Topics in
    ``created`` were just created from ``specs``: their limit is the catalogue's (the
    broker may not describe them yet)."""
    existing = set(_existing(admin)) | set(created)
    ours = [s for s in specs if s.base in (RUNS, RUNS_DLQ) and s.name in existing]
    fresh = [s for s in ours if s.name in created]
    described = _describe(admin, [s.name for s in ours if s.name not in created])
    limits = {name: _limit(configs) for name, configs in described.items()}
    for s in fresh:
        limit = s.config.get(MAX_MESSAGE_BYTES)
        limits[s.name] = None if limit is None else int(limit)
    floor = _dlq_floor(specs, limits)
    if floor is None:
        return None
    dlq, actual, need = floor
    entry = ConfigEntry(MAX_MESSAGE_BYTES, str(need), incremental_operation=AlterConfigOpType.SET)
    futures = admin.incremental_alter_configs(
        [ConfigResource(ResourceType.TOPIC, dlq.name, incremental_configs=[entry])],
        request_timeout=ADMIN_TIMEOUT_S,
    )
    for fut in futures.values():
        try:
            fut.result()
        except KafkaException as exc:
            raise TopicError(
                f"cannot raise {MAX_MESSAGE_BYTES} of {dlq.name} from {actual} to {need}: {exc}"
            ) from exc
    log.warning(
        "raised %s of %s from %d to %d bytes, the runs topic's, so any dead letter fits",
        MAX_MESSAGE_BYTES,
        dlq.name,
        actual,
        need,
    )
    return need


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
    described = _describe(admin, [s.name for s in present])
    for s in present:
        configs = described[s.name]
        for key in CHECKED_CONFIGS:
            expected = s.config.get(key, "delete")
            actual = configs[key].value if key in configs else "<unset>"
            if actual != expected:
                drifts.append(Drift(s.name, key, expected, str(actual)))
    floor = _dlq_floor(specs, {name: _limit(c) for name, c in described.items()})
    if floor is not None:
        dlq, actual_limit, need = floor
        drifts.append(Drift(dlq.name, MAX_MESSAGE_BYTES, f">= {need}", str(actual_limit)))
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
