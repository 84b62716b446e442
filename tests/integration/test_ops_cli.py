"""`koda topics delete` and `koda dlq replay` against the real broker."""

from __future__ import annotations

import json
from typing import Any

from confluent_kafka import KafkaException, Producer
from confluent_kafka.admin import AdminClient
from typer.testing import CliRunner

from koda_runtime import cli
from koda_runtime.kafka import producer_config
from koda_runtime.settings import Settings
from koda_runtime.topics.admin import apply_topics
from koda_runtime.topics.catalogue import RUNS, RUNS_DLQ, catalogue, partition_for_key
from koda_runtime.topics.records.codec import (
    DEAD_LETTER,
    MAX_DEAD_LETTER_ORIGINAL,
    RUN_REQUESTED,
    RunRequested,
    dead_letter_value,
    headers_for,
)
from tests.fixtures.processes import settings_env
from tests.fixtures.runs import read_topic
from tests.support import wait_until

runner = CliRunner()


def existing_topics(settings: Settings) -> set[str]:
    admin = AdminClient({"bootstrap.servers": settings.kafka_bootstrap})
    return set(admin.list_topics(timeout=10).topics)


def test_topics_delete_in_dev_deletes_the_catalogue_and_asks_nothing(settings) -> None:
    apply_topics(settings)  # not the kafka_topics fixture: this test deletes them itself
    names = {s.name for s in catalogue(settings)}
    assert names <= existing_topics(settings)
    result = runner.invoke(cli.app, ["topics", "delete"], env=settings_env(settings), input="")
    assert result.exit_code == 0, result.output
    assert f"deleted {settings.names.topic(RUNS)}" in result.stdout
    assert "topics deleted (6)" in result.stdout
    wait_until(
        lambda: names.isdisjoint(existing_topics(settings)),
        timeout=30,
        what="deleted topics gone from the metadata",
    )


def read_fresh(settings: Settings, topic: str) -> list[Any]:
    """read_topic, retried while a just-created topic's leaders are still being elected."""

    def attempt() -> tuple[list[Any]] | None:
        try:
            return (read_topic(settings, topic, timeout=5),)
        except KafkaException:
            return None

    return wait_until(attempt, timeout=30, interval=0.5, what=f"{topic} readable")[0]


def dead_letter(
    settings: Settings, user: str, run_id: str, reason: str, *, big: bool = False
) -> tuple[bytes, bytes]:
    key = user.encode()
    value = RunRequested(run_id, user, f"s-{user}", "").encode()
    if big:
        value += b" " * (MAX_DEAD_LETTER_ORIGINAL + 1)
    letter = dead_letter_value(
        key=key,
        value=value,
        headers=headers_for(RUN_REQUESTED),
        topic=settings.names.topic(RUNS),
        partition=0,
        offset=7,
        attempts=0,
        reason=reason,
        error="test",
    )
    return key, letter


def test_dlq_replay_republishes_the_original_records(kafka_topics) -> None:
    settings = kafka_topics
    dlq = settings.names.topic(RUNS_DLQ)
    producer = Producer(producer_config(settings, "test"))
    letters = [
        dead_letter(settings, "alice", "run-a", "unknown_run"),
        dead_letter(settings, "bob", "run-b", "handler_failed"),
        dead_letter(settings, "carol", "run-c", "unknown_run", big=True),
        dead_letter(settings, "dave", "run-d", "unknown_schema_version"),
    ]
    for key, value in letters:
        producer.produce(dlq, key=key, value=value, headers=list(headers_for(DEAD_LETTER)))
    assert producer.flush(30) == 0
    env = settings_env(settings)

    dry = runner.invoke(cli.app, ["dlq", "replay", "--dry-run"], env=env)
    assert dry.exit_code == 0, dry.output
    assert "would replay 3 of 4 dead letters" in dry.stdout
    assert "skipped: original truncated" in dry.stdout
    assert read_fresh(settings, settings.names.topic(RUNS)) == []

    result = runner.invoke(
        cli.app,
        ["dlq", "replay", "--reason", "unknown_run", "--reason", "unknown_schema_version"],
        env=env,
    )
    assert result.exit_code == 0, result.output
    assert "replayed 2 of 4 dead letters; next offsets {0: 4}" in result.stdout
    assert "skipped: reason handler_failed" in result.stdout
    replayed = read_fresh(settings, settings.names.topic(RUNS))
    got = {m.key().decode(): m for m in replayed}
    assert sorted(got) == ["alice", "dave"]
    for user, run_id in (("alice", "run-a"), ("dave", "run-d")):
        msg = got[user]
        assert json.loads(msg.value())["run_id"] == run_id
        assert dict(msg.headers())["schema"] == b"run.requested/1"
        assert msg.partition() == partition_for_key(user.encode(), settings.partitions)

    later = runner.invoke(cli.app, ["dlq", "replay", "--from-offset", "4"], env=env)
    assert later.exit_code == 0 and "replayed 0 of 0" in later.stdout
