"""The local stack against real processes: Kafka answers, Postgres answers, down is clean."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from koda_runtime.localstack import (
    StackInfo,
    down,
    kafka_node_kill,
    kafka_node_pid,
    kafka_node_start,
    kafka_node_stop,
    pg_kill,
    pg_pid,
    pg_start,
    pg_stop,
    status,
    up,
)
from koda_runtime.localstack.jars import kafka_version, load_lock
from koda_runtime.localstack.kafka_cluster import prepare_cluster
from koda_runtime.localstack.procs import pid_alive, wait_until
from koda_runtime.localstack.stack import ENV_FILE, env_lines


@pytest.fixture
def state_dir() -> Iterator[Path]:
    """A private state dir for a second stack, torn down even when the test fails."""
    path = Path(tempfile.mkdtemp(prefix="koda-test-services-", dir="/tmp"))
    try:
        yield path
    finally:
        try:
            down(path)
        finally:
            shutil.rmtree(path, ignore_errors=True)


def _create_topic(bootstrap: str, name: str, *, partitions: int = 1, replication: int = 1) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    futures = admin.create_topics(
        [NewTopic(name, num_partitions=partitions, replication_factor=replication)],
        operation_timeout=30,
    )
    futures[name].result(timeout=30)
    assert wait_until(lambda: name in admin.list_topics(timeout=5).topics, timeout_s=10)


def _roundtrip(bootstrap: str, topic: str, payload: bytes) -> bytes | None:
    """Produce one record with acks=all and read it back by partition assignment.

    No consumer group: a group would create __consumer_offsets, which is not under test.
    """
    producer = Producer({"bootstrap.servers": bootstrap, "acks": "all"})
    producer.produce(topic, key=b"k", value=payload)
    assert producer.flush(30) == 0
    consumer = Consumer({
        "bootstrap.servers": bootstrap,
        "group.id": f"test-services-{uuid.uuid4().hex[:8]}",
        "enable.auto.commit": False,
    })  # fmt: skip
    try:
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            assert msg.error() is None, msg.error()
            return msg.value()
        return None
    finally:
        consumer.close()


def _select_one(url: str) -> int:
    with psycopg.connect(url, connect_timeout=5) as conn:
        row = conn.execute("select 1").fetchone()
    assert row is not None
    return int(row[0])


def _processes_mentioning(text: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if text in cmd and pid_alive(int(entry.name)):
                pids.append(int(entry.name))
    return pids


def _postgres_children(postmaster: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == postmaster:
                out.append(int(entry.name))
    return out


def test_stack_kafka_creates_topic_and_roundtrips_a_message(stack: StackInfo) -> None:
    topic = f"test.services.{uuid.uuid4().hex[:12]}"
    _create_topic(stack.kafka_bootstrap, topic)
    assert _roundtrip(stack.kafka_bootstrap, topic, b"hello") == b"hello"
    AdminClient({"bootstrap.servers": stack.kafka_bootstrap}).delete_topics([topic])


def test_stack_postgres_answers(stack: StackInfo) -> None:
    assert _select_one(stack.database_url) == 1


def test_up_recovers_from_half_written_dirs_and_crash_and_down_leaves_nothing(
    state_dir: Path,
) -> None:
    # An initdb and a storage format that died halfway: no PG_VERSION, no meta.properties.
    (state_dir / "pg" / "data" / "base").mkdir(parents=True)
    prepare_cluster(state_dir.resolve(), 1, kafka_version(load_lock()))
    (state_dir / "kafka" / "node-1" / "data").mkdir(parents=True)
    (state_dir / "kafka" / "node-1" / "data" / "junk").write_text("x")

    first = up(state_dir)
    assert (state_dir / ENV_FILE).read_text().splitlines() == env_lines(first)
    assert _select_one(first.database_url) == 1
    again = up(state_dir)  # already running: the same answer, nothing restarted
    assert again == first
    kafka_pid, postmaster = kafka_node_pid(state_dir, 1), pg_pid(state_dir)
    assert kafka_pid is not None and postmaster is not None
    assert status(state_dir)["running"] is True

    # Crash: SIGKILL everything, pid files stay behind.
    kafka_node_kill(state_dir, 1)
    pg_kill(state_dir)
    assert not pid_alive(kafka_pid) and not pid_alive(postmaster)
    assert (state_dir / "kafka" / "node-1" / "kafka.pid").exists()
    assert (state_dir / "pg" / "data" / "postmaster.pid").exists()
    assert status(state_dir)["running"] is False

    recovered = up(state_dir)
    assert recovered == first  # same ports
    topic = f"test.services.{uuid.uuid4().hex[:12]}"
    _create_topic(recovered.kafka_bootstrap, topic)
    assert _roundtrip(recovered.kafka_bootstrap, topic, b"after-crash") == b"after-crash"
    assert _select_one(recovered.database_url) == 1

    # Graceful restarts of single processes, as fault tests do them.
    kafka_node_stop(state_dir, 1)
    assert kafka_node_pid(state_dir, 1) is None
    kafka_node_start(state_dir, 1)
    # Reading from the beginning returns the record written before the restart.
    assert _roundtrip(recovered.kafka_bootstrap, topic, b"restarted") == b"after-crash"
    pg_stop(state_dir)
    assert pg_pid(state_dir) is None
    assert pg_start(state_dir) == recovered.database_url
    assert _select_one(recovered.database_url) == 1

    pids = [kafka_node_pid(state_dir, 1), pg_pid(state_dir)]
    assert None not in pids
    pids += _postgres_children(pids[1])  # type: ignore[arg-type]
    down(state_dir)
    assert [p for p in pids if p is not None and pid_alive(p)] == []
    assert _processes_mentioning(str(state_dir)) == []
    assert not (state_dir / "kafka" / "node-1" / "kafka.pid").exists()
    assert not (state_dir / "pg" / "data" / "postmaster.pid").exists()
    assert not (state_dir / ENV_FILE).exists()


def test_three_brokers_replicate_and_survive_one_node_loss(state_dir: Path) -> None:
    info = up(state_dir, brokers=3)
    assert info.brokers == 3 and len(info.kafka_bootstrap.split(",")) == 3
    admin = AdminClient({"bootstrap.servers": info.kafka_bootstrap})
    assert set(admin.list_topics(timeout=10).brokers) == {1, 2, 3}

    topic = f"test.services.{uuid.uuid4().hex[:12]}"
    _create_topic(info.kafka_bootstrap, topic, partitions=3, replication=3)
    partitions = admin.list_topics(topic, timeout=10).topics[topic].partitions
    assert all(len(p.replicas) == 3 for p in partitions.values())

    # One node down: min.insync.replicas=2 still accepts acks=all writes.
    kafka_node_kill(state_dir, 2)
    assert kafka_node_pid(state_dir, 2) is None
    assert _roundtrip(info.kafka_bootstrap, topic, b"two-of-three") == b"two-of-three"

    kafka_node_start(state_dir, 2)
    assert wait_until(lambda: set(admin.list_topics(timeout=5).brokers) == {1, 2, 3}, timeout_s=30)
