"""Worker identities of real `koda worker` processes on one host, as `/admin/workers` shows them.

* Without ``KODA_WORKER_ID`` two workers are two ids (the old default, the host name,
  made them one row that hid a frozen twin).
* Two workers forced to one id are reported as a conflict, by both of them and by the
  gateway.
* Static membership without a stable id refuses to start; with a pod name it joins
  the group under that instance id.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import httpx
from confluent_kafka.admin import AdminClient

from koda_runtime.settings import Settings
from tests.fixtures.ops import FAST_BEATS, scrape, value, workers_report
from tests.fixtures.processes import ROOT, GatewayProcess, WorkerProcess, free_port, settings_env
from tests.support import wait_until

STALE_WITHIN_S = 20.0


def pids_of(report: dict[str, Any]) -> dict[int | None, dict[str, Any]]:
    return {w["pid"]: w for w in report["workers"]}


def test_two_workers_without_an_id_are_two_and_a_frozen_one_shows(
    env: Settings, procs: list[Any]
) -> None:
    # Production beat timing (5 s beats, stale after 15 s): "within 20 s" is the promise.
    gateway = GatewayProcess(env, {"KODA_EXPECTED_WORKERS": "2"}).start()
    procs.append(gateway)
    w1 = WorkerProcess(env, None).start()
    procs.append(w1)
    w2 = WorkerProcess(env, None).start()
    procs.append(w2)

    def both_alive() -> dict[str, Any] | None:
        report = workers_report(gateway)
        held = sorted(p for w in report["workers"] for p in w["partitions"])
        ok = (
            report["status"] == "ok"
            and set(pids_of(report)) == {w1.pid, w2.pid}
            and held == list(range(env.partitions))
            and all(w["partitions"] for w in report["workers"])  # both in the group
        )
        return report if ok else None

    report = wait_until(both_alive, timeout=90, interval=0.5, what="two workers alive")
    print("GET /admin/workers, two workers without KODA_WORKER_ID:")
    print(json.dumps(report, indent=2))
    assert (report["alive"], report["stale"], report["conflicts"]) == (2, 0, [])
    host = socket.gethostname()
    ids = {w["worker_id"] for w in report["workers"]}
    assert len(ids) == 2
    for w in (w1, w2):
        row = pids_of(report)[w.pid]
        assert row["host"] == host and row["worker_id"].startswith(f"{host}-{w.pid}-")
        assert row["instance"] and not row["conflict"]

    w2.signal(signal.SIGSTOP)
    stopped = time.monotonic()
    try:

        def one_stale() -> dict[str, Any] | None:
            report = workers_report(gateway)
            return report if report["stale"] == 1 else None

        report = wait_until(one_stale, timeout=STALE_WITHIN_S, interval=0.2, what="w2 stale")
        print(f"stale {time.monotonic() - stopped:.1f} s after SIGSTOP:")
        print(json.dumps(report, indent=2))
        assert (report["status"], report["alive"], report["stale"]) == ("degraded", 1, 1)
        assert pids_of(report)[w2.pid]["stale"] and not pids_of(report)[w1.pid]["stale"]
    finally:
        w2.signal(signal.SIGCONT)
    wait_until(
        lambda: not pids_of(workers_report(gateway))[w2.pid]["stale"],
        timeout=20,
        what="w2 beating again after SIGCONT",
    )


def test_two_workers_forced_to_one_id_are_a_conflict(env: Settings, procs: list[Any]) -> None:
    gateway = GatewayProcess(env, FAST_BEATS).start()
    procs.append(gateway)
    twins = []
    for _ in range(2):
        port = str(free_port())
        w = WorkerProcess(env, "twin", {**FAST_BEATS, "KODA_WORKER_PORT": port}).start()
        procs.append(w)
        twins.append(w)
    a, b = twins

    def conflict() -> dict[str, Any] | None:
        report = workers_report(gateway)
        found = [c for c in report["conflicts"] if c["worker_id"] == "twin"]
        pids = {p["pid"] for c in found for p in c["processes"]}
        return report if pids == {a.pid, b.pid} else None

    report = wait_until(conflict, timeout=90, interval=0.3, what="the conflict reported")
    assert report["status"] == "degraded"
    assert [w["worker_id"] for w in report["workers"]] == ["twin"]
    assert report["workers"][0]["conflict"] is True
    host = socket.gethostname()
    for me, other in ((a, b), (b, a)):
        line = f"host={host} pid={me.pid} other_host={host} other_pid={other.pid}"
        wait_until(lambda: line in me.log(), timeout=20, what=f"{me.pid} logs its twin")  # noqa: B023
        assert "event=worker_id_conflict" in me.log()
        port = me.extra_env["KODA_WORKER_PORT"]
        assert value(scrape(f"http://127.0.0.1:{port}"), "koda_worker_id_twin_beats_total") > 0

    # One twin leaves gracefully: its tombstone ends the conflict, the other beats on alone.
    assert a.stop() == 0

    def resolved() -> bool:
        report = workers_report(gateway)
        rows = report["workers"]
        return report["conflicts"] == [] and [w["pid"] for w in rows] == [b.pid]

    wait_until(resolved, timeout=30, interval=0.3, what="the conflict resolved")
    metrics = httpx.get(f"{gateway.url}/metrics", timeout=5).text
    assert "koda_worker_id_conflicts 0.0" in metrics


def test_static_membership_needs_a_stable_id(env: Settings, procs: list[Any]) -> None:
    refused = subprocess.run(  # noqa: S603
        [sys.executable, "-m", "koda_runtime.cli", "worker"],
        env=settings_env(env, KODA_STATIC_MEMBERSHIP="true"),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert "koda: KODA_STATIC_MEMBERSHIP=true needs a worker id" in refused.stderr
    assert "KODA_WORKER_ID" in refused.stderr and "KODA_POD_NAME" in refused.stderr

    # A pod name is stable and unique: the worker joins as a static member under it.
    pod = WorkerProcess(
        env, None, {"KODA_STATIC_MEMBERSHIP": "true", "KODA_POD_NAME": "koda-worker-0"}
    ).start()
    procs.append(pod)
    admin = AdminClient({"bootstrap.servers": env.kafka_bootstrap})
    group = env.names.group(env.worker_group)

    def instance_ids() -> list[str | None] | None:
        assert pod.alive(), pod.log()[-3000:]
        desc = admin.describe_consumer_groups([group])[group].result(10)
        ids = [m.group_instance_id for m in desc.members]
        return ids or None

    assert wait_until(instance_ids, timeout=60, interval=0.5, what="member joined") == [
        "koda-worker-0"
    ]
