"""The chaos stack's per-process network: every connection of a slot goes through its
own proxies, so cutting them cuts that slot alone, and not only its bootstrap.

Failure mode: a client that bootstraps through a proxy but is then told the broker's
own address (one listener, advertised as the broker) reconnects around the proxy, and
a "cut" leaves it connected. The slot listeners advertise the slot's proxy ports: the
metadata a slot's client sees names those, and with them disabled it reaches nothing
while the next slot's client goes on.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from confluent_kafka import KafkaError, Producer
from sqlalchemy import create_engine, text
from sqlalchemy.exc import OperationalError

from koda_runtime.localstack.kafka_cluster import load_cluster
from koda_runtime.settings import Settings
from koda_runtime.topics.admin import apply_topics
from koda_runtime.topics.catalogue import RUNS
from tests.chaos.cluster import Stack
from tests.chaos.toxiproxy import Network
from tests.fixtures.namespaces import delete_topics, make_settings


@pytest.fixture
def topics(stack_restored: Stack) -> Iterator[Settings]:
    settings = make_settings(stack_restored.info)
    apply_topics(settings)
    yield settings
    delete_topics(settings)


def produce(bootstrap: str, topic: str, timeout_s: float) -> Any:
    """Produce one record through ``bootstrap``; the delivery error, or None."""
    producer = Producer({
        "bootstrap.servers": bootstrap,
        "message.timeout.ms": int(timeout_s * 1000),
        "socket.connection.setup.timeout.ms": 1000,
        "reconnect.backoff.max.ms": 200,
        "log_level": 0,
    })  # fmt: skip
    result: list[Any] = []
    producer.produce(topic, b"probe", key=b"k", on_delivery=lambda err, _: result.append(err))
    producer.flush(timeout_s + 10)
    return result[0] if result else "no delivery report"


def test_a_cut_slot_loses_every_broker_connection_and_only_that_slot(
    stack_restored: Stack, topics: Settings
) -> None:
    net = stack_restored.network
    assert isinstance(net, Network)
    cluster = load_cluster(stack_restored.state_dir)
    assert cluster is not None
    topic = topics.names.topic(RUNS)
    w1 = net.slots["w1"]

    # The metadata a w1 client gets names w1's proxy of every node, not the broker.
    producer = Producer({"bootstrap.servers": w1.kafka_bootstrap, "log_level": 0})
    brokers = producer.list_topics(timeout=10).brokers
    assert {b.id: b.port for b in brokers.values()} == {
        n.node_id: n.slot("w1").advertised_port for n in cluster.nodes
    }
    assert all(n.slot("w1").advertised_port != n.port for n in cluster.nodes)
    assert produce(w1.kafka_bootstrap, topic, 5) is None

    # Cut: a client that already holds its connections loses them, a new one finds none;
    # w2 goes on.
    producer.produce(topic, b"before", key=b"k")
    producer.flush(10)
    net.cut_kafka("w1")
    held: list[Any] = []
    producer.produce(topic, b"held", key=b"k", on_delivery=lambda err, _: held.append(err))
    try:
        failed = produce(w1.kafka_bootstrap, topic, 3)
        assert isinstance(failed, KafkaError), failed
        assert produce(net.slots["w2"].kafka_bootstrap, topic, 5) is None
        producer.poll(3)
        assert held == [], "a w1 record was delivered while w1 was cut"
    finally:
        net.cut_kafka("w1", cut=False)
    producer.flush(30)
    assert held == [None], held  # delivered once healed, on a reconnect through the proxy


def test_a_cut_slot_loses_postgres_and_only_that_slot(stack_restored: Stack) -> None:
    net = stack_restored.network
    assert isinstance(net, Network)
    engines = {
        slot: create_engine(net.slots[slot].database_url, connect_args={"connect_timeout": 2})
        for slot in ("w1", "w2")
    }

    def select_one(slot: str) -> int:
        with engines[slot].connect() as conn:
            return int(conn.execute(text("SELECT 1")).scalar_one())

    try:
        assert select_one("w1") == 1
        net.cut_pg("w1")
        with pytest.raises(OperationalError):
            select_one("w1")
        assert select_one("w2") == 1
        net.cut_pg("w1", cut=False)
        assert select_one("w1") == 1
    finally:
        net.heal()
        for e in engines.values():
            e.dispose()
