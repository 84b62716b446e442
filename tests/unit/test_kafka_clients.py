"""Every librdkafka client of koda's goes back to bootstrap.servers when it has reached no
known broker for REBOOTSTRAP_AFTER_MS, and the runs consumer reads its statistics for
whether any broker connection is up."""

from __future__ import annotations

from koda_runtime.kafka import (
    REBOOTSTRAP_AFTER_MS,
    consumer_config,
    producer_config,
    runs_consumer_config,
)
from koda_runtime.naming import AppEnv
from koda_runtime.settings import Settings
from koda_runtime.topics.admin import admin_client
from koda_runtime.topics.kafka.intake import broker_up

SETTINGS = Settings(
    app_env=AppEnv.DEV,
    kafka_bootstrap="127.0.0.1:1",
    database_url="postgresql://nobody@127.0.0.1:1/none",
    namespace="unit",
)


def test_every_client_rebootstraps_after_the_bound() -> None:
    for conf in (
        producer_config(SETTINGS, "p"),
        consumer_config(SETTINGS, "c", None),
        consumer_config(SETTINGS, "c", "g"),
        runs_consumer_config(SETTINGS, "g"),
    ):
        assert conf["metadata.recovery.strategy"] == "rebootstrap"
        assert conf["metadata.recovery.rebootstrap.trigger.ms"] == REBOOTSTRAP_AFTER_MS
        assert conf["bootstrap.servers"] == "127.0.0.1:1"
    assert REBOOTSTRAP_AFTER_MS < 300_000  # below librdkafka's default, or it changes nothing
    admin_client(SETTINGS)  # librdkafka accepts the settings (raises on an unknown one)


def test_broker_up_reads_the_connection_states_and_ignores_the_internal_broker() -> None:
    def stats(*brokers: tuple[str, int, str]) -> dict[str, object]:
        return {
            "brokers": {
                name: {"name": name, "nodeid": node, "state": state}
                for name, node, state in brokers
            }
        }

    internal = (":0/internal", -1, "UP")
    assert not broker_up({})
    assert not broker_up(stats(internal))
    assert not broker_up(stats(internal, ("127.0.0.1:9092/1", 1, "DOWN")))
    assert not broker_up(stats(internal, ("127.0.0.1:9092/bootstrap", -1, "CONNECT")))
    assert broker_up(stats(internal, ("127.0.0.1:9092/1", 1, "UP")))
    assert broker_up(stats(internal, ("127.0.0.1:9092/bootstrap", -1, "UP")))
