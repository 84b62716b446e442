"""The broker is down while the gateway publishes: Postgres keeps the run, the
sweeper republishes it once the broker is back, and a worker finishes it. The broker
is down while the worker commits or stops: neither waits for it."""

from __future__ import annotations

import asyncio
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from confluent_kafka import Producer

from koda_runtime.kafka import producer_config
from koda_runtime.localstack import StackInfo, down, kafka_node_start, kafka_node_stop, up
from koda_runtime.schemas.migrate import upgrade
from koda_runtime.settings import Settings
from koda_runtime.topics.admin import apply_topics
from koda_runtime.topics.catalogue import RUNS
from koda_runtime.topics.kafka.intake import COMMIT_ANSWER_S, Fetched, RunsIntake
from koda_runtime.topics.kafka.offsets import GroupOffsetReader
from tests.fixtures.namespaces import make_settings
from tests.fixtures.processes import GatewayProcess, WorkerProcess
from tests.fixtures.runs import Submitter
from tests.support import async_wait_until, wait_until


@pytest.fixture(scope="module")
def private_stack() -> Iterator[tuple[Path, StackInfo]]:
    """A stack of this module's own: its broker is stopped on purpose."""
    state = Path(tempfile.mkdtemp(prefix="koda-outage-", dir="/tmp"))
    try:
        yield state, up(state)
    finally:
        try:
            down(state)
        finally:
            shutil.rmtree(state, ignore_errors=True)


def test_run_published_while_broker_down_is_swept_and_done(private_stack) -> None:
    state, info = private_stack
    settings: Settings = make_settings(
        info, sweep_after_s=1.0, sweep_interval_s=0.5, publish_timeout_s=3.0
    )
    upgrade(settings)
    apply_topics(settings)
    sub = Submitter(settings)
    gateway = GatewayProcess(
        settings,
        {"KODA_SWEEP_AFTER": "1", "KODA_SWEEP_INTERVAL": "0.5", "KODA_PUBLISH_TIMEOUT": "3"},
    ).start()
    worker = WorkerProcess(settings, "w1").start()
    try:
        auth = {"Authorization": "Bearer dev:outage-user"}
        warm = httpx.post(
            f"{gateway.url}/v1/runs",
            headers=auth,
            json={"input": {"text": "warm", "demo": {"tokens": 2, "delay_ms": 1}}},
        )
        assert warm.status_code == 202
        wait_until(
            lambda: sub.all_terminal([warm.json()["run_id"]]), timeout=60, what="warm-up run"
        )

        kafka_node_stop(state, 1)
        resp = httpx.post(
            f"{gateway.url}/v1/runs",
            headers=auth,
            timeout=30,
            json={"input": {"text": "during outage", "demo": {"tokens": 3, "delay_ms": 1}}},
        )
        assert resp.status_code == 202, resp.text
        run_id = resp.json()["run_id"]
        # The publish fails (message timeout); the run is pending and marked unpublished.
        wait_until(
            lambda: (
                sub.query("SELECT status, published_at FROM runs WHERE id = :r", r=run_id)[0]
                == ("pending", None)
            ),
            timeout=20,
            what="publish failure recorded",
        )
        kafka_node_start(state, 1)
        wait_until(lambda: sub.all_terminal([run_id]), timeout=120, what="swept run done")
        row = sub.query("SELECT status, attempt FROM runs WHERE id = :r", r=run_id)[0]
        assert (row.status, row.attempt) == ("done", 1)
        assert re.search(r"event=sweep_done republished=[1-9]", gateway.log()), gateway.log()[
            -3000:
        ]
    finally:
        worker.stop()
        gateway.stop()
        sub.close()


async def test_a_commit_while_the_broker_is_down_is_answered_and_the_member_keeps_polling(
    private_stack,
) -> None:
    """librdkafka holds a commit while the group has no coordinator. A synchronous one
    held the member's polling thread with it: the member left the group past
    max.poll.interval.ms, and every later call from the loop (a SIGTERM's final commit
    among them) waited for good. The commit must come back not confirmed, in bounded
    time, with the thread still serving calls; once the broker is back, it lands."""
    state, info = private_stack
    settings: Settings = make_settings(info)
    apply_topics(settings)
    topic = settings.names.topic(RUNS)
    producer = Producer(producer_config(settings, "test"))
    for p in range(settings.partitions):
        producer.produce(topic, value=b"x", partition=p)
    assert producer.flush(30) == 0
    fetched: list[Fetched] = []

    class Hooks:
        async def assigned(self, partitions: list[int]) -> None:
            pass

        async def revoked(self, partitions: list[int]) -> None:
            pass

        async def lost(self, partitions: list[int]) -> None:
            pass

    async def all_read() -> bool:
        return len(fetched) == settings.partitions

    async def lands() -> bool:
        return await intake.commit({1: 1})

    group = settings.names.group("outage-commit")
    intake = RunsIntake(settings, topic, group, deliver=fetched.extend, hooks=Hooks())
    intake.start()
    try:
        await async_wait_until(all_read, timeout=60, what="all read")
        assert await intake.commit({0: 1})  # the broker's answer reaches the loop

        kafka_node_stop(state, 1)
        started = time.monotonic()
        answered = await asyncio.wait_for(intake.commit({1: 1}), COMMIT_ANSWER_S + 10)
        assert answered is False
        assert time.monotonic() - started < COMMIT_ANSWER_S + 5
        # The thread still runs the loop's calls (it was stuck in the commit before).
        positions = await asyncio.wait_for(intake.positions([0]), 5)
        assert positions == {0: 1}

        kafka_node_start(state, 1)
        await async_wait_until(lands, timeout=90, what="the commit lands after the outage")
        reader = GroupOffsetReader(settings, "test", topic, group)
        try:
            committed = await reader.run(reader.committed, [0, 1])
        finally:
            await reader.aclose()
        assert committed == {0: 1, 1: 1}
    finally:
        kafka_node_start(state, 1)
        await intake.stop(20)


def test_a_worker_stops_on_sigterm_while_the_broker_is_down(private_stack) -> None:
    """A worker whose last work is not yet committed when the broker goes away still
    ends on SIGTERM (exit status 0), well within its orchestrator's grace period."""
    state, info = private_stack
    settings: Settings = make_settings(info)
    upgrade(settings)
    apply_topics(settings)
    sub = Submitter(settings)
    worker = WorkerProcess(settings, "w1").start()
    try:
        runs = [
            sub.submit(f"outage-user-{i}", {"text": "t", "demo": {"tokens": 2, "delay_ms": 1}})
            for i in range(4)
        ]
        wait_until(lambda: sub.all_terminal(runs), timeout=60, what="runs done")
        kafka_node_stop(state, 1)
        time.sleep(3)  # periodic commits are tried (and held by librdkafka) meanwhile
        started = time.monotonic()
        assert worker.stop(timeout=30.0) == 0
        assert time.monotonic() - started < 25
    finally:
        worker.kill()
        kafka_node_start(state, 1)
        sub.close()


async def test_a_member_that_reaches_no_broker_for_long_is_built_again_and_rejoins(
    private_stack,
) -> None:
    """The runs consumer is rebuilt once librdkafka's statistics have shown no broker
    connection up for ``rebuild_after_s`` (a chaos run left two workers' consumers
    without a single connection attempt after a broker restart, for minutes). Provoked
    here with the broker away: the member is closed and built again, and once the
    broker is back it joins the group again and reads what is produced after."""
    state, info = private_stack
    settings: Settings = make_settings(info)
    apply_topics(settings)
    topic = settings.names.topic(RUNS)
    producer = Producer(producer_config(settings, "test"))

    def produce(value: bytes) -> None:
        for p in range(settings.partitions):
            producer.produce(topic, value=value, partition=p)
        assert producer.flush(60) == 0

    produce(b"before")
    fetched: list[Fetched] = []
    assigned: list[list[int]] = []

    class Hooks:
        async def assigned(self, partitions: list[int]) -> None:
            assigned.append(partitions)

        async def revoked(self, partitions: list[int]) -> None:
            pass

        async def lost(self, partitions: list[int]) -> None:
            pass

    async def read(value: bytes) -> bool:
        return sum(1 for f in fetched if f.value == value) >= settings.partitions

    async def rebuilt() -> bool:
        return intake.rebuilds > 0

    rebuilt_before = metrics_value("runs")
    group = settings.names.group("outage-rebuild")
    intake = RunsIntake(
        settings,
        topic,
        group,
        deliver=fetched.extend,
        hooks=Hooks(),
        config={"statistics.interval.ms": 200},
        rebuild_after_s=1.0,
    )
    intake.start()
    try:
        await async_wait_until(lambda: read(b"before"), timeout=60, what="the first records")
        joins = len([a for a in assigned if a])
        # Ten statistics reports with the broker up: a member that reaches it is kept.
        await asyncio.sleep(2.0)  # no rebuild meanwhile: an absence can only be waited out
        assert intake.rebuilds == 0
        kafka_node_stop(state, 1)
        await async_wait_until(rebuilt, timeout=60, what="the member to be built again")
        kafka_node_start(state, 1)
        produce(b"after")
        await async_wait_until(lambda: read(b"after"), timeout=120, what="records after it")
        assert len([a for a in assigned if a]) > joins  # it joined the group again
        assert metrics_value("runs") - rebuilt_before == intake.rebuilds
    finally:
        kafka_node_start(state, 1)
        await intake.stop(20)


def metrics_value(client: str) -> float:
    """koda_kafka_clients_rebuilt_total{client} in this process."""
    from koda_runtime import metrics

    sample = metrics.REGISTRY.get_sample_value(
        "koda_kafka_clients_rebuilt_total", {"client": client}
    )
    return sample or 0.0
