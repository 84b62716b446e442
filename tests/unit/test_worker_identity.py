"""Worker identity without services: the default id, static membership, twin detection."""

from __future__ import annotations

import logging
import os
import re
import socket
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from koda_runtime.errors import ConfigError
from koda_runtime.gateway.workers import MAX_INSTANCES, WorkerTable
from koda_runtime.kafka import runs_consumer_config
from koda_runtime.naming import AppEnv
from koda_runtime.processors.heartbeat import Heartbeat
from koda_runtime.processors.twins import RELOG_S, TwinWatch
from koda_runtime.settings import Settings
from koda_runtime.topics.records.heartbeats import Beat

T0 = datetime(2025, 1, 1, tzinfo=UTC)
DEV = {"APP_ENV": "dev"}


# --- the id --------------------------------------------------------------------


def test_the_default_id_is_host_pid_and_a_suffix_stable_for_the_process() -> None:
    first = Settings.from_env(DEV)
    assert first.worker_id_source == "generated"
    host, pid = socket.gethostname(), os.getpid()
    assert re.fullmatch(rf"{re.escape(host)}-{pid}-[0-9a-f]{{6}}", first.worker_id)
    assert Settings.from_env(DEV).worker_id == first.worker_id  # the same all its life
    assert Settings(app_env=AppEnv.DEV).worker_id == first.worker_id
    code = "from koda_runtime.settings import generated_worker_id as g; print(g())"
    others = {
        subprocess.run(  # noqa: S603
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout.strip()
        for _ in range(2)
    }
    assert len(others) == 2 and first.worker_id not in others  # one id per process


def test_a_configured_id_wins_then_the_pod_name() -> None:
    both = Settings.from_env(DEV | {"KODA_WORKER_ID": "w-7", "KODA_POD_NAME": "koda-worker-0"})
    assert (both.worker_id, both.worker_id_source) == ("w-7", "configured")
    pod = Settings.from_env(DEV | {"KODA_POD_NAME": "koda-worker-0"})
    assert (pod.worker_id, pod.worker_id_source) == ("koda-worker-0", "pod")


@pytest.mark.parametrize(
    ("key", "raw"), [("KODA_WORKER_ID", "two words"), ("KODA_POD_NAME", "x" * 201)]
)
def test_an_unusable_id_is_refused_naming_the_setting(key: str, raw: str) -> None:
    with pytest.raises(ConfigError, match=key):
        Settings.from_env(DEV | {key: raw})


# --- static membership -----------------------------------------------------------


def test_static_membership_without_a_stable_id_is_refused_and_says_why() -> None:
    settings = Settings.from_env(DEV | {"KODA_STATIC_MEMBERSHIP": "true"})
    with pytest.raises(ConfigError) as err:
        settings.group_instance_id()
    message = str(err.value)
    for words in ("KODA_STATIC_MEMBERSHIP", "KODA_WORKER_ID", "KODA_POD_NAME", "restart"):
        assert words in message
    with pytest.raises(ConfigError):
        runs_consumer_config(settings, "g")


def test_static_membership_uses_the_configured_id_or_the_pod_name() -> None:
    off = Settings.from_env(DEV | {"KODA_WORKER_ID": "w-1"})
    assert "group.instance.id" not in runs_consumer_config(off, "g")
    for env, expected in (
        ({"KODA_WORKER_ID": "w-1"}, "w-1"),
        ({"KODA_POD_NAME": "koda-worker-2"}, "koda-worker-2"),
    ):
        settings = Settings.from_env(DEV | env | {"KODA_STATIC_MEMBERSHIP": "true"})
        assert runs_consumer_config(settings, "g")["group.instance.id"] == expected
    bad = Settings.from_env(DEV | {"KODA_WORKER_ID": "w:1", "KODA_STATIC_MEMBERSHIP": "1"})
    with pytest.raises(ConfigError, match="KODA_WORKER_ID='w:1' cannot be a Kafka group"):
        bad.group_instance_id()


# --- the gateway's table: two processes, one id -----------------------------------


def beat(instance: str, pid: int, age_s: float = 1.0, host: str = "vm") -> bytes:
    at = T0 - timedelta(seconds=age_s)
    return Beat("w", at, 0, "v1", (), host, pid, instance).encode()


def conflicts(table: WorkerTable, now: datetime = T0) -> list[list[tuple[str, int | None]]]:
    return [
        [(p["host"], p["pid"]) for p in c["processes"]]
        for c in table.report(expected=1, now=now)["conflicts"]
    ]


def test_interleaved_beats_of_two_processes_are_a_conflict(caplog: Any) -> None:
    table = WorkerTable(stale_after_s=15, forget_after_s=600)
    table.apply(b"w", beat("a", 10))
    table.apply(b"w", beat("b", 20, host="vm2"))
    assert conflicts(table) == []  # so far b could be a's successor
    with caplog.at_level(logging.ERROR, logger="gateway.workers"):
        table.apply(b"w", beat("a", 10))
    assert conflicts(table) == [[("vm", 10), ("vm2", 20)]]
    report = table.report(expected=1, now=T0)
    assert (report["status"], report["alive"], report["stale"]) == ("degraded", 1, 0)
    assert report["workers"][0]["conflict"] is True
    assert [r.getMessage() for r in caplog.records if "worker_id_conflict" in r.getMessage()]
    assert "vm/10,vm2/20" in caplog.text
    table.apply(b"w", None)  # a tombstone ends the id, conflict and all
    assert table.report(expected=0, now=T0) | {"workers": []} == {
        "status": "ok",
        "expected": 0,
        "alive": 0,
        "stale": 0,
        "conflicts": [],
        "workers": [],
    }


def test_a_restart_under_a_stable_id_is_no_conflict_until_the_old_one_beats_again() -> None:
    table = WorkerTable(stale_after_s=15, forget_after_s=600)
    for _ in range(3):
        table.apply(b"w", beat("old", 10, age_s=30))
    for _ in range(3):
        table.apply(b"w", beat("new", 11))
    report = table.report(expected=1, now=T0)
    assert (report["status"], report["workers"][0]["pid"]) == ("ok", 11)
    table.apply(b"w", beat("old", 10))  # it was frozen, not gone
    assert conflicts(table) == [[("vm", 10), ("vm", 11)]]


def test_reading_a_record_again_changes_nothing() -> None:
    table = WorkerTable(stale_after_s=15)
    table.apply(b"w", beat("old", 10), offset=0)
    table.apply(b"w", beat("new", 11), offset=1)
    table.apply(b"w", beat("old", 10), offset=0)  # a reader that re-read from the start
    assert conflicts(table) == []


def test_a_twin_forgotten_after_the_forget_delay_ends_the_conflict() -> None:
    table = WorkerTable(stale_after_s=15, forget_after_s=600)
    table.apply(b"w", beat("a", 10, age_s=700))
    table.apply(b"w", beat("b", 20, age_s=699))
    table.apply(b"w", beat("a", 10, age_s=698))
    table.apply(b"w", beat("b", 20, age_s=1))
    stale_twin = table.report(expected=1, now=T0 - timedelta(seconds=100))["conflicts"]
    assert [p["stale"] for p in stale_twin[0]["processes"]] == [True, False]
    assert conflicts(table) == []  # a's last beat is 698 s old: forgotten


def test_a_crash_looping_worker_keeps_a_bounded_number_of_instances() -> None:
    table = WorkerTable(stale_after_s=15)
    for i in range(MAX_INSTANCES * 3):
        table.apply(b"w", beat(f"i{i}", i))
    assert conflicts(table) == []
    assert len(table._workers["w"]) == MAX_INSTANCES


# --- the worker's own watch ----------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_worker_logs_beats_under_its_id_that_it_did_not_send(caplog: Any) -> None:
    settings = Settings(app_env=AppEnv.DEV, namespace="unit", worker_id="w")
    hb = Heartbeat(settings, _no_send, in_flight=lambda: 0, partitions=list, host="vm")
    clock = Clock()
    watch = TwinWatch(settings, hb, clock=clock)
    with caplog.at_level(logging.ERROR, logger="koda.worker"):
        watch.apply(b"w", hb.current().encode(), 0)  # its own
        watch.apply(b"other", beat("x", 99), 1)  # another worker's
        watch.apply(b"w", None, 2)  # a tombstone says nothing about who wrote it
        assert caplog.records == [] and watch.twins == {}
        watch.apply(b"w", beat("twin", 4321, host="vm2"), 3)
        watch.apply(b"w", beat("twin", 4321, host="vm2"), 4)  # logged once a minute
        clock.now += RELOG_S
        watch.apply(b"w", beat("twin", 4321, host="vm2"), 5)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2, messages
    assert f"host=vm pid={os.getpid()} other_host=vm2 other_pid=4321" in messages[0]
    assert "KODA_WORKER_ID" in messages[0]
    assert set(watch.twins) == {"twin"}


async def _no_send(**kw: Any) -> Any:
    raise AssertionError("nothing is sent here")
