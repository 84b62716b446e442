"""Worker operations without services: probes, heartbeat records, the gateway's table."""

from __future__ import annotations

import asyncio
import json
import os
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from koda_runtime.errors import ConfigError, RecordError
from koda_runtime.gateway.workers import WorkerTable
from koda_runtime.naming import AppEnv
from koda_runtime.processors.health import (
    ROUTES,
    TICK_S,
    Check,
    GroupMembership,
    HealthServer,
    LoopProbe,
)
from koda_runtime.processors.heartbeat import Heartbeat
from koda_runtime.settings import Settings
from koda_runtime.topics.records.heartbeats import Beat, decode_beat
from tests.support import async_wait_until

SETTINGS = Settings(
    app_env=AppEnv.DEV,
    namespace="unit",
    worker_id="w-1",
    beat_interval_s=0.05,
    beat_stale_after_s=0.5,
)
T0 = datetime(2025, 1, 1, tzinfo=UTC)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# --- probes -------------------------------------------------------------------


def test_loop_probe_fails_once_the_loop_was_blocked_longer_than_the_stall_limit() -> None:
    clock = Clock()
    probe = LoopProbe(stall_s=2.0, clock=clock)
    assert probe.check().ok
    probe.tick(0.01)
    assert probe.check().ok
    clock.now += TICK_S + 1.5  # overdue by 1.5 s: still within the limit
    assert probe.check().ok
    clock.now += 1.0  # overdue by 2.5 s: a blocked loop
    assert not probe.check().ok
    probe.tick(2.5)  # the probe finally ran, 2.5 s late
    assert not probe.check().ok
    assert probe.check().detail["loop_lag_s"] == 2.5
    probe.tick(0.0)
    assert probe.check().ok


async def test_loop_probe_sees_a_blocking_call() -> None:
    probe = LoopProbe(stall_s=0.2)
    probe.start()
    try:
        first = probe.last_tick

        async def ticked() -> bool:
            return probe.last_tick != first

        await async_wait_until(ticked, timeout=5, interval=0.05, what="a tick")
        assert probe.check().ok
        import time

        time.sleep(1.0)  # blocks the event loop on purpose
        assert not probe.check().ok
    finally:
        await probe.stop()


def test_membership_is_ready_once_joined_and_until_stuck_rebalancing() -> None:
    clock = Clock()
    member = GroupMembership(stuck_after_s=30.0, clock=clock)
    check = member.check()
    assert not check.ok and "not joined" in check.detail["reason"]
    member.on_rebalance_start(None)
    clock.now += 1
    assert not member.check().ok  # first rebalance: no assignment yet
    member.on_rebalance_end(None, {})
    assert member.check().ok and member.check().detail["rebalancing"] is False
    clock.now += 5
    member.on_rebalance_start(None)  # a routine rebalance (a rolling deploy)
    clock.now += 20
    assert member.check().ok and member.check().detail["rebalancing"] is True
    clock.now += 11
    stuck = member.check()
    assert not stuck.ok and "stuck rebalancing" in stuck.detail["reason"]
    member.on_rebalance_end(None, None)
    assert member.check().ok


async def test_health_server_answers_the_probes_and_metrics() -> None:
    state = {"live": Check(True, {"loop_lag_s": 0.0}), "ready": Check(False, {"reason": "x"})}
    server = HealthServer("127.0.0.1", 0, live=lambda: state["live"], ready=lambda: state["ready"])
    app = server.app()
    routes = {r.resource.canonical if r.resource else None for r in app.router.routes()}
    assert routes == set(ROUTES)
    async with TestClient(TestServer(app)) as client:
        live = await client.get("/livez")
        assert live.status == 200 and (await live.json())["status"] == "ok"
        ready = await client.get("/readyz")
        assert ready.status == 503 and (await ready.json()) == {
            "status": "unavailable",
            "reason": "x",
        }
        state["live"] = Check(False, {"loop_lag_s": 12.0})
        assert (await client.get("/livez")).status == 503
        scraped = await client.get("/metrics")
        assert scraped.status == 200
        assert scraped.headers["Content-Type"].startswith("text/plain")
        text = await scraped.text()
        assert "koda_runs_total" in text and "koda_event_loop_lag_seconds" in text


# --- heartbeats ---------------------------------------------------------------


class FakeProducer:
    def __init__(self, fail: bool = False) -> None:
        self.sent: list[dict[str, Any]] = []
        self.fail = fail

    async def send(self, **kw: Any) -> asyncio.Future[None]:
        if self.fail:
            raise ConnectionError("broker down")
        self.sent.append(kw)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        return fut


async def test_heartbeat_beats_at_once_then_every_interval_and_ends_with_a_tombstone() -> None:
    producer = FakeProducer()
    hb = Heartbeat(
        SETTINGS,
        producer.send,
        in_flight=lambda: 3,
        partitions=lambda: [5, 1, 5],
        host="node-a",
        instance="i-1",
    )
    hb.start()
    await async_wait_until(_at_least(producer, 3), timeout=5, what="three beats")
    await hb.tombstone()
    beats, last = producer.sent[:-1], producer.sent[-1]
    assert len(beats) >= 3
    assert {b["topic"] for b in producer.sent} == {"dev.koda.unit.workers"}
    assert {b["key"] for b in producer.sent} == {b"w-1"}
    body = json.loads(beats[0]["value"])
    assert body | {"beat_at": None} == {
        "worker_id": "w-1",
        "beat_at": None,
        "in_flight": 3,
        "version": SETTINGS.version,
        "partitions": [1, 5],
        "host": "node-a",
        "pid": os.getpid(),
        "instance": "i-1",
    }
    assert {json.loads(b["value"])["instance"] for b in beats} == {"i-1"}
    assert dict(beats[0]["headers"])["schema"] == b"worker.heartbeat/1"
    assert last["value"] is None and last["key"] == b"w-1"
    count = len(producer.sent)
    await asyncio.sleep(SETTINGS.beat_interval_s * 3)  # an absence can only be waited out
    assert len(producer.sent) == count  # nothing after the tombstone


def _at_least(producer: FakeProducer, n: int) -> Any:
    async def enough() -> bool:
        return len(producer.sent) >= n

    return enough


async def test_a_failed_beat_never_raises() -> None:
    hb = Heartbeat(SETTINGS, FakeProducer(fail=True).send, in_flight=lambda: 0, partitions=list)
    await hb.beat()
    await hb.tombstone()


def test_beat_round_trip_and_refusals() -> None:
    beat = Beat("w-1", T0, 2, "1.2.3", (0, 3), "h", pid=42, instance="abc")
    assert decode_beat(b"w-1", beat.encode()) == beat
    older = Beat("w-1", T0, 2, "1.2.3", (0, 3), "h")  # before pid and instance existed
    assert b"pid" not in older.encode() and decode_beat(b"w-1", older.encode()) == older
    assert (beat.who, older.who) == ("h/42", "h")
    assert decode_beat(b"w-1", None) is None
    for key, value in [
        (b"other", beat.encode()),
        (None, beat.encode()),
        (b"w-1", b"{"),
        (b"w-1", b"[]"),
        (b"w-1", b'{"worker_id": "w-1"}'),
    ]:
        with pytest.raises(RecordError):
            decode_beat(key, value)


def test_stale_threshold_must_exceed_the_interval() -> None:
    with pytest.raises(ConfigError, match="KODA_BEAT_STALE_AFTER"):
        Settings.from_env(
            {"APP_ENV": "dev", "KODA_BEAT_INTERVAL": "5", "KODA_BEAT_STALE_AFTER": "5"}
        )


# --- the gateway's table ------------------------------------------------------


def beat(worker_id: str, age_s: float, **kw: Any) -> bytes:
    fields: dict[str, Any] = {"in_flight": 0, "version": "v1", "partitions": (), "host": "h"} | kw
    return Beat(worker_id, T0 - timedelta(seconds=age_s), **fields).encode()


def test_table_status_alive_stale_and_tombstones() -> None:
    table = WorkerTable(stale_after_s=15, forget_after_s=3600)
    table.apply(b"a", beat("a", 1, in_flight=2, partitions=(0, 1)))
    table.apply(b"b", beat("b", 4))
    report = table.report(expected=2, now=T0)
    assert report | {"workers": None} == {
        "status": "ok",
        "expected": 2,
        "alive": 2,
        "stale": 0,
        "conflicts": [],
        "workers": None,
    }
    assert report["workers"][0] == {
        "worker_id": "a",
        "lastBeatMs": 1000,
        "in_flight": 2,
        "version": "v1",
        "partitions": [0, 1],
        "host": "h",
        "pid": None,
        "instance": "",
        "stale": False,
        "conflict": False,
    }
    assert table.report(expected=3, now=T0)["status"] == "degraded"  # fewer than expected
    later = T0 + timedelta(seconds=12)
    report = table.report(expected=2, now=later)  # b's last beat is 16 s old
    assert (report["status"], report["alive"], report["stale"]) == ("degraded", 1, 1)
    assert [w["stale"] for w in report["workers"]] == [False, True]
    table.apply(b"b", None)  # b left gracefully: gone, not stale
    report = table.report(expected=1, now=later)
    assert (report["status"], [w["worker_id"] for w in report["workers"]]) == ("ok", ["a"])


def test_table_skips_invalid_records_and_forgets_long_dead_workers() -> None:
    table = WorkerTable(stale_after_s=15, forget_after_s=600)
    table.apply(b"x", b"not json")
    table.apply(b"old", beat("old", 601))
    table.apply(b"future", beat("future", -3))  # a clock ahead of ours: fresh, age 0
    report = table.report(expected=1, now=T0)
    assert [(w["worker_id"], w["lastBeatMs"]) for w in report["workers"]] == [("future", 0)]
