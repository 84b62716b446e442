"""The ledger's money against the real PostgreSQL: prices, reports, budgets API, bad input.

One namespace and one in-process gateway for the module. Ledger rows are written with
the same statement the workers use (koda_runtime.schemas.ledger.insert_calls); report figures are
checked against SQL written here, independently of the report's own.
"""

from __future__ import annotations

import json
import random
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import httpx
import pytest

from koda_runtime.gateway.app import create_app
from koda_runtime.lifecycle.handler import Usage
from koda_runtime.lifecycle.ledger import LedgerCall, Outcome
from koda_runtime.schemas.migrate import upgrade
from koda_runtime.settings import Settings
from tests.fixtures.gateway import db_rows, serve_app
from tests.fixtures.ledger import koda, system_call, write_calls
from tests.fixtures.namespaces import drop_schema, make_settings
from tests.sse_client import bearer
from tests.support import wait_until


def test_a_price_change_leaves_earlier_costs_unchanged(module_env: Settings) -> None:
    first = koda(module_env, "prices", "set", "noon-model", "--prompt", "1.5", "--completion", "6")
    assert first.exit_code == 0, first.output
    morning = write_calls(module_env, [system_call("p-user", "noon-model", 1000, 2000)])
    # 1000 x 1.5 / 1e6 + 2000 x 6 / 1e6
    assert morning[0].cost_usd == Decimal("0.0135")
    noon = datetime.now(UTC) + timedelta(seconds=2)
    second = koda(
        module_env,
        "prices",
        "set",
        "noon-model",
        "--prompt",
        "10",
        "--completion",
        "20",
        "--from",
        noon.isoformat(),
    )
    assert second.exit_code == 0, second.output
    # Until noon the morning price still applies.
    before = write_calls(module_env, [system_call("p-user", "noon-model", 1000, 2000)])
    assert before[0].cost_usd == Decimal("0.0135")
    wait_until(
        lambda: datetime.now(UTC) > noon + timedelta(seconds=0.2),
        timeout=10,
        what="the new price's time",
    )
    after = write_calls(module_env, [system_call("p-user", "noon-model", 1000, 2000)])
    assert after[0].cost_usd == Decimal("0.05")
    assert after[0].price_id != morning[0].price_id
    rows = db_rows(
        module_env,
        "SELECT l.cost_usd, l.price_id, p.effective_from FROM ledger l"
        " JOIN prices p ON p.id = l.price_id WHERE l.model = 'noon-model' ORDER BY l.id",
    )
    assert [r.cost_usd for r in rows] == [Decimal("0.0135"), Decimal("0.0135"), Decimal("0.05")]
    assert rows[0].price_id == rows[1].price_id == morning[0].price_id
    # History is never rewritten: a price for a past time is refused, nothing written.
    past = koda(
        module_env,
        "prices",
        "set",
        "noon-model",
        "--prompt",
        "0",
        "--completion",
        "0",
        "--from",
        "2020-01-01T00:00:00Z",
    )
    assert past.exit_code == 2 and "in the past" in past.output, past.output
    listed = koda(module_env, "prices", "list", "--model", "noon-model", "--format", "json")
    assert listed.exit_code == 0, listed.output
    prices = json.loads(listed.stdout)["prices"]
    assert [p["prompt_usd_per_mtok"] for p in prices] == ["1.50000000", "10.00000000"]
    # A model without a price is written at 0 with no price id: visible, not hidden.
    (unpriced,) = write_calls(module_env, [system_call("p-user", "no-price-model", 5, 5)])
    assert unpriced.cost_usd == 0 and unpriced.price_id is None


def test_a_call_written_twice_counts_once(module_env: Settings) -> None:
    (run,) = db_rows(
        module_env,
        "WITH s AS (INSERT INTO sessions (id, user_id) VALUES ('s-twice', 'twice') RETURNING id)"
        " INSERT INTO runs (id, session_id, user_id, idempotency_key, input)"
        " SELECT 'run-twice', id, 'twice', 'k-twice', '{}'::jsonb FROM s RETURNING id",
    )
    calls = [
        LedgerCall("twice", run.id, 1, i, Usage("demo-1", 10, 20), Outcome.OK) for i in range(3)
    ]
    assert len(write_calls(module_env, calls)) == 3
    assert write_calls(module_env, calls) == []  # a redelivered finish, a retried group
    (row,) = db_rows(
        module_env,
        "SELECT (SELECT count(*) FROM ledger WHERE user_id = 'twice') AS n,"
        " (SELECT sum(cost_usd) FROM ledger WHERE user_id = 'twice') AS cost,"
        " (SELECT spend_usd FROM spend_periods WHERE user_id = 'twice' AND period = 'month')"
        " AS month, (SELECT calls FROM spend_periods WHERE user_id = 'twice'"
        " AND period = 'day') AS day_calls",
    )
    assert row.n == 3 and row.month == row.cost and row.day_calls == 3


def independent(settings: Settings, key: str, where: str = "") -> dict[str, dict[str, Any]]:
    rows = db_rows(
        settings,
        f"SELECT {key} AS k, sum(cost_usd) AS cost, sum(prompt_tokens) AS pt,"  # noqa: S608
        " sum(completion_tokens) AS ct, count(*) AS calls, count(DISTINCT run_id) AS runs,"
        " sum(CASE WHEN outcome <> 'ok' THEN cost_usd ELSE 0 END) AS wasted"
        f" FROM ledger {where} GROUP BY {key}",
    )
    return {str(r.k): r._asdict() for r in rows}


def test_100k_ledger_rows_sum_to_the_report_total_exactly(module_env: Settings, client) -> None:
    for model, p, c in (("m-small", "0.15", "0.6"), ("m-large", "2.5", "10"), ("e-1", "0.02", "0")):
        assert (
            koda(module_env, "prices", "set", model, "--prompt", p, "--completion", c).exit_code
            == 0
        )
    rng = random.Random(14)
    users = [f"bulk-{i}" for i in range(37)]
    batch: list[LedgerCall] = []
    written = 0
    for i in range(100_000):
        kind = "embedding" if i % 5 == 0 else "chat"
        model = "e-1" if kind == "embedding" else rng.choice(("m-small", "m-large"))
        outcome = rng.choice(
            (Outcome.OK, Outcome.OK, Outcome.OK, Outcome.FAILED, Outcome.CANCELLED)
        )
        usage = Usage(
            model,
            rng.randrange(1, 9000),
            0 if kind == "embedding" else rng.randrange(0, 3000),
            kind=kind,
            estimated=outcome is Outcome.CANCELLED,
        )
        batch.append(LedgerCall(rng.choice(users), None, 0, 0, usage, outcome))
        if len(batch) == 20_000:
            written += len(write_calls(module_env, batch))
            batch = []
    assert written == 100_000
    bulk = "WHERE user_id LIKE 'bulk-%'"
    (truth,) = db_rows(module_env, f"SELECT sum(cost_usd) AS s, count(*) AS n FROM ledger {bulk}")  # noqa: S608
    rows = db_rows(module_env, f"SELECT cost_usd FROM ledger {bulk}")  # noqa: S608
    assert sum((r.cost_usd for r in rows), Decimal(0)) == truth.s
    # The budget summary rows are the ledger's sum exactly, kept by the writes themselves.
    (spend,) = db_rows(
        module_env,
        "SELECT sum(spend_usd) AS s, sum(calls) AS n FROM spend_periods"
        " WHERE user_id LIKE 'bulk-%' AND period = 'month'",
    )
    assert spend.s == truth.s and spend.n == 100_000

    admin = client.get("/admin/usage", params={"group_by": "user"})
    assert admin.status_code == 200, admin.text
    report = admin.json()
    by_user = {r["user_id"]: r for r in report["rows"] if r["user_id"].startswith("bulk-")}
    assert sum(Decimal(r["cost_usd"]) for r in by_user.values()) == truth.s
    expected = independent(module_env, "user_id", bulk)
    assert set(by_user) == set(expected)
    for user, row in by_user.items():
        want = expected[user]
        assert Decimal(row["cost_usd"]) == want["cost"]
        assert row["prompt_tokens"] == want["pt"] and row["completion_tokens"] == want["ct"]
        assert row["calls"] == want["calls"] and row["runs"] == want["runs"]
        share = (want["wasted"] / want["cost"]).quantize(Decimal("0.0001"))
        assert Decimal(row["failed_or_cancelled_share"]) == share
    # The whole table's total, every grouping: equal to the independent sums.
    (whole,) = db_rows(module_env, "SELECT sum(cost_usd) AS s, count(*) AS n FROM ledger")
    for group, key in (
        ("day", "to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD')"),
        ("model", "model"),
        ("kind", "kind"),
    ):
        got = client.get("/admin/usage", params={"group_by": group}).json()
        assert Decimal(got["totals"]["cost_usd"]) == whole.s
        assert got["totals"]["calls"] == whole.n
        name = {"day": "day"}.get(group, group)
        want_rows = independent(module_env, key)
        assert {r[name]: Decimal(r["cost_usd"]) for r in got["rows"]} == {
            k: v["cost"] for k, v in want_rows.items()
        }
    # Money is a decimal string everywhere, never a JSON number.
    assert isinstance(report["totals"]["cost_usd"], str)
    assert isinstance(report["totals"]["cost_per_run_usd"], str | None)
    # The CLI prints the same report.
    out = koda(module_env, "usage", "report", "--by", "kind", "--format", "json")
    assert out.exit_code == 0, out.output
    assert Decimal(json.loads(out.stdout)["totals"]["cost_usd"]) == whole.s
    csv_out = koda(module_env, "usage", "report", "--by", "model", "--format", "csv")
    assert csv_out.exit_code == 0 and csv_out.stdout.splitlines()[0].startswith("model,cost_usd")
    table = koda(module_env, "usage", "report", "--by", "user", "--user", "bulk-3")
    assert table.exit_code == 0 and "bulk-3" in table.stdout and "TOTAL" in table.stdout


def test_v1_usage_shows_only_the_callers_own_calls(module_env: Settings, client) -> None:
    write_calls(
        module_env,
        [
            system_call("own-a", "m-small", 100, 100),
            system_call("own-a", "e-1", 100, 0, kind="embedding"),
            system_call("own-b", "m-small", 100, 100),
        ],
    )
    resp = client.get("/v1/usage", params={"group_by": "kind"}, headers=bearer("own-a"))
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert {r["kind"]: r["calls"] for r in body["rows"]} == {"chat": 1, "embedding": 1}
    (want,) = db_rows(module_env, "SELECT sum(cost_usd) AS s FROM ledger WHERE user_id = 'own-a'")
    assert Decimal(body["totals"]["cost_usd"]) == want.s
    today = datetime.now(UTC).date()
    window = {
        "group_by": "day",
        "from": today.isoformat(),
        "to": (today + timedelta(days=1)).isoformat(),
    }
    by_day = client.get("/v1/usage", params=window, headers=bearer("own-a")).json()
    assert [r["day"] for r in by_day["rows"]] == [today.isoformat()]
    empty = client.get(
        "/v1/usage", params={"group_by": "day", "to": "2000-01-01"}, headers=bearer("own-a")
    ).json()
    assert empty["rows"] == [] and empty["totals"]["calls"] == 0
    assert empty["totals"]["cost_usd"] == "0.00000000"


@pytest.mark.parametrize(
    ("path", "params", "field"),
    [
        ("/v1/usage", {}, "group_by"),
        ("/v1/usage", {"group_by": "user"}, "group_by"),
        ("/v1/usage", {"group_by": "day", "from": "yesterday"}, "from"),
        ("/v1/usage", {"group_by": "day", "to": "2026-13-01"}, "to"),
        ("/v1/usage", {"group_by": "day", "from": "2026-02-01", "to": "2026-01-01"}, "from"),
        ("/v1/usage", {"group_by": "day", "colour": "red"}, "colour"),
        ("/v1/usage", {"group_by": "day", "user_id": "someone-else"}, "user_id"),
        ("/admin/usage", {"group_by": "week"}, "group_by"),
        ("/admin/usage", {"group_by": "user", "from": "2026-01-01T25:00"}, "from"),
    ],
)
def test_bad_report_parameters_are_named(client, path: str, params: dict, field: str) -> None:
    resp = client.get(path, params=params, headers=bearer("bad-input"))
    assert resp.status_code == 422, resp.text
    assert resp.json()["error"]["field"] == field


def test_v1_usage_needs_a_token(client) -> None:
    assert client.get("/v1/usage", params={"group_by": "day"}).status_code == 401


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"monthly_usd": "-1"}, "monthly_usd"),
        ({"monthly_usd": "ten"}, "monthly_usd"),
        ({"monthly_usd": "1.000000001"}, "monthly_usd"),
        ({"monthly_usd": True}, "monthly_usd"),
        ({"daily_usd": "NaN"}, "daily_usd"),
        ({}, "monthly_usd"),
        ({"monthly_usd": "5", "soft_ratio": "1.5"}, "soft_ratio"),
        ({"monthly_usd": "5", "soft_ratio": 0}, "soft_ratio"),
        ({"monthly_usd": "5", "weekly_usd": "1"}, "weekly_usd"),
    ],
)
def test_bad_budget_bodies_are_named_and_write_nothing(
    module_env: Settings, client, body: dict, field: str
) -> None:
    resp = client.put("/admin/budgets/bad-budget", json=body)
    assert resp.status_code == 422, resp.text
    assert resp.json()["error"]["field"] == field
    assert db_rows(module_env, "SELECT 1 FROM budgets WHERE user_id = 'bad-budget'") == []


def test_budget_api_round_trip(module_env: Settings, client) -> None:
    bad = client.put(
        "/admin/budgets/api-user",
        content=b"{not json",
        headers={"Content-Type": "application/json"},
    )
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json"
    assert client.put("/admin/budgets/api-user", content=b"x").status_code == 415
    # A JSON number is read as a decimal, never through a float.
    put = client.put(
        "/admin/budgets/api-user",
        content=b'{"monthly_usd": 20.10, "daily_usd": "1.5"}',
        headers={"Content-Type": "application/json"},
    )
    assert put.status_code == 200, put.text
    assert put.json()["monthly_usd"] == "20.10000000" and put.json()["daily_usd"] == "1.50000000"
    listed = client.get("/admin/budgets").json()["budgets"]
    assert [b["user_id"] for b in listed if b["user_id"] == "api-user"] == ["api-user"]
    assert client.delete("/admin/budgets/api-user").status_code == 200
    assert client.delete("/admin/budgets/api-user").status_code == 404


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["prices", "set", "m", "--prompt", "abc", "--completion", "1"], "--prompt"),
        (["prices", "set", "m", "--prompt", "-1", "--completion", "1"], "--prompt"),
        (["prices", "set", "m", "--prompt", "1", "--completion", "1", "--from", "soon"], "--from"),
        (["prices", "set", " m", "--prompt", "1", "--completion", "1"], "MODEL"),
        (["prices", "list", "--format", "xml"], "--format"),
        (["budgets", "set", "u"], "--monthly"),
        (["budgets", "set", "u", "--monthly", "20,00"], "--monthly"),
        (["budgets", "set", "u", "--monthly", "20", "--soft", "0"], "--soft"),
        (["usage", "report", "--by", "week"], "--by"),
        (["usage", "report", "--by", "day", "--format", "pdf"], "--format"),
        (["usage", "report", "--by", "day", "--from", "monday"], "--from"),
        (
            ["usage", "report", "--by", "day", "--from", "2026-02-01", "--to", "2026-01-01"],
            "before",
        ),
    ],
)
def test_bad_command_input_is_one_line_and_writes_nothing(
    module_env: Settings, args: list[str], message: str
) -> None:
    before = db_rows(
        module_env, "SELECT (SELECT count(*) FROM prices), (SELECT count(*) FROM budgets)"
    )
    result = koda(module_env, *args)
    assert result.exit_code == 2, result.output
    assert message in result.output and result.output.startswith("koda: ")
    assert len(result.output.strip().splitlines()) == 1
    assert (
        db_rows(module_env, "SELECT (SELECT count(*) FROM prices), (SELECT count(*) FROM budgets)")
        == before
    )


def test_budgets_set_and_list(module_env: Settings) -> None:
    out = koda(module_env, "budgets", "set", "cli-user", "--monthly", "20.00", "--daily", "2")
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout)["monthly_usd"] == "20.00000000"
    listed = koda(module_env, "budgets", "list", "--format", "json")
    assert any(b["user_id"] == "cli-user" for b in json.loads(listed.stdout)["budgets"])
    assert "cli-user" in koda(module_env, "budgets", "list").stdout


def test_the_migration_copies_existing_usage_rows_into_the_ledger(stack) -> None:
    settings = make_settings(stack)
    try:
        upgrade(settings, "0003")
        db_rows(
            settings,
            "INSERT INTO sessions (id, user_id) VALUES ('s-old', 'old-user');"
            " INSERT INTO runs (id, session_id, user_id, idempotency_key, input, status, attempt)"
            " VALUES ('run-old', 's-old', 'old-user', 'k-old', '{}', 'done', 2);"
            " INSERT INTO usage (run_id, call_index, model, prompt_tokens, completion_tokens,"
            " cost_usd) VALUES ('run-old', 0, 'demo-1', 100, 200, 0.000135)",
        )
        upgrade(settings)
        (row,) = db_rows(
            settings,
            "SELECT l.user_id, l.attempt, l.outcome, l.cost_usd, l.price_id, p.model AS priced"
            " FROM ledger l LEFT JOIN prices p ON p.id = l.price_id",
        )
        assert (row.user_id, row.attempt, row.outcome) == ("old-user", 2, "ok")
        assert row.cost_usd == Decimal("0.000135") and row.priced == "demo-1"
        (spend,) = db_rows(settings, "SELECT spend_usd FROM spend_periods WHERE period = 'month'")
        assert spend.spend_usd == Decimal("0.000135")
        # The previous release's insert (no id, no ledger columns) still works.
        db_rows(
            settings,
            "INSERT INTO prices (model, effective_from, prompt_usd_per_mtok,"
            " completion_usd_per_mtok) VALUES ('old-way', now(), 1, 1)",
        )
        assert db_rows(settings, "SELECT id FROM prices WHERE model = 'old-way'")[0].id > 0
    finally:
        drop_schema(settings)


def test_admin_usage_and_budgets_need_the_admin_token_when_one_is_set(module_env: Settings) -> None:
    with serve_app(create_app(module_env.with_(admin_token="s3cret-admin"))) as base:
        with httpx.Client(base_url=base, timeout=30) as c:
            for method, path in (
                ("GET", "/admin/usage?group_by=user"),
                ("GET", "/admin/budgets"),
                ("PUT", "/admin/budgets/someone"),
                ("DELETE", "/admin/budgets/someone"),
            ):
                # A user token never opens /admin.
                for headers in ({}, bearer("someone")):
                    resp = c.request(method, path, headers=headers, json={"monthly_usd": "1"})
                    assert resp.status_code == 401, (method, path, resp.text)
            ok = c.get(
                "/admin/usage",
                params={"group_by": "model"},
                headers={"Authorization": "Bearer s3cret-admin"},
            )
            assert ok.status_code == 200 and "totals" in ok.json()
    assert db_rows(module_env, "SELECT 1 FROM budgets WHERE user_id = 'someone'") == []
