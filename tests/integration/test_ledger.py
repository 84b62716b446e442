"""The ledger written by real workers, and budgets enforced by a real gateway.

One namespace, one worker process and one in-process gateway for the module (the cut
test has its own worker, with a short handoff ceiling, in a namespace of its own).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import httpx
import pytest

from koda_runtime import metrics
from koda_runtime.gateway.app import create_app
from koda_runtime.schemas.migrate import upgrade
from koda_runtime.settings import Settings
from koda_runtime.topics.admin import apply_topics
from koda_runtime.topics.catalogue import RUN_EVENTS
from tests.fixtures.gateway import db_rows, serve_app
from tests.fixtures.ledger import koda, system_call, write_calls
from tests.fixtures.namespaces import delete_topics, drop_schema, make_settings
from tests.fixtures.processes import WorkerProcess
from tests.fixtures.runs import Submitter, read_topic, wait_terminal
from tests.sse_client import bearer
from tests.support import wait_until

MICRO = Decimal(1_000_000)


@pytest.fixture(scope="module")
def worker(module_env: Settings) -> Iterator[WorkerProcess]:
    w = WorkerProcess(module_env, "ledger-w1").start()
    yield w
    w.stop()


@pytest.fixture(scope="module")
def url(worker: WorkerProcess, module_env: Settings) -> Iterator[str]:
    """The module's gateway, with its worker running. Without the cap on active runs: a
    burst of one user's submissions here meets the budget alone."""
    with serve_app(create_app(module_env.with_(max_active_runs_per_user=0))) as base:
        yield base


def ledger_of(settings: Settings, run_id: str) -> list[Any]:
    return db_rows(
        settings,
        "SELECT l.*, p.prompt_usd_per_mtok AS pp, p.completion_usd_per_mtok AS cp"
        " FROM ledger l LEFT JOIN prices p ON p.id = l.price_id"
        " WHERE l.run_id = :r ORDER BY l.attempt, l.call_index",
        r=run_id,
    )


def test_a_run_failing_twice_then_succeeding_bills_three_attempts(
    module_env: Settings, worker: WorkerProcess, module_submitter: Submitter
) -> None:
    inp = {
        "text": "three attempts please",
        "demo": {"tokens": 6, "delay_ms": 1, "fail_attempts": 2},
    }
    run_id = module_submitter.submit("thrice", inp)
    wait_terminal(module_submitter, [run_id], 90, worker)
    assert module_submitter.statuses([run_id]) == {run_id: "done"}
    rows = ledger_of(module_env, run_id)
    got = [(r.attempt, r.call_index, r.outcome, r.estimated, r.completion_tokens) for r in rows]
    # Attempts 1 and 2 failed half-way: billed for the 3 chunks streamed, estimated.
    assert got == [(1, 0, "failed", True, 3), (2, 0, "failed", True, 3), (3, 0, "ok", False, 6)]
    for r in rows:
        assert r.user_id == "thrice" and r.kind == "chat" and r.model == "demo-1"
        assert r.price_id is not None and r.prompt_tokens == 3
        assert r.cost_usd == (r.prompt_tokens * r.pp + r.completion_tokens * r.cp) / MICRO
    (spend,) = db_rows(
        module_env,
        "SELECT spend_usd, calls FROM spend_periods WHERE user_id = 'thrice' AND period = 'month'",
    )
    assert spend.spend_usd == sum((r.cost_usd for r in rows), Decimal(0)) and spend.calls == 3
    # The previous release's table still gets the finishing attempt's call (dual write).
    old = db_rows(module_env, "SELECT cost_usd FROM usage WHERE run_id = :r", r=run_id)
    assert [o.cost_usd for o in old] == [rows[-1].cost_usd]

    # The warehouse's usage events carry every ledger column.
    def usage_events() -> list[dict[str, Any]] | None:
        events = [
            json.loads(m.value())
            for m in read_topic(module_env, module_env.names.topic(RUN_EVENTS))
        ]
        mine = [e for e in events if e["event"] == "usage" and e["run_id"] == run_id]
        return mine if len(mine) == 3 else None

    events = wait_until(usage_events, timeout=30, what="three usage events")
    assert sorted(
        (e["attempt"], e["outcome"], e["estimated"], e["price_id"], Decimal(e["cost_usd"]))
        for e in events
    ) == [(r.attempt, r.outcome, r.estimated, r.price_id, r.cost_usd) for r in rows]
    assert {e["user_id"] for e in events} == {"thrice"} and {e["kind"] for e in events} == {"chat"}


def test_a_run_cut_at_the_handoff_ceiling_is_billed_estimated_and_cancelled(stack) -> None:
    settings = make_settings(stack, handoff_ceiling_s=1.0)
    apply_topics(settings)
    upgrade(settings)
    submitter = Submitter(settings)
    w = WorkerProcess(settings, "ledger-cut").start()
    try:
        run_id = submitter.submit(
            "cut-user", {"text": "hang", "demo": {"tokens": 4, "delay_ms": 1, "hang": True}}
        )
        wait_until(
            lambda: len(submitter.messages(run_id)) >= 4,
            timeout=60,
            what="the run streaming",
        )
        assert w.stop() == 0, w.log()[-3000:]
        rows = ledger_of(settings, run_id)
        assert [(r.attempt, r.outcome, r.estimated, r.completion_tokens) for r in rows] == [
            (1, "cancelled", True, 4)
        ], w.log()[-3000:]
        assert rows[0].cost_usd == 4 * rows[0].cp / MICRO
        (spend,) = db_rows(
            settings,
            "SELECT spend_usd FROM spend_periods WHERE user_id = 'cut-user' AND period = 'day'",
        )
        assert spend.spend_usd == rows[0].cost_usd
    finally:
        w.kill()
        submitter.close()
        delete_topics(settings)
        drop_schema(settings)


def test_a_worker_killed_mid_attempt_has_billed_the_calls_that_reported_usage(stack) -> None:
    """A call is in the ledger once its usage came, not when the attempt ends: kill -9
    mid-run loses none of the calls already reported, and the retry adds its own."""
    settings = make_settings(stack)
    apply_topics(settings)
    upgrade(settings)
    submitter = Submitter(settings)
    w1 = WorkerProcess(settings, "ledger-k1").start()
    w2: WorkerProcess | None = None
    try:
        # One model call per chunk, 100 ms apart: an attempt of ~3 s.
        inp = {"text": "kill me", "demo": {"tokens": 30, "delay_ms": 100, "usage_each": True}}
        run_id = submitter.submit("killed-user", inp)

        def spend() -> tuple[Decimal, int]:
            rows = db_rows(
                settings,
                "SELECT spend_usd, calls FROM spend_periods"
                " WHERE user_id = 'killed-user' AND period = 'month'",
            )
            return (rows[0].spend_usd, rows[0].calls) if rows else (Decimal(0), 0)

        def billed_while_running() -> list[Any] | None:
            rows = ledger_of(settings, run_id)
            running = submitter.statuses([run_id]) == {run_id: "streaming"}
            return rows if len(rows) >= 3 and running else None

        wait_until(
            billed_while_running,
            timeout=60,
            what="the first calls' ledger rows while the attempt still runs",
        )
        w1.kill()
        before = ledger_of(settings, run_id)
        assert [(r.attempt, r.call_index) for r in before] == [(1, i) for i in range(len(before))]
        assert all(r.outcome == "ok" and not r.estimated for r in before), before
        assert all((r.prompt_tokens, r.completion_tokens) == (1, 1) for r in before)
        assert all(r.price_id is not None and r.cost_usd == (r.pp + r.cp) / MICRO for r in before)
        assert spend() == (sum((r.cost_usd for r in before), Decimal(0)), len(before))

        w2 = WorkerProcess(settings, "ledger-k2").start()
        wait_terminal(submitter, [run_id], 90, w2)
        assert submitter.statuses([run_id]) == {run_id: "done"}
        rows = ledger_of(settings, run_id)
        # Attempt 1's rows are as the kill left them; attempt 2 billed all its 30 calls.
        assert [r for r in rows if r.attempt == 1] == before
        assert [(r.attempt, r.call_index, r.outcome, r.estimated) for r in rows[len(before) :]] == [
            (2, i, "ok", False) for i in range(30)
        ]
        assert spend() == (sum((r.cost_usd for r in rows), Decimal(0)), len(rows))

        def usage_events() -> list[tuple[int, int]] | None:
            events = [
                json.loads(m.value())
                for m in read_topic(settings, settings.names.topic(RUN_EVENTS))
            ]
            mine = [
                (e["attempt"], e["call_index"])
                for e in events
                if e["event"] == "usage" and e["run_id"] == run_id
            ]
            return mine if sum(1 for a, _ in mine if a == 2) >= 30 else None

        events = wait_until(usage_events, timeout=30, what="attempt 2's usage events")
        # One event per row written: none twice; attempt 1's may lack those the kill cut.
        assert len(events) == len(set(events))
        assert set(events) <= {(r.attempt, r.call_index) for r in rows}
        assert {(2, i) for i in range(30)} <= set(events)
    finally:
        w1.kill()
        if w2 is not None:
            w2.kill()
        submitter.close()
        delete_topics(settings)
        drop_schema(settings)


def next_month(now: datetime) -> datetime:
    start = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    return (
        start.replace(year=start.year + 1, month=1)
        if start.month == 12
        else start.replace(month=start.month + 1)
    )


def test_50_concurrent_submissions_at_the_edge_overshoot_by_the_admitted_runs_only(
    module_env: Settings, worker: WorkerProcess, url: str, module_submitter: Submitter
) -> None:
    user = "edge-user"
    # 0.01 USD per completion token: a 3-token demo run costs exactly 0.03.
    assert (
        koda(
            module_env, "prices", "set", "demo-1", "--prompt", "0", "--completion", "10000"
        ).exit_code
        == 0
    )
    assert (
        koda(
            module_env, "prices", "set", "seed", "--prompt", "10000", "--completion", "0"
        ).exit_code
        == 0
    )
    write_calls(module_env, [system_call(user, "seed", 999, 0)])  # 9.99 spent
    assert koda(module_env, "budgets", "set", user, "--monthly", "10.00").exit_code == 0

    async def burst(first: int) -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            return await asyncio.gather(
                *(
                    client.post(
                        "/v1/runs",
                        json={"input": {"text": f"edge {i}", "demo": {"tokens": 3, "delay_ms": 1}}},
                        headers={**bearer(user), "Idempotency-Key": f"edge-{i}"},
                    )
                    for i in range(first, first + 50)
                )
            )

    answers = asyncio.run(burst(0))
    assert {r.status_code for r in answers} <= {202, 402}, [r.text for r in answers]
    admitted = [r.json()["run_id"] for r in answers if r.status_code == 202]
    refused = [r.json()["error"] for r in answers if r.status_code == 402]
    assert admitted, "the first submissions were under the budget"
    for err in refused:
        # Refused only once the spend had reached the budget, and it says which and when.
        assert err["code"] == "budget_exceeded" and err["budget"]["period"] == "month"
        assert Decimal(err["budget"]["spend_usd"]) >= Decimal("10")
        assert err["budget"]["limit_usd"] == "10.00000000"
    wait_terminal(module_submitter, admitted, 120, worker)
    # Nothing of a refused submission was written.
    (written,) = db_rows(
        module_env,
        "SELECT (SELECT count(*) FROM runs WHERE user_id = :u) AS runs,"
        " (SELECT count(*) FROM sessions WHERE user_id = :u) AS sessions",
        u=user,
    )
    assert written.runs == len(admitted) and written.sessions == len(admitted)
    (spent,) = db_rows(
        module_env,
        "SELECT (SELECT sum(cost_usd) FROM ledger WHERE user_id = :u) AS ledger,"
        " (SELECT spend_usd FROM spend_periods WHERE user_id = :u AND period = 'month') AS month",
        u=user,
    )
    # The summary row is the ledger's sum exactly, and the overshoot is the admitted runs'.
    assert spent.month == spent.ledger == Decimal("9.99") + Decimal("0.03") * len(admitted)
    assert spent.month - Decimal("10") <= Decimal("0.03") * len(admitted)
    # Once the spend is past the budget, a second burst of 50 is refused whole.
    second = asyncio.run(burst(50))
    assert {r.status_code for r in second} == {402}, [r.text for r in second]
    assert db_rows(module_env, "SELECT count(*) AS n FROM runs WHERE user_id = :u", u=user)[
        0
    ].n == len(admitted)
    late = httpx.post(
        f"{url}/v1/runs", json={"input": "one more"}, headers=bearer(user), timeout=30
    )
    assert late.status_code == 402, late.text
    budget = late.json()["error"]["budget"]
    assert Decimal(budget["spend_usd"]) == spent.month
    assert datetime.fromisoformat(budget["resets_at"]) == next_month(datetime.now(UTC))
    assert "monthly budget" in late.json()["error"]["message"]
    # A replay of an admitted run still answers with that run, over budget or not.
    replay = httpx.post(
        f"{url}/v1/runs",
        json={"input": {"text": "edge 0", "demo": {"tokens": 3, "delay_ms": 1}}},
        headers={**bearer(user), "Idempotency-Key": "edge-0"},
        timeout=30,
    )
    if answers[0].status_code == 202:
        assert replay.status_code == 202 and replay.json()["run_id"] == answers[0].json()["run_id"]
    else:
        assert replay.status_code == 402


def soft_alerts() -> float:
    return (
        metrics.REGISTRY.get_sample_value("koda_budget_soft_alerts_total", {"period": "month"})
        or 0.0
    )


def test_the_soft_threshold_alerts_once_per_user_and_period(
    module_env: Settings, url: str, caplog: pytest.LogCaptureFixture
) -> None:
    user = "soft-user"
    assert (
        koda(
            module_env, "prices", "set", "soft-seed", "--prompt", "10000", "--completion", "0"
        ).exit_code
        == 0
    )
    assert koda(module_env, "budgets", "set", user, "--monthly", "100.00").exit_code == 0
    before = soft_alerts()
    caplog.set_level(logging.WARNING, logger="gateway.admission")
    first = httpx.post(f"{url}/v1/runs", json={"input": "under"}, headers=bearer(user), timeout=30)
    assert first.status_code == 202 and soft_alerts() == before  # nothing spent yet
    write_calls(module_env, [system_call(user, "soft-seed", 8500, 0)])  # 85.00: past 80 %
    for i in range(3):
        resp = httpx.post(
            f"{url}/v1/runs", json={"input": f"over {i}"}, headers=bearer(user), timeout=30
        )
        assert resp.status_code == 202, resp.text
    assert soft_alerts() == before + 1
    lines = [r.getMessage() for r in caplog.records if "budget_soft_threshold" in r.getMessage()]
    assert lines == [f"event=budget_soft_threshold user_id={user} period=month"]


def exhausted_users(url: str) -> float:
    scraped = httpx.get(f"{url}/metrics", timeout=30).text
    (line,) = [x for x in scraped.splitlines() if x.startswith("koda_budget_exhausted_users ")]
    return float(line.split()[1])


def test_the_gateway_counts_the_users_whose_budget_is_spent_at_each_scrape(
    module_env: Settings, url: str
) -> None:
    # The gauge of the KodaBudgetExhausted alert: users refused now, not refusals so far.
    assert (
        koda(
            module_env, "prices", "set", "gauge-seed", "--prompt", "10000", "--completion", "0"
        ).exit_code
        == 0
    )
    before = exhausted_users(url)
    for user, budget in (("gauge-m", "--monthly"), ("gauge-d", "--daily"), ("gauge-ok", None)):
        write_calls(module_env, [system_call(user, "gauge-seed", 100, 0)])  # 1.00 spent
        limit = ["--monthly", "5.00"] if budget is None else [budget, "1.00"]
        assert koda(module_env, "budgets", "set", user, *limit).exit_code == 0
    assert exhausted_users(url) == before + 2  # the monthly and the daily one, at the limit
    assert koda(module_env, "budgets", "set", "gauge-m", "--monthly", "2.00").exit_code == 0
    assert exhausted_users(url) == before + 1  # a raised budget is no longer spent
