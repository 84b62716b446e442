"""The cap on a user's active runs (KODA_MAX_ACTIVE_RUNS_PER_USER) against the real
Postgres and Kafka: ``POST /v1/runs`` over HTTP (the ASGI shortcut), the group commit of
two gateways at once, the single-run insert of ``run-now`` and the scheduler's batch.

A run is active while its status is pending, running or streaming; no worker runs here,
so every admitted run stays pending until a test ends it (a cancel, or a status written
as a worker would).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime

import httpx
import pytest
from sqlalchemy import text

from koda_runtime import metrics
from koda_runtime.errors import TooManyActiveRuns
from koda_runtime.gateway.app import create_app
from koda_runtime.gateway.bootstrap import Components, build_components
from koda_runtime.gateway.intake import RunRequest
from koda_runtime.lifecycle.ids import uuid7
from koda_runtime.schemas.db import sync_engine
from koda_runtime.schemas.runs.admission import _ACTIVE_RUNS, AdmittedRun, NewRun
from koda_runtime.settings import Settings
from koda_runtime.topics.catalogue import partition_for_key
from koda_runtime.topics.scheduled import admit_fires, scheduled_run
from tests.fixtures.gateway import db_rows, rows_of, serve_app
from tests.sse_client import bearer

CAP = 3


@pytest.fixture(scope="module")
def capped(module_env: Settings) -> Settings:
    return module_env.with_(max_active_runs_per_user=CAP)


@pytest.fixture(scope="module")
def url(capped: Settings) -> Iterator[str]:
    with serve_app(create_app(capped, run_sweeper=False)) as base:
        yield base


@pytest.fixture
def http(url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=url, timeout=30) as c:
        yield c


def a_user(tag: str) -> str:
    return f"{tag}-{uuid.uuid4().hex[:8]}"


def post(c: httpx.Client, user: str, text: str, key: str | None = None) -> httpx.Response:
    headers = bearer(user)
    if key is not None:
        headers["Idempotency-Key"] = key
    return c.post("/v1/runs", json={"input": text}, headers=headers)


def active_of(settings: Settings, user: str) -> int:
    (row,) = db_rows(
        settings,
        "SELECT count(*) FROM runs WHERE user_id = :u"
        " AND status IN ('pending', 'running', 'streaming')",
        u=user,
    )
    return int(row[0])


def set_status(settings: Settings, run_id: str, status: str) -> None:
    db_rows(settings, "UPDATE runs SET status = :s WHERE id = :id", s=status, id=run_id)


def refused_count() -> float:
    return (
        metrics.REGISTRY.get_sample_value(
            "koda_admissions_rejected_total", {"reason": "too_many_active_runs"}
        )
        or 0.0
    )


def assert_capped(r: httpx.Response, active: int = CAP) -> None:
    assert r.status_code == 429, r.text
    assert r.headers["Retry-After"] == "5"
    error = r.json()["error"]
    assert error["code"] == "too_many_active_runs"
    assert error["field"] is None
    assert error["active_runs"] == {
        "setting": "KODA_MAX_ACTIVE_RUNS_PER_USER",
        "cap": CAP,
        "active": active,
    }
    assert f"KODA_MAX_ACTIVE_RUNS_PER_USER={CAP}" in error["message"]


# --- POST /v1/runs over HTTP ----------------------------------------------------------


def test_the_run_past_the_cap_is_429_naming_the_cap_and_writes_nothing(
    capped: Settings, http: httpx.Client
) -> None:
    user = a_user("cap")
    accepted = [post(http, user, f"n{i}") for i in range(CAP)]
    assert [r.status_code for r in accepted] == [202] * CAP
    before, refused_before = rows_of(capped, user), refused_count()
    r = post(http, user, "one too many")
    assert_capped(r)
    # Nothing written (not even the new session) and the refusal is counted.
    assert rows_of(capped, user) == before
    assert refused_count() == refused_before + 1
    # Running and streaming runs are active too.
    set_status(capped, accepted[0].json()["run_id"], "running")
    set_status(capped, accepted[1].json()["run_id"], "streaming")
    assert_capped(post(http, user, "still too many"))
    # Another user has a cap of their own.
    assert post(http, a_user("cap-other"), "x").status_code == 202


def test_a_run_that_ends_frees_a_slot(capped: Settings, http: httpx.Client) -> None:
    user = a_user("ends")
    ids = [post(http, user, f"n{i}").json()["run_id"] for i in range(CAP)]
    assert_capped(post(http, user, "waits for a slot"))
    # A cancel of a pending run ends it at once.
    r = http.post(f"/v1/runs/{ids[0]}/cancel", json={}, headers=bearer(user))
    assert r.status_code == 200 and r.json()["status"] == "cancelled", r.text
    assert post(http, user, "in the freed slot").status_code == 202
    assert_capped(post(http, user, "full again"))
    # A run a worker finished (done) or gave up (failed) frees one as well.
    for run_id, status in ((ids[1], "done"), (ids[2], "failed")):
        set_status(capped, run_id, status)
        assert post(http, user, f"after {status}").status_code == 202
    assert_capped(post(http, user, "full once more"))
    assert active_of(capped, user) == CAP


def test_a_replay_at_the_cap_answers_its_run(capped: Settings, http: httpx.Client) -> None:
    user = a_user("replay")
    first = post(http, user, "first", key="k-first")
    by_intent = post(http, user, "second")  # no key: the key is derived from the body
    post(http, user, "third")
    assert_capped(post(http, user, "fourth", key="k-fourth"))
    again = post(http, user, "first", key="k-first")
    assert again.status_code == 202, again.text
    assert again.json() == first.json()
    same_intent = post(http, user, "second")
    assert same_intent.status_code == 202, same_intent.text
    assert same_intent.json()["run_id"] == by_intent.json()["run_id"]
    # A replay of a run that has ended is no new run either.
    set_status(capped, first.json()["run_id"], "done")
    post(http, user, "takes the freed slot")
    later = post(http, user, "first", key="k-first")
    assert later.status_code == 202
    assert later.json() == {**first.json(), "status": "done"}
    assert rows_of(capped, user)[1] == 4


# --- run-now and the scheduler -------------------------------------------------------


def test_run_now_counts_toward_the_cap_and_cron_fires_are_never_refused(
    capped: Settings, http: httpx.Client
) -> None:
    user = a_user("sched")
    created = http.post(
        "/v1/schedules",
        json={"cron": "0 0 1 1 *", "timezone": "UTC", "input": "nightly", "overlap": "allow"},
        headers=bearer(user),
    )
    assert created.status_code == 201, created.text
    schedule_id = created.json()["id"]
    now = [
        http.post(f"/v1/schedules/{schedule_id}/run-now", headers=bearer(user)) for _ in range(2)
    ]
    assert [r.status_code for r in now] == [202, 202]
    assert post(http, user, "by hand").status_code == 202
    before = rows_of(capped, user)
    assert_capped(http.post(f"/v1/schedules/{schedule_id}/run-now", headers=bearer(user)))
    assert rows_of(capped, user) == before

    async def fire_minutes() -> list[AdmittedRun | None]:
        gw = build_components(capped)
        try:
            row = await gw.schedules.get(schedule_id, user)
            assert row is not None
            minutes = [datetime(2030, 1, 1, 0, m, tzinfo=UTC) for m in range(2)]
            return await admit_fires(
                gw.store, [scheduled_run(row, m, partitions=capped.partitions) for m in minutes]
            )
        finally:
            await gw.engine.dispose()

    # The scheduler's fires are never refused (a refused minute would be lost): both
    # are created over the cap, and they count toward it for everything else.
    fired = asyncio.run(fire_minutes())
    assert all(f is not None and f.created for f in fired)
    assert active_of(capped, user) == CAP + 2
    assert_capped(post(http, user, "over"), active=CAP + 2)


# --- concurrency -----------------------------------------------------------------------


@asynccontextmanager
async def gateway(settings: Settings) -> AsyncIterator[Components]:
    gw = build_components(settings)
    await gw.publisher.start()
    try:
        yield gw
    finally:
        await gw.admissions.drain(5.0)
        await gw.publisher.stop(timeout_s=5.0)
        await gw.engine.dispose()


async def submit_all(gw: Components, user: str, n: int, tag: str) -> list[object]:
    return await asyncio.gather(
        *(
            gw.admissions.submit(user, RunRequest(input={"text": f"{tag} {i}"}), None)
            for i in range(n)
        ),
        return_exceptions=True,
    )


async def test_two_gateways_submitting_at_once_never_pass_the_cap(capped: Settings) -> None:
    cap = 5
    settings = capped.with_(max_active_runs_per_user=cap)
    async with gateway(settings) as one, gateway(settings) as two:
        for round_ in range(3):
            user = a_user(f"race{round_}")
            answers = [
                *await asyncio.gather(
                    submit_all(one, user, 20, "one"), submit_all(two, user, 20, "two")
                )
            ]
            flat = [a for part in answers for a in part]
            created = [a for a in flat if isinstance(a, AdmittedRun)]
            refused = [a for a in flat if isinstance(a, TooManyActiveRuns)]
            assert len(created) + len(refused) == 40, [type(a) for a in flat]
            assert len(created) == cap
            assert all(a.created for a in created)
            assert all(r.cap == cap and r.active >= cap for r in refused)
            assert active_of(settings, user) == cap


async def test_single_run_admissions_at_once_never_pass_the_cap(capped: Settings) -> None:
    """``RunAdmission.admit`` (run-now's insert), one transaction per run, 12 at once."""
    user = a_user("single")
    gw = build_components(capped)

    async def one(i: int) -> object:
        new = NewRun(
            run_id=uuid7(),
            user_id=user,
            session_id=uuid7(),
            create_session=True,
            idempotency_key=f"single:{user}:{i}",
            input={"text": str(i)},
            metadata=None,
            partition=partition_for_key(user.encode(), capped.partitions),
        )
        try:
            return await gw.store.admit(new, max_active=CAP)
        except TooManyActiveRuns as exc:
            return exc

    try:
        answers = await asyncio.gather(*(one(i) for i in range(12)))
    finally:
        await gw.engine.dispose()
    assert sum(isinstance(a, AdmittedRun) for a in answers) == CAP
    assert sum(isinstance(a, TooManyActiveRuns) for a in answers) == 12 - CAP
    assert active_of(capped, user) == CAP
    assert rows_of(capped, user) == (CAP, CAP)


async def test_one_batch_gives_the_room_to_new_keys_and_answers_replays(
    capped: Settings,
) -> None:
    """One ``admit_batch`` transaction: a replay takes no room, one key takes one place."""
    user = a_user("batch")
    gw = build_components(capped)

    def new(key: str) -> NewRun:
        return NewRun(
            run_id=uuid7(),
            user_id=user,
            session_id=uuid7(),
            create_session=True,
            idempotency_key=f"batch:{user}:{key}",
            input={"text": key},
            metadata=None,
            partition=0,
        )

    try:
        (existing,) = await gw.store.admit_batch([new("old")], max_active=CAP)
        assert isinstance(existing, AdmittedRun) and existing.created
        # Room for two: the replay of "old" and the second "a" take none of it.
        answers = await gw.store.admit_batch(
            [new("old"), new("a"), new("a"), new("b"), new("c"), new("old")], max_active=CAP
        )
    finally:
        await gw.engine.dispose()
    old, a1, a2, b, c, old2 = answers
    assert isinstance(old, AdmittedRun) and not old.created and old.run_id == existing.run_id
    assert isinstance(old2, AdmittedRun) and old2.run_id == existing.run_id
    assert isinstance(a1, AdmittedRun) and a1.created
    assert isinstance(a2, AdmittedRun) and not a2.created and a2.run_id == a1.run_id
    assert isinstance(b, AdmittedRun) and b.created
    assert isinstance(c, TooManyActiveRuns) and (c.cap, c.active) == (CAP, CAP)
    # Only the three runs' sessions were kept.
    assert rows_of(capped, user) == (CAP, CAP)


def test_the_count_reads_the_partial_index(capped: Settings) -> None:
    """Admission's count of active runs is served by ``ix_runs_open_user_id`` (0010), whose
    predicate is the statement's: for a user with a long history (thousands of ended
    runs) it reads the few active entries, not every run the user ever had."""
    user = a_user("history")
    engine = sync_engine(capped)
    try:
        with engine.begin() as conn:
            conn.execute(
                text("INSERT INTO sessions (id, user_id) VALUES (:s, :u)"), {"s": user, "u": user}
            )
            conn.execute(
                text(
                    "INSERT INTO runs (id, session_id, user_id, idempotency_key, input, status)"
                    " SELECT :u || '-' || i, :u, :u, :u || ':' || i, '{}',"
                    " CASE WHEN i % 1000 = 0 THEN 'pending' ELSE 'done' END"
                    " FROM generate_series(1, 5000) AS i"
                ),
                {"u": user},
            )
            conn.execute(text("ANALYZE runs"))
            plan = conn.execute(
                text("EXPLAIN (FORMAT JSON) " + _ACTIVE_RUNS.text), {"users": [user]}
            ).scalar_one()
    finally:
        engine.dispose()
    assert "ix_runs_open_user_id" in json.dumps(plan), json.dumps(plan)
    assert active_of(capped, user) == 5
