"""The dead-letter topic's ``max.message.bytes`` is kept at least the runs topic's, on the
real broker: a DLQ made by an older release (the broker's default limit, about 1 MiB,
under the runs topic's 2 MiB) is reported by ``check_topics`` and raised by
``apply_topics``; a runs topic an operator raised further raises the DLQ with it; a DLQ
already above is never lowered."""

from __future__ import annotations

from confluent_kafka import KafkaException
from confluent_kafka.admin import (  # type: ignore[attr-defined]
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    NewTopic,
    ResourceType,
)

from koda_runtime.settings import Settings
from koda_runtime.topics.admin import admin_client, apply_topics, check_topics, raise_dlq_limit
from koda_runtime.topics.catalogue import RUNS, RUNS_DLQ, RUNS_MAX_MESSAGE_BYTES, catalogue
from tests.fixtures.namespaces import delete_topics
from tests.support import wait_until

OLD_DEFAULT = 1_048_588  # the broker's message.max.bytes, what a DLQ without the setting has


def limit(settings: Settings, base: str) -> int:
    """The topic's max.message.bytes as the broker describes it."""
    admin = admin_client(settings)
    res = ConfigResource(ResourceType.TOPIC, settings.names.topic(base))

    def described() -> int | None:
        try:  # a topic created a moment ago may not be described yet
            configs = admin.describe_configs([res])[res].result(30)
        except KafkaException:
            return None
        return int(configs["max.message.bytes"].value)

    return wait_until(described, what=f"{base} described")


def set_limit(settings: Settings, base: str, value: int) -> None:
    op = AlterConfigOpType.SET
    entry = ConfigEntry("max.message.bytes", str(value), incremental_operation=op)
    res = ConfigResource(
        ResourceType.TOPIC, settings.names.topic(base), incremental_configs=[entry]
    )
    admin = admin_client(settings)  # referenced until the futures resolve
    for fut in admin.incremental_alter_configs([res]).values():
        fut.result(30)
    wait_until(lambda: limit(settings, base) == value, what=f"{base} at {value} bytes")


def create_old_dlq(settings: Settings) -> None:
    """The DLQ as a release before the setting made it: no max.message.bytes."""
    name = settings.names.topic(RUNS_DLQ)
    admin = admin_client(settings)
    for fut in admin.create_topics([NewTopic(name, 1, 1)]).values():
        fut.result(30)
    wait_until(lambda: name in admin.list_topics(timeout=10).topics, what=f"{name} in the metadata")


def test_a_dlq_below_the_runs_topic_is_reported_and_raised(settings: Settings) -> None:
    dlq = settings.names.topic(RUNS_DLQ)
    try:
        create_old_dlq(settings)
        assert limit(settings, RUNS_DLQ) == OLD_DEFAULT
        apply_topics(settings)  # creates the rest, the runs topic at 2 MiB among them
        assert limit(settings, RUNS) == RUNS_MAX_MESSAGE_BYTES
        wait_until(
            lambda: limit(settings, RUNS_DLQ) == RUNS_MAX_MESSAGE_BYTES, what="the DLQ raised"
        )
        assert check_topics(settings) == []
        # Set back to the old limit: check names it, apply raises it again.
        set_limit(settings, RUNS_DLQ, OLD_DEFAULT)
        drifts = {(d.topic, d.what): d for d in check_topics(settings)}
        drift = drifts[(dlq, "max.message.bytes")]
        assert (drift.expected, drift.actual) == (f">= {RUNS_MAX_MESSAGE_BYTES}", str(OLD_DEFAULT))
        assert apply_topics(settings) == []  # nothing created, the limit raised
        wait_until(
            lambda: limit(settings, RUNS_DLQ) == RUNS_MAX_MESSAGE_BYTES, what="the DLQ raised"
        )
        assert check_topics(settings) == []
    finally:
        delete_topics(settings)


def test_the_dlq_follows_a_raised_runs_topic_and_is_never_lowered(settings: Settings) -> None:
    try:
        apply_topics(settings)
        set_limit(settings, RUNS, 4 * 1024 * 1024)  # an operator raised the runs topic
        assert [d.what for d in check_topics(settings)] == ["max.message.bytes"]
        apply_topics(settings)
        wait_until(lambda: limit(settings, RUNS_DLQ) == 4 * 1024 * 1024, what="the DLQ at 4 MiB")
        set_limit(settings, RUNS_DLQ, 8 * 1024 * 1024)  # above: left alone
        assert raise_dlq_limit(admin_client(settings), catalogue(settings)) is None
        apply_topics(settings)
        assert limit(settings, RUNS_DLQ) == 8 * 1024 * 1024
        assert check_topics(settings) == []
    finally:
        delete_topics(settings)
