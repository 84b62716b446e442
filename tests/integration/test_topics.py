from __future__ import annotations

from confluent_kafka.admin import NewTopic  # type: ignore[attr-defined]

from koda_runtime.settings import Settings
from koda_runtime.topics.admin import admin_client, apply_topics, check_topics
from koda_runtime.topics.catalogue import RUN_CHUNKS, RUNS, catalogue
from tests.fixtures.namespaces import delete_topics
from tests.support import wait_until


def create_raw(settings: Settings, name: str, partitions: int, **config: str) -> None:
    admin = admin_client(settings)
    for fut in admin.create_topics(
        [NewTopic(name, num_partitions=partitions, replication_factor=1, config=config)]
    ).values():
        fut.result()

    def visible() -> bool:
        topic = admin.list_topics(timeout=10).topics.get(name)
        return topic is not None and topic.error is None and len(topic.partitions) == partitions

    wait_until(visible, what=f"topic {name} in metadata")


def test_apply_is_idempotent_and_check_passes(settings: Settings) -> None:
    try:
        created = apply_topics(settings)
        assert sorted(created) == sorted(s.name for s in catalogue(settings))
        assert apply_topics(settings) == []
        assert check_topics(settings) == []
        configs = {s.base: s.cleanup_policy for s in catalogue(settings)}
        assert configs[RUN_CHUNKS] == "compact" and configs["workers"] == "compact"
    finally:
        delete_topics(settings)


def test_check_reports_missing_wrong_partitions_and_wrong_cleanup(settings: Settings) -> None:
    runs = settings.names.topic(RUNS)
    chunks = settings.names.topic(RUN_CHUNKS)
    try:
        create_raw(settings, runs, settings.partitions * 2)
        create_raw(settings, chunks, settings.partitions, **{"cleanup.policy": "delete"})
        drifts = {(d.topic, d.what): d for d in check_topics(settings)}
        assert drifts[(runs, "partitions")].actual == str(settings.partitions * 2)
        assert drifts[(chunks, "cleanup.policy")].expected == "compact"
        assert drifts[(chunks, "cleanup.policy")].actual == "delete"
        missing = {t for (t, what) in drifts if what == "topic"}
        assert missing == {s.name for s in catalogue(settings)} - {runs, chunks}
        # apply creates the missing ones but never "repairs" drift silently
        apply_topics(settings)
        remaining = {(d.topic, d.what) for d in check_topics(settings)}
        assert remaining == {(runs, "partitions"), (chunks, "cleanup.policy")}
    finally:
        delete_topics(settings)
