"""Heartbeats, probes and metrics of real `koda gateway` and `koda worker` processes."""

from __future__ import annotations

import signal

import httpx

from koda_runtime.topics.catalogue import RUNS
from tests.fixtures.ops import (
    FAST_BEATS,
    Samples,
    by_id,
    scrape,
    start_worker,
    status,
    value,
    worker_url,
    workers_report,
)
from tests.fixtures.processes import GatewayProcess
from tests.fixtures.runs import Submitter
from tests.support import wait_until


def test_a_frozen_worker_goes_stale_a_stopped_one_disappears(env, procs) -> None:
    gateway = GatewayProcess(env, {**FAST_BEATS, "KODA_EXPECTED_WORKERS": "2"}).start()
    procs.append(gateway)
    w1 = start_worker(env, procs, "ops-w1")
    w2 = start_worker(env, procs, "ops-w2")

    def both_in_and_ready() -> bool:
        report = workers_report(gateway)
        held = [p for w in report["workers"] for p in w["partitions"]]
        return (
            report["status"] == "ok"
            and set(by_id(report)) == {"ops-w1", "ops-w2"}
            and sorted(held) == list(range(env.partitions))
            and status(f"{worker_url(w1)}/readyz") == 200
            and status(f"{worker_url(w2)}/readyz") == 200
        )

    wait_until(both_in_and_ready, timeout=60, interval=0.2, what="two workers alive and ready")
    row = by_id(workers_report(gateway))["ops-w1"]
    assert row["version"] and row["host"] and row["stale"] is False and row["lastBeatMs"] < 1500

    # SIGTERM: the worker drains, leaves and tombstones. It never shows as stale.
    w2.signal(signal.SIGTERM)
    seen_stale = False

    def w2_gone() -> bool:
        nonlocal seen_stale
        rows = by_id(workers_report(gateway))
        seen_stale |= rows.get("ops-w2", {}).get("stale", False)
        return "ops-w2" not in rows

    wait_until(w2_gone, timeout=30, interval=0.1, what="ops-w2 deregistered")
    assert w2.proc is not None and w2.proc.wait(30) == 0
    assert not seen_stale
    report = workers_report(gateway)
    assert (report["status"], report["alive"], report["stale"]) == ("degraded", 1, 0)

    # SIGSTOP: alive as a process, silent as a worker. Stale after the threshold; the
    # gateway's readiness never depends on it.
    w1.signal(signal.SIGSTOP)
    readiness: list[int] = []

    def w1_stale() -> bool:
        readiness.append(status(f"{gateway.url}/readyz"))
        return bool(by_id(workers_report(gateway))["ops-w1"]["stale"])

    wait_until(w1_stale, timeout=15, interval=0.2, what="ops-w1 stale")
    report = workers_report(gateway)
    assert (report["status"], report["alive"], report["stale"]) == ("degraded", 0, 1)
    assert by_id(report)["ops-w1"]["lastBeatMs"] > 1500
    readiness.append(status(f"{gateway.url}/readyz"))
    assert set(readiness) == {200}
    w1.signal(signal.SIGCONT)
    wait_until(
        lambda: not by_id(workers_report(gateway))["ops-w1"]["stale"],
        timeout=15,
        what="ops-w1 beating again",
    )
    assert w1.stop() == 0


def test_gateway_and_worker_metrics_move_with_traffic(env, procs) -> None:
    gateway = GatewayProcess(env, FAST_BEATS).start()
    procs.append(gateway)
    w = start_worker(env, procs, "metrics-w1")
    wait_until(
        lambda: status(f"{worker_url(w)}/readyz") == 200, timeout=60, what="worker joined the group"
    )
    assert status(f"{worker_url(w)}/livez") == 200
    live = httpx.get(f"{worker_url(w)}/livez", timeout=2).json()
    assert live["status"] == "ok" and live["loop_lag_s"] < 1
    gw0, w0 = scrape(gateway.url), scrape(worker_url(w))

    auth = {"Authorization": "Bearer dev:metrics-user"}
    run_ids = []
    for i in range(3):
        r = httpx.post(
            f"{gateway.url}/v1/runs",
            headers=auth,
            timeout=10,
            json={"input": {"text": f"m{i}", "demo": {"tokens": 3, "delay_ms": 1}}},
        )
        assert r.status_code == 202, r.text
        run_ids.append(r.json()["run_id"])
    assert httpx.post(f"{gateway.url}/v1/runs", json={"input": "x"}).status_code == 401
    sub = Submitter(env)
    try:
        sub.produce_raw(b"metrics-user", b"\xff not json")  # a poison record: dead letter
        wait_until(lambda: sub.all_terminal(run_ids), timeout=60, what="runs done")
    finally:
        sub.close()

    def worker_counted() -> Samples | None:
        s = scrape(worker_url(w))
        moved = (
            value(s, "koda_runs_total", outcome="done")
            - value(w0, "koda_runs_total", outcome="done")
            == 3
            and value(s, "koda_dead_letters_total", reason="undecodable") == 1
        )
        return s if moved else None

    w1 = wait_until(worker_counted, timeout=20, what="worker counters moved")
    for name in ("koda_queue_age_seconds_count", "koda_time_to_first_chunk_seconds_count"):
        assert value(w1, name) - value(w0, name) == 3, name
    assert (
        value(w1, "koda_run_duration_seconds_count", outcome="done")
        - value(w0, "koda_run_duration_seconds_count", outcome="done")
        == 3
    )
    assert value(w1, "koda_rebalances_total", event="assigned") >= 1
    assert value(w1, "koda_heartbeats_total", outcome="sent") > value(
        w0, "koda_heartbeats_total", outcome="sent"
    )
    runs_topic = env.names.topic(RUNS)

    def lag_drained() -> bool:
        s = scrape(worker_url(w))
        lags = {
            dict(labels)["partition"]: v
            for (name, labels), v in s.items()
            if name == "koda_consumer_lag" and dict(labels)["topic"] == runs_topic
        }
        return len(lags) == env.partitions and all(v == 0 for v in lags.values())

    wait_until(lag_drained, timeout=20, what="lag of every held partition back to 0")

    gw1 = scrape(gateway.url)
    assert (
        value(gw1, "koda_admissions_total", outcome="created")
        - value(gw0, "koda_admissions_total", outcome="created")
        == 3
    )
    assert (
        value(gw1, "koda_publish_total", outcome="delivered")
        - value(gw0, "koda_publish_total", outcome="delivered")
        >= 3
    )
    assert (
        value(gw1, "koda_admissions_rejected_total", reason="unauthorized")
        - value(gw0, "koda_admissions_rejected_total", reason="unauthorized")
        == 1
    )
    posts = value(gw1, "koda_http_requests_total", method="POST", route="/v1/runs", status="202")
    assert (
        posts
        - value(gw0, "koda_http_requests_total", method="POST", route="/v1/runs", status="202")
        == 3
    )
    assert value(gw1, "koda_workers", state="alive") == 1
