"""Per-user quotas through the HTTP API against the real Postgres and Kafka: schedules
per user, ``run-now`` through the rate limiter and the daily cap, SSE streams per user
and per gateway, memories (cap, paging, bulk forget), merges (budget, merges per run,
merged bytes), the body-read timeout and uvicorn's concurrency and keep-alive bounds.

No worker runs here: an admitted run stays pending until a test moves it on (a cancel,
or a status written as a worker would).
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
import uvicorn
from sqlalchemy.ext.asyncio import AsyncEngine

from koda_runtime import metrics
from koda_runtime.errors import ConfigError
from koda_runtime.gateway.app import create_app
from koda_runtime.gateway.server import uvicorn_config
from koda_runtime.processors.memory import store
from koda_runtime.processors.memory.embedders import wordllama
from koda_runtime.processors.memory.service import build_memory
from koda_runtime.schemas.db import async_engine
from koda_runtime.settings import Settings
from tests.fixtures.gateway import db_rows, serve_app
from tests.sse_client import bearer
from tests.support import async_wait_until, wait_until

SCHEDULES_CAP = 3
STREAMS_PER_USER = 2
STREAMS = 5
MERGES = 2
MERGED_BYTES = 2048
BODY_READ_S = 1.0
SCHEDULE = {"cron": "0 9 * * *", "timezone": "UTC", "input": {"text": "daily"}}


@pytest.fixture(scope="module")
def capped(module_env: Settings) -> Settings:
    return module_env.with_(
        max_schedules_per_user=SCHEDULES_CAP,
        max_streams_per_user=STREAMS_PER_USER,
        max_streams=STREAMS,
        max_merges_per_run=MERGES,
        max_merged_input_bytes=MERGED_BYTES,
        body_read_timeout_s=BODY_READ_S,
        sse_keepalive_s=0.2,
    )


@pytest.fixture(scope="module")
def url(capped: Settings) -> Iterator[str]:
    with serve_app(create_app(capped, run_sweeper=False)) as base:
        yield base


@pytest.fixture
def http(url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=url, timeout=30) as c:
        yield c


@pytest.fixture
async def ahttp(url: str) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        yield c


@pytest.fixture
async def engine(capped: Settings) -> AsyncIterator[AsyncEngine]:
    engine = async_engine(capped, pool_size=2)
    yield engine
    await engine.dispose()


def a_user(tag: str) -> str:
    return f"{tag}-{uuid.uuid4().hex[:8]}"


def refusals(quota: str) -> float:
    value = metrics.REGISTRY.get_sample_value("koda_quota_refusals_total", {"quota": quota})
    return value or 0.0


def assert_limit(r: httpx.Response, status: int, code: str, setting: str, cap: int) -> dict:
    """``r`` is the refusal at a cap: its status and code, and a body naming the cap."""
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == code, error
    assert error["limit"]["setting"] == setting and error["limit"]["cap"] == cap, error
    assert f"{setting}={cap}" in error["message"], error["message"]
    return dict(error)


def set_status(settings: Settings, run_id: str, status: str) -> None:
    db_rows(settings, "UPDATE runs SET status = :s WHERE id = :id", s=status, id=run_id)


def spend_all(settings: Settings, user: str) -> None:
    """A monthly budget of 1 USD, spent."""
    db_rows(settings, "INSERT INTO budgets (user_id, monthly_usd) VALUES (:u, 1.00)", u=user)
    db_rows(
        settings,
        "INSERT INTO spend_periods (user_id, period, starts_at, spend_usd, calls)"
        " VALUES (:u, 'month', date_trunc('month', now(), 'UTC'), 1.00, 1)",
        u=user,
    )


# --- schedules per user ---------------------------------------------------------------


def schedules_of(settings: Settings, user: str) -> int:
    (row,) = db_rows(settings, "SELECT count(*) FROM schedules WHERE user_id = :u", u=user)
    return int(row[0])


def test_a_schedule_past_the_cap_is_409_naming_it_and_a_deleted_one_frees_room(
    capped: Settings, http: httpx.Client
) -> None:
    user = a_user("sched")
    made = [http.post("/v1/schedules", json=SCHEDULE, headers=bearer(user)) for _ in range(3)]
    assert [r.status_code for r in made] == [201] * SCHEDULES_CAP
    before = refusals("schedules")
    r = http.post("/v1/schedules", json=SCHEDULE, headers=bearer(user))
    error = assert_limit(r, 409, "too_many_schedules", "KODA_MAX_SCHEDULES_PER_USER", 3)
    assert error["limit"]["count"] == SCHEDULES_CAP
    assert schedules_of(capped, user) == SCHEDULES_CAP
    assert refusals("schedules") == before + 1
    # Another user has a cap of their own; a deleted schedule makes room.
    assert http.post("/v1/schedules", json=SCHEDULE, headers=bearer(a_user("o"))).status_code == 201
    gone = made[0].json()["id"]
    assert http.delete(f"/v1/schedules/{gone}", headers=bearer(user)).status_code == 204
    assert http.post("/v1/schedules", json=SCHEDULE, headers=bearer(user)).status_code == 201
    assert schedules_of(capped, user) == SCHEDULES_CAP


async def test_schedules_created_at_once_never_pass_the_cap(
    capped: Settings, ahttp: httpx.AsyncClient
) -> None:
    """The count is made under a per-owner lock: without it, concurrent creations all
    read a count below the cap and all insert."""
    user = a_user("race")
    answers = await asyncio.gather(
        *(ahttp.post("/v1/schedules", json=SCHEDULE, headers=bearer(user)) for _ in range(8))
    )
    codes = sorted(r.status_code for r in answers)
    assert codes == [201] * SCHEDULES_CAP + [409] * (8 - SCHEDULES_CAP), codes
    assert schedules_of(capped, user) == SCHEDULES_CAP


# --- run-now: the rate limiter and the daily cap --------------------------------------


@pytest.fixture(scope="module")
def slow_url(module_env: Settings) -> Iterator[str]:
    """A gateway whose users may submit 2 runs, then one every 100 s."""
    with serve_app(create_app(module_env.with_(rate_burst=2, rate_per_s=0.01))) as base:
        yield base


def runs_of_schedule(settings: Settings, schedule_id: str) -> int:
    (row,) = db_rows(settings, "SELECT count(*) FROM runs WHERE schedule_id = :s", s=schedule_id)
    return int(row[0])


def test_run_now_spends_the_same_rate_tokens_as_post_runs(
    module_env: Settings, slow_url: str
) -> None:
    user = a_user("rate")
    with httpx.Client(base_url=slow_url, timeout=30) as c:
        sid = c.post("/v1/schedules", json=SCHEDULE, headers=bearer(user)).json()["id"]
        assert c.post("/v1/runs", json={"input": "one"}, headers=bearer(user)).status_code == 202
        assert c.post(f"/v1/schedules/{sid}/run-now", headers=bearer(user)).status_code == 202
        # The burst of 2 is spent by one submission and one run-now: both refuse now.
        r = c.post(f"/v1/schedules/{sid}/run-now", headers=bearer(user))
        assert r.status_code == 429, r.text
        assert r.json()["error"]["code"] == "rate_limited"
        assert int(r.headers["Retry-After"]) >= 1
        assert c.post("/v1/runs", json={"input": "two"}, headers=bearer(user)).status_code == 429
        assert runs_of_schedule(module_env, sid) == 1
        # Another user's bucket is their own.
        other = a_user("rate-other")
        theirs = c.post("/v1/schedules", json=SCHEDULE, headers=bearer(other)).json()["id"]
        assert c.post(f"/v1/schedules/{theirs}/run-now", headers=bearer(other)).status_code == 202


def test_run_now_past_the_daily_cap_is_429_until_the_local_day_ends(
    capped: Settings, http: httpx.Client
) -> None:
    user = a_user("daily")
    body = {**SCHEDULE, "daily_cap": 2, "timezone": "Pacific/Kiritimati"}
    sid = http.post("/v1/schedules", json=body, headers=bearer(user)).json()["id"]
    fired = [http.post(f"/v1/schedules/{sid}/run-now", headers=bearer(user)) for _ in range(2)]
    assert [r.status_code for r in fired] == [202, 202]
    before = refusals("schedule_daily")
    r = http.post(f"/v1/schedules/{sid}/run-now", headers=bearer(user))
    error = assert_limit(r, 429, "daily_cap_reached", "daily_cap", 2)
    assert error["limit"]["count"] == 2 and error["field"] == "daily_cap"
    assert 1 <= int(r.headers["Retry-After"]) <= 25 * 3600
    assert "Pacific/Kiritimati" in error["message"]
    assert runs_of_schedule(capped, sid) == 2
    assert refusals("schedule_daily") == before + 1
    # Raising the schedule's cap lets the owner fire again the same day.
    assert (
        http.patch(f"/v1/schedules/{sid}", json={"daily_cap": 3}, headers=bearer(user))
    ).status_code == 200
    assert http.post(f"/v1/schedules/{sid}/run-now", headers=bearer(user)).status_code == 202


# --- SSE streams per user and per gateway ---------------------------------------------


class Streams:
    """Open event streams, closed by :meth:`close` or when the block ends."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client
        self.open: list[httpx.Response] = []

    async def attempt(self, user: str, run_id: str) -> httpx.Response:
        """Open one; a 200 stays open (in ``open``), anything else is read and closed."""
        request = self.client.build_request(
            "GET", f"/v1/runs/{run_id}/events", headers=bearer(user)
        )
        response = await self.client.send(request, stream=True)
        if response.status_code == 200:
            self.open.append(response)
        else:
            await response.aread()
            await response.aclose()
        return response

    async def close(self, response: httpx.Response) -> None:
        self.open.remove(response)
        await response.aclose()


@asynccontextmanager
async def streams(url: str) -> AsyncIterator[Streams]:
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        s = Streams(client)
        try:
            yield s
        finally:
            for response in list(s.open):
                await response.aclose()


def pending_run(http: httpx.Client, user: str) -> str:
    r = http.post("/v1/runs", json={"input": f"run {uuid.uuid4().hex}"}, headers=bearer(user))
    assert r.status_code == 202, r.text
    run_id: str = r.json()["run_id"]
    return run_id


@pytest.fixture
def no_streams(url: str) -> None:
    """Every stream of earlier tests is closed on the gateway: they share its cap."""
    wait_until(
        lambda: metrics.REGISTRY.get_sample_value("koda_sse_connections") == 0,
        what="the earlier tests' streams to close",
    )


@pytest.mark.usefixtures("no_streams")
async def test_streams_past_the_users_cap_are_429_and_a_closed_one_frees_its_slot(
    url: str, http: httpx.Client
) -> None:
    user = a_user("sse")
    run_id = pending_run(http, user)
    async with streams(url) as s:
        first = await s.attempt(user, run_id)
        second = await s.attempt(user, run_id)
        assert (first.status_code, second.status_code) == (200, 200)
        before = refusals("streams_per_user")
        refused = await s.attempt(user, run_id)
        error = assert_limit(
            refused, 429, "too_many_streams", "KODA_SSE_MAX_STREAMS_PER_USER", STREAMS_PER_USER
        )
        assert error["limit"]["count"] == STREAMS_PER_USER
        assert refused.headers["Retry-After"] == "5"
        assert refusals("streams_per_user") == before + 1
        # Another user is not affected.
        other = a_user("sse-other")
        assert (await s.attempt(other, pending_run(http, other))).status_code == 200
        # A client that goes away frees its slot (once the gateway has noticed).
        await s.close(first)

        async def reopened() -> bool:
            return (await s.attempt(user, run_id)).status_code == 200

        await async_wait_until(reopened, what="a stream slot freed by a disconnect")


@pytest.mark.usefixtures("no_streams")
async def test_a_stream_whose_run_ends_frees_its_slot(url: str, http: httpx.Client) -> None:
    user = a_user("sse-end")
    ending, other = pending_run(http, user), pending_run(http, user)
    async with streams(url) as s:
        # An answer that opens no stream (404) holds no slot.
        for _ in range(STREAMS_PER_USER + 1):
            assert (await s.attempt(user, "no-such-run")).status_code == 404
        ending_stream = await s.attempt(user, ending)
        assert ending_stream.status_code == 200
        assert (await s.attempt(user, other)).status_code == 200
        assert (await s.attempt(user, other)).status_code == 429
        # The run ends (a cancel of a pending run): its stream writes the end and closes.
        cancel = http.post(f"/v1/runs/{ending}/cancel", json={}, headers=bearer(user))
        assert cancel.status_code == 200, cancel.text
        assert b"event: cancelled" in await ending_stream.aread()

        async def reopened() -> bool:
            return (await s.attempt(user, other)).status_code == 200

        await async_wait_until(reopened, what="the slot of a stream that ended")


@pytest.mark.usefixtures("no_streams")
async def test_the_gateways_streams_are_capped_for_all_users(url: str, http: httpx.Client) -> None:
    async with streams(url) as s:
        users = [a_user(f"sse-all{i}") for i in range(3)]
        runs = {u: pending_run(http, u) for u in users}
        opened = [await s.attempt(u, runs[u]) for u in users for _ in range(STREAMS_PER_USER)]
        assert [r.status_code for r in opened] == [200] * STREAMS + [429]
        assert_limit(opened[-1], 429, "too_many_streams", "KODA_SSE_MAX_STREAMS", STREAMS)
        await s.close(opened[0])

        async def reopened() -> bool:
            return (await s.attempt(users[0], runs[users[0]])).status_code == 200

        await async_wait_until(reopened, what="a gateway stream slot")


# --- merges: the budget, merges per run, merged bytes ---------------------------------


def running_run(settings: Settings, http: httpx.Client, user: str, text: str = "first") -> str:
    """A run in a session of its own, running as if a worker had claimed it; the
    session's id is returned."""
    session = f"s-{uuid.uuid4().hex}"
    r = http.post("/v1/runs", json={"session_id": session, "input": text}, headers=bearer(user))
    assert r.status_code == 202, r.text
    set_status(settings, r.json()["run_id"], "running")
    return session


def send(http: httpx.Client, user: str, session: str, text: str) -> httpx.Response:
    return http.post("/v1/runs", json={"session_id": session, "input": text}, headers=bearer(user))


def input_of(settings: Settings, session: str) -> tuple[int, dict[str, Any]]:
    (row,) = db_rows(
        settings,
        "SELECT COALESCE(input_version, 0), input FROM runs WHERE session_id = :s",
        s=session,
    )
    return int(row[0]), row[1]


def test_merges_past_the_cap_are_409_and_leave_the_run_as_it_was(
    capped: Settings, http: httpx.Client
) -> None:
    user = a_user("merges")
    session = running_run(capped, http, user)
    for i in range(MERGES):
        r = send(http, user, session, f"more {i}")
        assert r.status_code == 202 and r.json()["merged"] is True, r.text
    version, before = input_of(capped, session)
    assert version == MERGES
    count = refusals("merges")
    r = send(http, user, session, "one too many")
    error = assert_limit(r, 409, "too_many_merges", "KODA_MAX_MERGES_PER_RUN", MERGES)
    assert error["limit"]["count"] == MERGES
    assert input_of(capped, session) == (version, before)
    assert refusals("merges") == count + 1


def test_a_merge_past_the_merged_input_bytes_is_409_naming_the_cap(
    capped: Settings, http: httpx.Client
) -> None:
    user = a_user("bytes")
    session = running_run(capped, http, user)
    # A merged message is kept twice (in the joined text and in the merged list): 1.2 KB
    # of message takes the input past 2 KiB.
    r = send(http, user, session, "x" * 1200)
    error = assert_limit(
        r, 409, "merged_input_too_large", "KODA_MAX_MERGED_INPUT_BYTES", MERGED_BYTES
    )
    assert error["field"] == "input" and error["limit"]["count"] > MERGED_BYTES
    assert input_of(capped, session)[0] == 0
    # A small message still merges.
    assert send(http, user, session, "short").json()["merged"] is True


def test_a_merge_over_a_spent_budget_is_402_like_a_new_run(
    capped: Settings, http: httpx.Client
) -> None:
    user = a_user("broke")
    session = running_run(capped, http, user)
    spend_all(capped, user)
    r = send(http, user, session, "while broke")
    assert r.status_code == 402, r.text
    error = r.json()["error"]
    assert error["code"] == "budget_exceeded" and error["budget"]["period"] == "month"
    assert input_of(capped, session)[0] == 0


# --- memories: cap, paging, bulk forget -----------------------------------------------


async def remember(
    engine: AsyncEngine, user: str, texts: list[str], run_id: str | None, cap: int = 0
) -> int:
    """The workers' insert (one transaction: one created_at for all of ``texts``)."""
    embedded = await wordllama().embed(texts)
    async with engine.begin() as conn:
        return await store.insert(
            conn,
            user_id=user,
            run_id=run_id,
            texts=texts,
            vectors=embedded.vectors,
            embedder=embedded.model,
            max_per_user=cap,
        )


def memories(http: httpx.Client, user: str, **params: Any) -> httpx.Response:
    return http.get("/v1/memories", params=params, headers=bearer(user))


async def test_memories_page_by_cursor_without_repeats_or_gaps(
    engine: AsyncEngine, http: httpx.Client
) -> None:
    user, stranger = a_user("pages"), a_user("stranger")
    await remember(engine, user, [f"Fact number {i} about me." for i in range(5)], None)
    await remember(engine, user, ["I like tea.", "I own a bike."], None)
    await remember(engine, stranger, ["A stranger's secret."], None)
    everything = memories(http, user, limit=100).json()
    assert everything["next_cursor"] is None and len(everything["memories"]) == 7
    order = [m["id"] for m in everything["memories"]]
    assert {m["text"] for m in everything["memories"][:2]} == {"I like tea.", "I own a bike."}
    seen: list[str] = []
    cursor = None
    forgot = None
    while True:
        page = memories(http, user, limit=3, **({"cursor": cursor} if cursor else {})).json()
        seen += [m["id"] for m in page["memories"]]
        if forgot is None:  # forgetting one not yet listed changes nothing else
            forgot = order[4]
            assert http.delete(f"/v1/memories/{forgot}", headers=bearer(user)).status_code == 204
        cursor = page["next_cursor"]
        if cursor is None:
            break
        assert len(page["memories"]) == 3
    assert seen == [i for i in order if i != forgot]
    bad = memories(http, user, cursor="bm90IGEgY3Vyc29y")
    assert bad.status_code == 400 and bad.json()["error"]["field"] == "cursor", bad.text
    assert memories(http, user, limit=0).status_code == 422


async def test_bulk_forget_takes_all_or_a_filter_and_only_the_callers(
    engine: AsyncEngine, http: httpx.Client
) -> None:
    user, other = a_user("forget"), a_user("keeper")
    run_a, run_b, theirs = (
        pending_run(http, user),
        pending_run(http, user),
        pending_run(http, other),
    )
    await remember(engine, user, ["I live in Porto.", "I am a cook."], run_a)
    await remember(engine, user, ["I have a cat."], run_b)
    await remember(engine, other, ["I live in Porto."], theirs)
    # Another user's run names none of the caller's memories.
    r = http.delete("/v1/memories", params={"run_id": theirs}, headers=bearer(user))
    assert r.json() == {"forgotten": 0}, r.text
    for params in ({}, {"all": "true", "run_id": run_a}):
        r = http.delete("/v1/memories", params=params, headers=bearer(user))
        assert r.status_code == 400 and r.json()["error"]["field"] == "all", r.text
    r = http.delete(
        "/v1/memories", params={"created_before": "2020-01-01T00:00"}, headers=bearer(user)
    )
    assert r.status_code == 400 and r.json()["error"]["field"] == "created_before", r.text
    r = http.delete("/v1/memories", params={"run_id": run_a}, headers=bearer(user))
    assert r.status_code == 200 and r.json() == {"forgotten": 2}, r.text
    left = memories(http, user).json()["memories"]
    assert [m["text"] for m in left] == ["I have a cat."]
    old = http.delete(
        "/v1/memories", params={"created_before": "2020-01-01T00:00:00Z"}, headers=bearer(user)
    )
    assert old.json() == {"forgotten": 0}
    assert http.delete("/v1/memories", params={"all": "true"}, headers=bearer(user)).json() == {
        "forgotten": 1
    }
    assert memories(http, user).json()["memories"] == []
    assert len(memories(http, other).json()["memories"]) == 1
    assert http.delete("/v1/memories", params={"all": "true"}).status_code == 401


async def test_memories_past_the_cap_are_not_stored_until_some_are_forgotten(
    capped: Settings, engine: AsyncEngine, http: httpx.Client
) -> None:
    user = a_user("capmem")
    facts = ["I live in Oslo.", "I am a nurse.", "I have two dogs.", "I play chess.", "I swim."]
    before = refusals("memories")
    assert await remember(engine, user, facts, None, cap=3) == 3
    listed = memories(http, user).json()["memories"]
    assert len(listed) == 3
    assert refusals("memories") == before + 2
    # Forgetting makes room again; the cap still holds.
    assert http.delete(f"/v1/memories/{listed[0]['id']}", headers=bearer(user)).status_code == 204
    assert await remember(engine, user, ["I speak Welsh.", "I bake bread."], None, cap=3) == 1
    texts = {m["text"] for m in memories(http, user).json()["memories"]}
    assert len(texts) == 3 and "I speak Welsh." in texts and "I bake bread." not in texts
    # The workers' memory service takes its cap from the settings.
    service = build_memory(capped.with_(max_memories_per_user=7), engine)
    assert service is not None and service.max_per_user == 7


# --- slow bodies and uvicorn's bounds -------------------------------------------------


def raw_exchange(base: str, request: bytes) -> bytes:
    """Send ``request`` on a fresh connection and read until the server closes it."""
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(request)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    return received


def test_a_body_that_does_not_arrive_in_time_is_408_and_the_connection_closes(
    capped: Settings, url: str
) -> None:
    user = a_user("slow")
    head = (
        "POST /v1/runs HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer dev:{user}\r\nContent-Length: 100\r\n\r\n"
    ).encode()
    answer = raw_exchange(url, head + b'{"input": ')  # and then nothing more
    status, _, rest = answer.partition(b"\r\n")
    assert b" 408 " in status, answer[:300]
    body = json.loads(rest.split(b"\r\n\r\n", 1)[1])
    assert body["error"]["code"] == "request_timeout"
    assert "KODA_BODY_READ_TIMEOUT=1 s" in body["error"]["message"]
    (row,) = db_rows(capped, "SELECT count(*) FROM runs WHERE user_id = :u", u=user)
    assert row[0] == 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_uvicorn_runs_with_the_concurrency_limit_and_keep_alive_of_the_settings(
    module_env: Settings,
) -> None:
    settings = module_env.with_(
        gateway_port=free_port(),
        gateway_limit_concurrency=3,
        max_streams=2,
        gateway_keepalive_s=1,
    )
    with pytest.raises(ConfigError, match="KODA_SSE_MAX_STREAMS=3 must be below"):
        settings.with_(max_streams=3)
    config = uvicorn_config(create_app(settings, run_sweeper=False), settings)
    assert (config.limit_concurrency, config.timeout_keep_alive) == (3, 1)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{settings.gateway_port}"
    try:
        wait_until(lambda: server.started or not thread.is_alive(), what="uvicorn up")
        assert server.started
        with httpx.Client(base_url=base, timeout=30) as c:
            assert c.get("/livez").status_code == 200
        idle = [socket.create_connection(("127.0.0.1", settings.gateway_port)) for _ in range(2)]
        try:
            with httpx.Client(base_url=base, timeout=30) as c:
                wait_until(lambda: c.get("/livez").status_code == 503, what="the concurrency limit")
            idle.pop().close()
            with httpx.Client(base_url=base, timeout=30) as c:
                wait_until(lambda: c.get("/livez").status_code == 200, what="room again")
        finally:
            for sock in idle:
                sock.close()
        # A keep-alive connection left idle is closed by the server.
        answer = raw_exchange(base, b"GET /livez HTTP/1.1\r\nHost: gw\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    finally:
        server.should_exit = True
        thread.join(30)
