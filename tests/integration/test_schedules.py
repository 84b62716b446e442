"""Schedules against the real Kafka and Postgres: the HTTP API (over uvicorn) and the
scheduler's passes in-process (two replicas racing, the policies with Postgres's facts).

One namespace and one gateway for the module; each test uses its own users, so the
per-user daily cap and listings never see another test's rows.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import duckdb
import httpx
import pytest
from sqlalchemy import text
from typer.testing import CliRunner

from koda_runtime import metrics
from koda_runtime.cli.schedules import schedules_app
from koda_runtime.lifecycle.ids import uuid7
from koda_runtime.scheduler.service import Scheduler
from koda_runtime.scheduling import CronSpec
from koda_runtime.schemas.db import async_engine
from koda_runtime.schemas.migrate import downgrade, upgrade
from koda_runtime.schemas.runs.admission import RunAdmission
from koda_runtime.schemas.schedules import ScheduleStore, fire_key
from koda_runtime.settings import Settings
from koda_runtime.topics.catalogue import RUNS
from koda_runtime.topics.kafka.publisher import RunPublisher
from koda_runtime.topics.replay import tables as t
from koda_runtime.topics.replay.engine import ReplayOptions, run_replay
from koda_runtime.topics.replay.sinks.duckdb import DUCKDB_TYPES
from koda_runtime.topics.replay.sql import create_table
from koda_runtime.topics.scheduled import admit_fires, scheduled_run
from koda_runtime.topics.sweeper import Sweeper
from tests.fixtures.gateway import db_rows, records_of
from tests.fixtures.namespaces import drop_schema, make_settings
from tests.fixtures.runs import payload
from tests.sse_client import bearer
from tests.support import wait_until

KEYS = {
    "id",
    "cron",
    "timezone",
    "input",
    "enabled",
    "quiet_hours",
    "daily_cap",
    "overlap",
    "catchup_s",
    "next_fire_at",
    "last_fire_at",
    "session_id",
    "webhook_id",
}


def user() -> str:
    return "u" + uuid.uuid4().hex[:10]


def create(client: httpx.Client, who: str, **fields: Any) -> httpx.Response:
    body = {"cron": "*/5 * * * *", "timezone": "Europe/Berlin", "input": "hello", **fields}
    return client.post("/v1/schedules", json=body, headers=bearer(who))


def schedule_count(settings: Settings) -> int:
    return int(db_rows(settings, "SELECT count(*) FROM schedules")[0][0])


# --- API -----------------------------------------------------------------------------


def test_create_answers_the_schedule_with_defaults_and_its_next_fire(
    client: httpx.Client, module_env: Settings
) -> None:
    who = user()
    before = datetime.now(UTC)
    r = create(client, who)
    assert r.status_code == 201, r.text
    body = r.json()
    assert set(body) == KEYS
    assert body["input"] == {"text": "hello"}
    assert (body["enabled"], body["quiet_hours"], body["daily_cap"]) == (True, None, 1440)
    assert (body["overlap"], body["catchup_s"], body["last_fire_at"]) == ("skip", 900, None)
    assert body["session_id"] is None
    expected = next(CronSpec.parse("*/5 * * * *", "Europe/Berlin").fires_after(before))
    nxt = datetime.fromisoformat(body["next_fire_at"])
    assert expected <= nxt <= expected + timedelta(minutes=5)
    got = client.get(f"/v1/schedules/{body['id']}", headers=bearer(who))
    assert got.status_code == 200 and got.json() == body


def test_every_field_can_be_set_and_read_back(client: httpx.Client) -> None:
    who = user()
    r = create(
        client,
        who,
        cron="30 2 * * 1-5",
        input={"text": "report", "demo": {"tokens": 1}},
        enabled=False,
        quiet_hours={"start": "22:00", "end": "07:00"},
        daily_cap=3,
        overlap="allow",
        catchup_s=0,
        session_id=f"s-{who}",
    )
    assert r.status_code == 201, r.text
    body = r.json()
    assert body["quiet_hours"] == {"start": "22:00", "end": "07:00"}
    assert (body["enabled"], body["daily_cap"], body["overlap"]) == (False, 3, "allow")
    assert (body["catchup_s"], body["session_id"]) == (0, f"s-{who}")
    assert body["input"] == {"text": "report", "demo": {"tokens": 1}}


def test_schedules_are_owner_only(client: httpx.Client) -> None:
    alice, mallory = user(), user()
    sid = create(client, alice).json()["id"]
    for method, path in (
        ("GET", f"/v1/schedules/{sid}"),
        ("PATCH", f"/v1/schedules/{sid}"),
        ("DELETE", f"/v1/schedules/{sid}"),
        ("POST", f"/v1/schedules/{sid}/pause"),
        ("POST", f"/v1/schedules/{sid}/resume"),
        ("POST", f"/v1/schedules/{sid}/run-now"),
    ):
        kwargs: dict[str, Any] = {"json": {"daily_cap": 1}} if method == "PATCH" else {}
        r = client.request(method, path, headers=bearer(mallory), **kwargs)
        assert r.status_code == 404, (method, path, r.text)
        assert r.json()["error"]["field"] == "schedule_id"
    assert client.get("/v1/schedules", headers=bearer(mallory)).json() == {"schedules": []}
    listed = client.get("/v1/schedules", headers=bearer(alice)).json()["schedules"]
    assert [s["id"] for s in listed] == [sid]
    assert client.get(f"/v1/schedules/{sid}", headers=bearer(alice)).json()["daily_cap"] == 1440
    assert client.get("/v1/schedules").status_code == 401


def test_a_fixed_session_of_another_user_is_refused(client: httpx.Client) -> None:
    owner, other = user(), user()
    assert create(client, owner, session_id=f"s-{owner}").status_code == 201
    r = create(client, other, session_id=f"s-{owner}")
    assert r.status_code == 404 and r.json()["error"]["field"] == "session_id"


def test_patch_recomputes_the_next_fire_and_pause_resume_toggle(client: httpx.Client) -> None:
    who = user()
    sid = create(client, who, cron="0 3 1 1 *", timezone="UTC").json()["id"]
    before = datetime.now(UTC)
    r = client.patch(f"/v1/schedules/{sid}", json={"cron": "* * * * *"}, headers=bearer(who))
    assert r.status_code == 200, r.text
    nxt = datetime.fromisoformat(r.json()["next_fire_at"])
    assert before < nxt <= before + timedelta(minutes=1, seconds=1)
    r = client.patch(f"/v1/schedules/{sid}", json={"timezone": "Asia/Tokyo"}, headers=bearer(who))
    assert r.json()["timezone"] == "Asia/Tokyo" and r.json()["cron"] == "* * * * *"
    paused = client.post(f"/v1/schedules/{sid}/pause", headers=bearer(who)).json()
    assert paused["enabled"] is False
    resumed = client.post(f"/v1/schedules/{sid}/resume", headers=bearer(who)).json()
    assert resumed["enabled"] is True
    assert datetime.fromisoformat(resumed["next_fire_at"]) > before


def test_run_now_creates_a_scheduled_run_shown_by_get_run_and_on_the_topic(
    client: httpx.Client, module_env: Settings
) -> None:
    who = user()
    sid = create(client, who, input={"text": "now"}).json()["id"]
    r = client.post(f"/v1/schedules/{sid}/run-now", headers=bearer(who))
    assert r.status_code == 202, r.text
    body = r.json()
    assert body["schedule_id"] == sid and body["status"] == "pending"
    run = client.get(f"/v1/runs/{body['run_id']}", headers=bearer(who)).json()
    assert run["schedule_id"] == sid
    assert run["scheduled_for"] == body["scheduled_for"]
    (record,) = records_of(module_env, body["run_id"])
    value = json.loads(payload(record))
    assert value["schedule_id"] == sid
    assert datetime.fromisoformat(value["scheduled_for"]) == datetime.fromisoformat(
        body["scheduled_for"]
    )
    second = client.post(f"/v1/schedules/{sid}/run-now", headers=bearer(who)).json()
    assert second["run_id"] != body["run_id"]  # a person pressing twice means twice
    # The history listing says where each run came from too, a person's run included.
    mine = client.post("/v1/runs", json={"input": "by hand"}, headers=bearer(who)).json()
    listed = client.get("/v1/runs", headers=bearer(who)).json()["runs"]
    origin = {r["run_id"]: (r["schedule_id"], r["scheduled_for"]) for r in listed}
    assert origin == {
        body["run_id"]: (sid, body["scheduled_for"]),
        second["run_id"]: (sid, second["scheduled_for"]),
        mine["run_id"]: (None, None),
    }


def test_delete_removes_the_schedule_and_keeps_its_runs(
    client: httpx.Client, module_env: Settings
) -> None:
    who = user()
    sid = create(client, who).json()["id"]
    run_id = client.post(f"/v1/schedules/{sid}/run-now", headers=bearer(who)).json()["run_id"]
    assert client.delete(f"/v1/schedules/{sid}", headers=bearer(who)).status_code == 204
    assert client.get(f"/v1/schedules/{sid}", headers=bearer(who)).status_code == 404
    assert client.delete(f"/v1/schedules/{sid}", headers=bearer(who)).status_code == 404
    assert client.get(f"/v1/runs/{run_id}", headers=bearer(who)).json()["schedule_id"] == sid


BAD_FIELDS = [
    ({"cron": "61 * * * *"}, "cron", "30 2 * * 1-5"),
    ({"cron": "* * * *"}, "cron", "30 2 * * 1-5"),
    ({"cron": "0 0 31 2 *"}, "cron", "never fires"),
    ({"cron": 5}, "cron", "30 2 * * 1-5"),
    ({"cron": None}, "cron", "required"),
    ({"timezone": "Mars/Olympus"}, "timezone", "Europe/Berlin"),
    ({"timezone": "CEST"}, "timezone", "Europe/Berlin"),
    ({"timezone": "localtime"}, "timezone", "host"),
    ({"timezone": ""}, "timezone", "Europe/Berlin"),
    ({"timezone": None}, "timezone", "required"),
    ({"input": None}, "input", "required"),
    ({"input": 7}, "input", "object or a string"),
    ({"input": "  "}, "input", "empty"),
    ({"input": {"t": "a\u0000b"}}, "input", "NUL"),
    ({"enabled": "yes"}, "enabled", "true or false"),
    ({"quiet_hours": "22-07"}, "quiet_hours", "start"),
    ({"quiet_hours": {"start": "22:00"}}, "quiet_hours", "start"),
    ({"quiet_hours": {"start": "24:00", "end": "07:00"}}, "quiet_hours.start", "HH:MM"),
    ({"quiet_hours": {"start": "22:00", "end": "7"}}, "quiet_hours.end", "HH:MM"),
    ({"quiet_hours": {"start": "07:00", "end": "07:00"}}, "quiet_hours", "different"),
    ({"daily_cap": 0}, "daily_cap", "1..100000"),
    ({"daily_cap": 100001}, "daily_cap", "1..100000"),
    ({"daily_cap": "5"}, "daily_cap", "integer"),
    ({"daily_cap": True}, "daily_cap", "integer"),
    ({"daily_cap": 2.5}, "daily_cap", "integer"),
    ({"overlap": "queue"}, "overlap", "skip"),
    ({"catchup_s": -1}, "catchup_s", "0..604800"),
    ({"catchup_s": 604801}, "catchup_s", "0..604800"),
    ({"catchup_s": None}, "catchup_s", "integer"),
    ({"session_id": "has space"}, "session_id", "1-128"),
    ({"session_id": 3}, "session_id", "1-128"),
    ({"next_fire_at": "2030-01-01T00:00:00Z"}, "next_fire_at", "accepted fields"),
    ({"id": "mine"}, "id", "accepted fields"),
]


@pytest.mark.parametrize(("fields", "field", "hint"), BAD_FIELDS)
def test_bad_input_on_every_field_is_a_422_naming_it_and_writes_nothing(
    client: httpx.Client, module_env: Settings, fields: dict[str, Any], field: str, hint: str
) -> None:
    who = user()
    before = schedule_count(module_env)
    r = create(client, who, **fields)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["field"] == field and hint in error["message"], error
    assert schedule_count(module_env) == before
    # The same value in a PATCH (where it can be changed) is refused the same way.
    sid = create(client, who).json()["id"]
    if field not in ("next_fire_at", "id") and fields.get(field.split(".")[0]) is not None:
        r = client.patch(f"/v1/schedules/{sid}", json=fields, headers=bearer(who))
        assert r.status_code == 422, r.text
        if field != "session_id":
            assert r.json()["error"]["field"] == field
    unchanged = client.get(f"/v1/schedules/{sid}", headers=bearer(who)).json()
    assert unchanged["cron"] == "*/5 * * * *" and unchanged["daily_cap"] == 1440


def test_bodies_that_are_not_json_objects_are_refused(client: httpx.Client) -> None:
    who = user()
    h = bearer(who)
    assert (
        client.post(
            "/v1/schedules", content=b"{", headers={**h, "Content-Type": "application/json"}
        ).status_code
        == 400
    )
    assert (
        client.post(
            "/v1/schedules", content=b"x", headers={**h, "Content-Type": "text/plain"}
        ).status_code
        == 415
    )
    r = client.post("/v1/schedules", json=[1], headers=h)
    assert r.status_code == 422 and r.json()["error"]["field"] == "body"
    sid = create(client, who).json()["id"]
    r = client.patch(f"/v1/schedules/{sid}", json={}, headers=h)
    assert r.status_code == 422 and r.json()["error"]["field"] == "body"
    big = {"cron": "* * * * *", "timezone": "UTC", "input": "x" * 70_000}
    assert client.post("/v1/schedules", json=big, headers=h).status_code == 413
    assert client.get("/v1/schedules?limit=0", headers=h).status_code == 422


# --- the scheduler's passes, in-process ---------------------------------------------


class Harness:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.engine = async_engine(settings, pool_size=12)
        self.publisher = RunPublisher(settings)
        self.store = ScheduleStore(self.engine)

    def replica(self, name: str) -> Scheduler:
        return Scheduler(
            self.store,
            RunAdmission(self.engine),
            self.publisher,
            partitions=8,
            batch=40,
            replica=name,
        )

    async def add(self, who: str, first: datetime, **cols: Any) -> str:
        sid = uuid7()
        values = {
            "cron": "* * * * *",
            "timezone": "UTC",
            "overlap": "allow",
            "catchup_s": 3600,
            "daily_cap": 1440,
            "enabled": True,
            **cols,
        }
        async with self.engine.begin() as conn:
            await conn.execute(
                text(
                    "INSERT INTO schedules (id, user_id, session_id, cron, timezone, input, "
                    "enabled, daily_cap, overlap, catchup_s, next_fire_at) VALUES (:id, :u, "
                    ":session, :cron, :timezone, CAST(:inp AS jsonb), :enabled, :daily_cap, "
                    ":overlap, :catchup_s, :n)"
                ),
                {
                    "id": sid,
                    "u": who,
                    "session": cols.get("session_id"),
                    "inp": json.dumps({"text": "x"}),
                    "n": first,
                    **values,
                },
            )
        return sid

    async def rows(self, sql: str, **params: Any) -> list[Any]:
        async with self.engine.connect() as conn:
            return list((await conn.execute(text(sql), params)).all())


@pytest.fixture
async def harness(module_env: Settings) -> AsyncIterator[Harness]:
    # The pass tests count the due minutes from a start taken before the pass: a minute
    # boundary crossed in between would add a due minute. Start well inside a minute.
    wait_until(lambda: datetime.now(UTC).second < 45, timeout=20, what="a point early in a minute")
    h = Harness(module_env)
    # A pass plans every due schedule of the namespace: those the module's earlier tests
    # left would add fires (or, paused, skips) to this test's counts. Moved out of reach,
    # they are never due again.
    async with h.engine.begin() as conn:
        await conn.execute(text("UPDATE schedules SET next_fire_at = '9999-01-01T00:00Z'"))
    await h.publisher.start()
    yield h
    await h.publisher.stop(5)
    await h.engine.dispose()


def _ago(minutes: int) -> datetime:
    now = datetime.now(UTC).replace(second=0, microsecond=0)
    return now - timedelta(minutes=minutes)


async def test_two_replicas_at_once_create_each_due_minute_exactly_once(harness: Harness) -> None:
    """The failure this catches: a check-then-insert or an advance-before-fire would let
    both replicas create a run for the same minute (or none)."""
    first = _ago(4)
    ids = [await harness.add(user(), first) for _ in range(60)]
    a, b = harness.replica("a"), harness.replica("b")
    ra, rb = await asyncio.gather(a.run_pass(), b.run_pass())
    # On a loaded machine the passes may cross a minute boundary: a schedule planned
    # after it is due one minute more. Either way each minute fires exactly once.
    last_due = {first + timedelta(minutes=4), _ago(0)}
    rows = await harness.rows(
        "SELECT schedule_id, scheduled_for, idempotency_key, published_at FROM runs "
        "WHERE schedule_id = ANY(:ids)",
        ids=ids,
    )
    got: dict[str, list[datetime]] = {}
    for r in rows:
        got.setdefault(r.schedule_id, []).append(r.scheduled_for)
        assert r.idempotency_key == fire_key(r.schedule_id, r.scheduled_for)
    assert len(got) == 60
    for minutes_of in got.values():
        last = max(minutes_of)
        assert last in last_due, (last, last_due)
        span = int((last - first).total_seconds() // 60) + 1
        assert sorted(minutes_of) == [first + timedelta(minutes=i) for i in range(span)]
    assert ra.fired + rb.fired == len(rows) >= 300
    # Both read due schedules and worked on them at once. Which one creates a minute is a
    # race: on a loaded machine one replica's inserts may come after the other has fired
    # every row it read (conflicts for it, fired 0), which is the design working.
    assert ra.schedules > 0 and rb.schedules > 0
    assert ra.fired + ra.conflicts > 0 and rb.fired + rb.conflicts > 0
    # A losing insert keeps nothing: not even the new session it brought.
    users = [
        r.user_id
        for r in await harness.rows("SELECT user_id FROM schedules WHERE id = ANY(:ids)", ids=ids)
    ]
    sessions = await harness.rows(
        "SELECT count(*) AS n FROM sessions WHERE user_id = ANY(:u)", u=users
    )
    assert sessions[0].n == len(rows)
    nxt = await harness.rows("SELECT id, next_fire_at FROM schedules WHERE id = ANY(:ids)", ids=ids)
    assert {r.id: r.next_fire_at for r in nxt} == {
        sid: max(m) + timedelta(minutes=1) for sid, m in got.items()
    }
    # Another pass fires only minutes that came due since (none, unless a boundary
    # passed): never one of those already fired.
    again = await a.run_pass()
    after = await harness.rows(
        "SELECT count(*) AS n, count(DISTINCT idempotency_key) AS k FROM runs "
        "WHERE schedule_id = ANY(:ids)",
        ids=ids,
    )
    assert after[0].n == after[0].k == len(rows) + again.fired


def _midday_zone() -> str:
    """A zone whose local day does not change within the next minutes."""
    for zone in ("UTC", "Asia/Tokyo", "America/New_York"):
        if 1 <= datetime.now(ZoneInfo(zone)).hour <= 22:
            return zone
    raise AssertionError("unreachable: these zones are hours apart")


async def test_the_daily_cap_spans_the_users_schedules(harness: Harness) -> None:
    who = user()
    first = _ago(4)
    zone = _midday_zone()
    s1 = await harness.add(who, first, daily_cap=3, timezone=zone)
    s2 = await harness.add(who, first, daily_cap=3, timezone=zone)
    result = await harness.replica("cap").run_pass()
    rows = await harness.rows(
        "SELECT count(*) AS n FROM runs WHERE schedule_id IN (:a, :b)", a=s1, b=s2
    )
    assert rows[0].n == 3
    assert result.skipped == 10 - 3


async def test_overlap_skip_waits_for_the_previous_run_to_end(harness: Harness) -> None:
    """No worker runs here, so the first fired run stays pending: the next minutes skip."""
    sid = await harness.add(user(), _ago(2), overlap="skip")
    result = await harness.replica("ov").run_pass()
    rows = await harness.rows("SELECT id FROM runs WHERE schedule_id = :s", s=sid)
    assert len(rows) == 1 and result.skipped == 2
    async with harness.engine.begin() as conn:
        await conn.execute(text("UPDATE runs SET status = 'done' WHERE id = :r"), {"r": rows[0].id})
        await conn.execute(
            text("UPDATE schedules SET next_fire_at = :n WHERE id = :s"), {"n": _ago(0), "s": sid}
        )
    await harness.replica("ov").run_pass()
    assert len(await harness.rows("SELECT id FROM runs WHERE schedule_id = :s", s=sid)) == 2


def sample(name: str, **labels: str) -> float:
    return metrics.REGISTRY.get_sample_value(name, labels) or 0.0


async def test_a_paused_schedule_fires_nothing_and_moves_on(harness: Harness) -> None:
    sid = await harness.add(user(), _ago(3), enabled=False)
    before = sample("koda_schedule_skips_total", reason="paused")
    result = await harness.replica("p").run_pass()
    assert result.skipped == 4 and result.fired == 0
    assert sample("koda_schedule_skips_total", reason="paused") == before + 4
    assert await harness.rows("SELECT id FROM runs WHERE schedule_id = :s", s=sid) == []
    (row,) = await harness.rows("SELECT next_fire_at FROM schedules WHERE id = :s", s=sid)
    assert row.next_fire_at > datetime.now(UTC)


async def test_a_spent_budget_skips_the_owners_fires_and_run_now_answers_402(
    harness: Harness, client: httpx.Client
) -> None:
    """A scheduled run is a new run: a spent budget refuses it as admission refuses a
    POST. Without the check every due minute would run past the budget."""
    who = user()
    broke = await harness.add(who, _ago(2))
    fine = await harness.add(user(), _ago(2))
    async with harness.engine.begin() as conn:
        await conn.execute(
            text("INSERT INTO budgets (user_id, monthly_usd) VALUES (:u, 1.00)"), {"u": who}
        )
        await conn.execute(
            text(
                "INSERT INTO spend_periods (user_id, period, starts_at, spend_usd, calls)"
                " VALUES (:u, 'month', date_trunc('month', now(), 'UTC'), 1.00, 1)"
            ),
            {"u": who},
        )
    before = sample("koda_schedule_skips_total", reason="budget")
    result = await harness.replica("budget").run_pass()
    assert await harness.rows("SELECT id FROM runs WHERE schedule_id = :s", s=broke) == []
    assert len(await harness.rows("SELECT id FROM runs WHERE schedule_id = :s", s=fine)) == 3
    assert sample("koda_schedule_skips_total", reason="budget") == before + 3
    assert result.fired == 3
    answer = client.post(f"/v1/schedules/{broke}/run-now", headers=bearer(who))
    assert answer.status_code == 402, answer.text
    assert answer.json()["error"]["code"] == "budget_exceeded"
    assert await harness.rows("SELECT id FROM runs WHERE schedule_id = :s", s=broke) == []


async def test_minutes_outside_the_catch_up_window_are_missed_not_run(harness: Harness) -> None:
    sid = await harness.add(user(), _ago(10), catchup_s=150)
    missed, fires = sample("koda_schedule_missed_total"), sample("koda_schedule_fires_total")
    lags = sample("koda_schedule_fire_lag_seconds_count")
    result = await harness.replica("m").run_pass()
    assert sample("koda_schedule_missed_total") == missed + result.missed > missed
    assert sample("koda_schedule_fires_total") == fires + result.fired
    assert sample("koda_schedule_fire_lag_seconds_count") == lags + result.fired
    rows = await harness.rows("SELECT scheduled_for FROM runs WHERE schedule_id = :s", s=sid)
    fired = sorted(r.scheduled_for for r in rows)
    assert fired and min(fired) >= datetime.now(UTC) - timedelta(seconds=151)
    assert result.missed + len(fired) == 11


async def test_a_fixed_session_collects_every_fire(harness: Harness) -> None:
    who = user()
    async with harness.engine.begin() as conn:
        await conn.execute(
            text("INSERT INTO sessions (id, user_id) VALUES (:s, :u)"), {"s": f"s-{who}", "u": who}
        )
    sid = await harness.add(who, _ago(2), session_id=f"s-{who}")
    await harness.replica("fs").run_pass()
    rows = await harness.rows("SELECT DISTINCT session_id FROM runs WHERE schedule_id = :s", s=sid)
    assert [r.session_id for r in rows] == [f"s-{who}"]


# --- the warehouse and the migration --------------------------------------------------


def test_the_warehouse_replay_shows_a_scheduled_runs_schedule_and_minute(
    client: httpx.Client, module_env: Settings, tmp_path: Path
) -> None:
    who = user()
    sid = create(client, who).json()["id"]
    fired = client.post(f"/v1/schedules/{sid}/run-now", headers=bearer(who)).json()
    person = client.post("/v1/runs", json={"input": "by hand"}, headers=bearer(who)).json()
    wait_until(
        lambda: (
            records_of(module_env, fired["run_id"]) and records_of(module_env, person["run_id"])
        ),
        timeout=30,
        what="both triggers on the topic",
    )
    target = tmp_path / "w.duckdb"
    run_replay(module_env, ReplayOptions(topics=(RUNS,), sink_url=f"duckdb:///{target}"))
    with duckdb.connect(str(target)) as conn:
        rows = dict(
            (r[0], (r[1], r[2]))
            for r in conn.execute(
                "SELECT run_id, schedule_id, scheduled_for FROM runs WHERE run_id IN (?, ?)",
                [fired["run_id"], person["run_id"]],
            ).fetchall()
        )
    schedule_id, minute = rows[fired["run_id"]]
    assert schedule_id == sid
    assert minute.replace(tzinfo=UTC) == datetime.fromisoformat(fired["scheduled_for"])
    assert rows[person["run_id"]] == (None, None)


def test_an_older_warehouse_gains_the_schedule_columns(
    module_env: Settings, tmp_path: Path
) -> None:
    """A warehouse written before the columns existed must take the new rows."""
    target = tmp_path / "old.duckdb"
    old = [c for c in t.RUNS.columns if c.name not in ("schedule_id", "scheduled_for")]
    with duckdb.connect(str(target)) as conn:
        conn.execute(create_table(t.Table("runs", tuple(old)), DUCKDB_TYPES))
    run_replay(module_env, ReplayOptions(topics=(RUNS,), sink_url=f"duckdb:///{target}"))
    with duckdb.connect(str(target)) as conn:
        names = [r[0] for r in conn.execute("DESCRIBE runs").fetchall()]
        scheduled = conn.execute(
            "SELECT count(*) FROM runs WHERE schedule_id IS NOT NULL"
        ).fetchone()
    assert {"schedule_id", "scheduled_for"} <= set(names)
    assert scheduled is not None and scheduled[0] > 0


def test_migration_0005_downgrades_and_upgrades_again(stack) -> None:
    settings = make_settings(stack)
    try:
        upgrade(settings)
        downgrade(settings, "0004")
        schema = settings.names.pg_schema()
        tables = {
            r[0]
            for r in db_rows(
                settings, "SELECT tablename FROM pg_tables WHERE schemaname = :s", s=schema
            )
        }
        assert "schedules" not in tables
        upgrade(settings)
        tables = {
            r[0]
            for r in db_rows(
                settings, "SELECT tablename FROM pg_tables WHERE schemaname = :s", s=schema
            )
        }
        assert "schedules" in tables
    finally:
        drop_schema(settings)


async def test_admitting_fires_keeps_nothing_of_a_run_whose_key_exists(harness: Harness) -> None:
    """The batch insert's failure mode: a losing run leaving its new session behind, or
    a duplicate. The same keys twice: the second batch creates nothing, adds no session."""
    who = user()
    sid = await harness.add(who, _ago(1))
    (row,) = [r for r in await harness.store.owned(who, 10) if r.id == sid]
    minutes = [_ago(3), _ago(2), _ago(1)]
    runs = RunAdmission(harness.engine)
    first = await admit_fires(runs, [scheduled_run(row, m, partitions=8) for m in minutes])
    again = await admit_fires(
        runs, [scheduled_run(row, m, partitions=8) for m in reversed(minutes)]
    )
    assert all(r is not None for r in first) and again == [None, None, None]
    (n,) = await harness.rows("SELECT count(*) AS n FROM sessions WHERE user_id = :u", u=who)
    assert n.n == 3
    keys = await harness.rows("SELECT idempotency_key FROM runs WHERE schedule_id = :s", s=sid)
    assert sorted(k.idempotency_key for k in keys) == sorted(fire_key(sid, m) for m in minutes)


async def test_a_replica_killed_between_its_insert_and_its_advance_loses_and_doubles_nothing(
    harness: Harness, module_env: Settings
) -> None:
    """The two crash points after an insert. Killed before the publish: a live replica
    fires the same key and creates nothing, so only the sweeper can publish the run, and
    its record must still carry the schedule and minute (the warehouse reads them from
    it). Killed after the publish, before the advance: the minute is fired again and
    creates nothing, and the topic keeps one record."""
    minute = _ago(0)
    # Fires once a day at this minute: a pass crossing a boundary adds no due minute.
    sid = await harness.add(user(), minute, cron=f"{minute.minute} {minute.hour} * * *")
    _, due = await harness.store.due(10, "dead")
    assert [r.id for r in due] == [sid]
    (dead,) = await admit_fires(
        RunAdmission(harness.engine), [scheduled_run(due[0], minute, partitions=8)]
    )
    assert dead is not None
    live = harness.replica("live")
    passed = await live.run_pass()
    assert (passed.fired, passed.conflicts) == (0, 1)
    assert records_of(module_env, dead.run_id) == []  # the creator died before producing it
    # One sweep (with after_s=0 a second one would republish it as presumed lost).
    sweeper = Sweeper(RunAdmission(harness.engine), harness.publisher, after_s=0, interval_s=1)
    assert await sweeper.sweep_once() >= 1
    (record,) = records_of(module_env, dead.run_id)
    value = json.loads(payload(record))
    assert value["schedule_id"] == sid
    assert datetime.fromisoformat(value["scheduled_for"]) == minute
    async with harness.engine.begin() as conn:  # as if the advance had not happened
        await conn.execute(
            text("UPDATE schedules SET next_fire_at = :m WHERE id = :s"), {"m": minute, "s": sid}
        )
    again = await live.run_pass()
    assert (again.fired, again.conflicts) == (0, 1)
    runs = await harness.rows("SELECT id FROM runs WHERE schedule_id = :s", s=sid)
    assert [r.id for r in runs] == [dead.run_id]
    assert len(records_of(module_env, dead.run_id)) == 1


def test_the_schedules_cli_creates_lists_pauses_resumes_and_deletes(gateway_url: str) -> None:
    who = user()
    runner = CliRunner()

    def koda(*args: str) -> str:
        result = runner.invoke(schedules_app, [*args, "--user", who, "--gateway", gateway_url])
        assert result.exit_code == 0, result.output
        return result.output

    made = koda(
        "create", "30 2 * * *", "nightly", "--timezone", "Europe/Berlin", "--quiet", "22:00-07:00"
    )
    sid = made.split()[0]
    assert "'30 2 * * *' Europe/Berlin" in made and "quiet=22:00-07:00" in made
    assert sid in koda("list")
    assert "paused" in koda("pause", sid)
    assert "enabled" in koda("resume", sid)
    assert sid in koda("delete", sid)
    assert koda("list") == ""
    bad = runner.invoke(
        schedules_app, ["create", "61 * * * *", "x", "--user", who, "--gateway", gateway_url]
    )
    assert bad.exit_code == 2 and "(cron)" in bad.output and "30 2 * * 1-5" in bad.output
