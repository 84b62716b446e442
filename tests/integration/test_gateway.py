"""The gateway against the real Kafka and Postgres, over real HTTP (uvicorn).

Most tests share one namespace (topics + migrated schema) and one gateway for the
module; tests that need an empty namespace (publish failures, the sweeper) use
the per-test ``env`` fixture.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from koda_runtime import metrics
from koda_runtime.cli.runs import runs_app
from koda_runtime.gateway.app import create_app
from koda_runtime.gateway.bootstrap import build_components
from koda_runtime.lifecycle.ids import scoped_idempotency_key, uuid7
from koda_runtime.naming import AppEnv
from koda_runtime.schemas.migrate import upgrade
from koda_runtime.settings import Settings
from koda_runtime.topics.admin import apply_topics
from koda_runtime.topics.catalogue import partition_for_key
from koda_runtime.topics.records.codec import decode_run_requested, header_value
from tests.fixtures.gateway import db_rows, dead_publisher, read_runs_topic, records_of, serve_app
from tests.fixtures.namespaces import delete_topics, drop_schema, make_settings
from tests.fixtures.runs import payload
from tests.sse_client import bearer
from tests.support import wait_until

ROOT = Path(__file__).resolve().parents[2]


# --- harness -----------------------------------------------------------------


def counts(settings: Settings) -> tuple[int, int]:
    (row,) = db_rows(
        settings, "SELECT (SELECT count(*) FROM sessions), (SELECT count(*) FROM runs)"
    )
    return row[0], row[1]


def published_at(settings: Settings, run_id: str) -> Any:
    (row,) = db_rows(settings, "SELECT published_at FROM runs WHERE id = :id", id=run_id)
    return row[0]


@dataclass(frozen=True)
class Shared:
    settings: Settings
    url: str


@pytest.fixture(scope="module")
def gw(module_env: Settings, gateway_url: str) -> Shared:
    return Shared(module_env, gateway_url)


def submit(client: httpx.Client, user: str, body: Any, key: str | None = None) -> httpx.Response:
    headers = bearer(user)
    if key is not None:
        headers["Idempotency-Key"] = key
    return client.post("/v1/runs", json=body, headers=headers)


# --- idempotency ----------------------------------------------------------------


def test_fifty_concurrent_posts_with_one_key_make_one_run(gw: Shared) -> None:
    user, key = "conc-user", "key-" + uuid.uuid4().hex
    body = {"input": "count to ten", "metadata": {"n": 1}}

    async def fire() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=50)
        async with httpx.AsyncClient(base_url=gw.url, limits=limits, timeout=60) as c:
            headers = {**bearer(user), "Idempotency-Key": key}
            return await asyncio.gather(
                *(c.post("/v1/runs", json=body, headers=headers) for _ in range(50))
            )

    responses = asyncio.run(fire())
    assert [r.status_code for r in responses] == [202] * 50
    bodies = {r.content for r in responses}
    assert len(bodies) == 1, bodies
    answer = responses[0].json()
    run_id = answer["run_id"]
    assert answer == {
        "run_id": run_id,
        "status": "pending",
        "events_url": f"/v1/runs/{run_id}/events",
        "merged": False,
    }
    rows = db_rows(
        gw.settings,
        "SELECT id, session_id FROM runs WHERE idempotency_key = :k",
        k=scoped_idempotency_key(user, key),
    )
    assert [r.id for r in rows] == [run_id]
    # the 49 replays rolled back their sessions: the user has exactly one
    assert db_rows(gw.settings, "SELECT count(*) FROM sessions WHERE user_id = :u", u=user) == [
        (1,)
    ]
    wait_until(lambda: published_at(gw.settings, run_id), what="published_at set")
    # one created run is published once; replays never publish
    assert len(records_of(gw.settings, run_id)) == 1


def test_same_key_later_returns_the_same_run_with_its_current_status(
    gw: Shared, client: httpx.Client
) -> None:
    first = submit(client, "later-user", {"input": "a"}, key="k-later")
    db_rows(
        gw.settings, "UPDATE runs SET status = 'running' WHERE id = :id", id=first.json()["run_id"]
    )
    again = submit(client, "later-user", {"input": "a"}, key="k-later")
    assert again.status_code == 202
    assert again.json() == {**first.json(), "status": "running"}
    # the same key from another user is another run
    other = submit(client, "later-user-2", {"input": "a"}, key="k-later")
    assert other.json()["run_id"] != first.json()["run_id"]


def test_without_a_key_the_derived_key_deduplicates_the_same_intent(
    client: httpx.Client,
) -> None:
    a = submit(client, "derive-user", {"input": "hi", "client_message_id": "m1"})
    b = submit(client, "derive-user", {"input": {"text": "hi"}, "client_message_id": "m1"})
    c = submit(client, "derive-user", {"input": "hi", "client_message_id": "m2"})
    assert a.status_code == b.status_code == c.status_code == 202
    assert a.json()["run_id"] == b.json()["run_id"]
    assert c.json()["run_id"] != a.json()["run_id"]


# --- what is written and published ----------------------------------------------


def test_run_row_and_published_record(gw: Shared, client: httpx.Client) -> None:
    user = "pub.user@example"
    r = submit(client, user, {"input": "hello there", "metadata": {"lang": "en"}})
    assert r.status_code == 202
    run_id = r.json()["run_id"]
    assert uuid.UUID(run_id).version == 7
    expected_partition = partition_for_key(user.encode(), gw.settings.partitions)

    (row,) = db_rows(
        gw.settings,
        "SELECT user_id, status, input, metadata, partition, attempt, session_id "
        "FROM runs WHERE id = :id",
        id=run_id,
    )
    assert row.user_id == user and row.status == "pending" and row.attempt == 0
    assert row.input == {"text": "hello there"}
    assert row.metadata == {"lang": "en"}
    assert row.partition == expected_partition
    assert db_rows(gw.settings, "SELECT user_id FROM sessions WHERE id = :s", s=row.session_id) == [
        (user,)
    ]

    wait_until(lambda: published_at(gw.settings, run_id), what="published_at set")
    (record,) = records_of(gw.settings, run_id)
    assert record.key() == user.encode()
    assert record.partition() == expected_partition
    headers = record.headers()
    assert header_value(headers, "schema") == b"run.requested/1"
    assert header_value(headers, "content-type") == b"application/json"
    decoded = decode_run_requested(record.key(), record.value(), headers)
    assert (decoded.run_id, decoded.user_id, decoded.session_id) == (run_id, user, row.session_id)
    assert "hello there" not in payload(record).decode()  # the record is a trigger, not the input


def test_sessions_belong_to_their_user(gw: Shared, client: httpx.Client) -> None:
    session = "sess-" + uuid.uuid4().hex
    a = submit(client, "sess-alice", {"input": "one", "session_id": session})
    assert a.status_code == 202
    a2 = submit(client, "sess-alice", {"input": "two", "session_id": session})
    assert a2.status_code == 202
    rows = db_rows(gw.settings, "SELECT DISTINCT session_id FROM runs WHERE user_id = 'sess-alice'")
    assert rows == [(session,)]

    before = counts(gw.settings)
    refused = {"reason": "not_found"}
    refused_before = (
        metrics.REGISTRY.get_sample_value("koda_admissions_rejected_total", refused) or 0.0
    )
    stolen = submit(client, "sess-mallory", {"input": "x", "session_id": session})
    unknown_for_mallory = submit(client, "sess-mallory", {"input": "x", "session_id": session})
    assert stolen.status_code == unknown_for_mallory.status_code == 404
    assert stolen.json() == {
        "error": {
            "code": "not_found",
            "message": "session not found: omit session_id to start a new session",
            "field": "session_id",
        }
    }
    assert counts(gw.settings) == before
    # Counted like every other refusal of a submission.
    assert (
        metrics.REGISTRY.get_sample_value("koda_admissions_rejected_total", refused)
        == refused_before + 2
    )


# --- refusals: nothing written ---------------------------------------------------


def _deep(levels: int) -> dict:
    inner: dict = {}
    for _ in range(levels - 2):
        inner = {"a": inner}
    return {"input": inner}


def _chunked(total: int) -> Iterator[bytes]:
    sent = 0
    piece = b" " * 1024
    yield b'{"input": "'
    while sent < total:
        yield piece
        sent += len(piece)
    yield b'"}'


JSON = {"Content-Type": "application/json"}

REFUSALS: list[tuple[str, dict[str, Any], int, str, str | None]] = [
    (
        "missing token",
        {"json": {"input": "x"}, "headers": {"Authorization": None}},
        401,
        "unauthorized",
        None,
    ),
    (
        "forged token",
        {"json": {"input": "x"}, "headers": {"Authorization": "Bearer forged"}},
        401,
        "unauthorized",
        None,
    ),
    (
        "bad dev user",
        {"json": {"input": "x"}, "headers": {"Authorization": "Bearer dev:a/b"}},
        401,
        "unauthorized",
        None,
    ),
    (
        "content-length over limit",
        {"content": b'{"input": "' + b"x" * (64 * 1024) + b'"}', "headers": JSON},
        413,
        "payload_too_large",
        "body",
    ),
    (
        "chunked over limit",
        {"content": lambda: _chunked(70 * 1024), "headers": JSON},
        413,
        "payload_too_large",
        "body",
    ),
    (
        "no content type",
        {"content": b'{"input": "x"}', "headers": {}},
        415,
        "unsupported_media_type",
        "Content-Type",
    ),
    (
        "form content type",
        {"content": b"input=x", "headers": {"Content-Type": "application/x-www-form-urlencoded"}},
        415,
        "unsupported_media_type",
        "Content-Type",
    ),
    ("invalid json", {"content": b'{"input": "x",}', "headers": JSON}, 400, "invalid_json", "body"),
    (
        "invalid utf-8",
        {"content": b'{"input": "caf\xe9"}', "headers": JSON},
        400,
        "invalid_utf8",
        "body",
    ),
    (
        "over-long key",
        {"json": {"input": "x"}, "headers": {"Idempotency-Key": "k" * 201}},
        400,
        "invalid_header",
        "Idempotency-Key",
    ),
    (
        "control char in key",
        {"json": {"input": "x"}, "headers": {"Idempotency-Key": "a\tb"}},
        400,
        "invalid_header",
        "Idempotency-Key",
    ),
    ("missing input", {"json": {"metadata": {}}}, 422, "invalid_field", "input"),
    ("input wrong type", {"json": {"input": 42}}, 422, "invalid_field", "input"),
    (
        "session wrong type",
        {"json": {"input": "x", "session_id": 7}},
        422,
        "invalid_field",
        "session_id",
    ),
    (
        "metadata wrong type",
        {"json": {"input": "x", "metadata": "m"}},
        422,
        "invalid_field",
        "metadata",
    ),
    ("unknown field", {"json": {"input": "x", "prompt": "y"}}, 422, "invalid_field", "prompt"),
    ("too deep", {"json": _deep(33)}, 422, "invalid_field", "input"),
    ("body not an object", {"json": ["input"]}, 422, "invalid_field", "body"),
    ("nul character", {"json": {"input": "a\u0000b"}}, 422, "invalid_field", "input"),
]


@pytest.mark.parametrize(
    ("request_kwargs", "status", "code", "field"),
    [pytest.param(*case[1:], id=case[0]) for case in REFUSALS],
)
def test_refused_requests_write_nothing(
    gw: Shared,
    request_kwargs: dict[str, Any],
    status: int,
    code: str,
    field: str | None,
) -> None:
    user = "refused-" + uuid.uuid4().hex[:8]
    kwargs = dict(request_kwargs)
    headers = {**bearer(user), **kwargs.pop("headers", {})}
    headers = {k: v for k, v in headers.items() if v is not None}
    if callable(kwargs.get("content")):
        kwargs["content"] = kwargs["content"]()  # a fresh generator: sent chunked
    before = counts(gw.settings)
    rejected_before = (
        metrics.REGISTRY.get_sample_value("koda_admissions_rejected_total", {"reason": code}) or 0.0
    )
    with httpx.Client(base_url=gw.url, timeout=30) as c:
        r = c.post("/v1/runs", headers=headers, **kwargs)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert r.json() == {"error": {"code": code, "field": field, "message": error["message"]}}
    assert error["message"]
    assert counts(gw.settings) == before
    assert (
        metrics.REGISTRY.get_sample_value("koda_admissions_rejected_total", {"reason": code})
        == rejected_before + 1
    )


def test_a_valid_32_level_body_is_accepted(client: httpx.Client) -> None:
    assert submit(client, "deep-ok", _deep(32)).status_code == 202


def test_crlf_in_idempotency_key_is_refused_on_the_wire(gw: Shared) -> None:
    before = counts(gw.settings)
    host, port = gw.url.removeprefix("http://").split(":")
    body = b'{"input": "x"}'
    request = (
        b"POST /v1/runs HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer dev:crlf-user\r\n"
        b"Content-Type: application/json\r\nIdempotency-Key: abc\rX-Injected: 1\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body
    )
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(request)
        response = b""
        while chunk := s.recv(65536):
            response += chunk
    assert response.startswith(b"HTTP/1.1 400 "), response[:200]
    assert counts(gw.settings) == before


def test_dev_tokens_are_refused_in_prod_and_prod_tokens_work(stack) -> None:
    settings = make_settings(
        stack,
        app_env=AppEnv.PROD,
        handler="openai",
        prod_tokens={"prod-secret-token-1-0123456789abcdef": "prod-user"},
    )
    apply_topics(settings)
    upgrade(settings)
    try:
        with serve_app(create_app(settings)) as url, httpx.Client(base_url=url) as c:
            r = c.post("/v1/runs", json={"input": "x"}, headers=bearer("prod-user"))
            assert r.status_code == 401
            assert r.json()["error"]["code"] == "unauthorized"
            assert counts(settings) == (0, 0)
            ok = c.post(
                "/v1/runs",
                json={"input": "x"},
                headers={"Authorization": "Bearer prod-secret-token-1-0123456789abcdef"},
            )
            assert ok.status_code == 202, ok.text
            run_id = ok.json()["run_id"]
            assert db_rows(settings, "SELECT user_id FROM runs") == [("prod-user",)]
            r = c.get(f"/v1/runs/{run_id}", headers=bearer("prod-user"))
            assert r.status_code == 401
    finally:
        delete_topics(settings)
        drop_schema(settings)


def test_rate_limit_answers_429_with_retry_after_and_writes_nothing(
    module_env: Settings,
) -> None:
    # one token per 20 s: the refill during the first three requests cannot add a fourth
    settings = module_env.with_(rate_per_s=0.05, rate_burst=3)
    user = "quota-" + uuid.uuid4().hex[:8]
    with (
        serve_app(create_app(settings, run_sweeper=False)) as url,
        httpx.Client(base_url=url, timeout=30) as c,
    ):
        accepted = [
            c.post("/v1/runs", json={"input": f"n{i}"}, headers=bearer(user)) for i in range(3)
        ]
        assert [r.status_code for r in accepted] == [202, 202, 202]
        before = counts(settings)
        rejected_before = (
            metrics.REGISTRY.get_sample_value(
                "koda_admissions_rejected_total", {"reason": "rate_limited"}
            )
            or 0.0
        )
        r = c.post("/v1/runs", json={"input": "n3"}, headers=bearer(user))
        assert r.status_code == 429
        retry_after = r.headers["Retry-After"]
        assert retry_after.isdigit() and int(retry_after) >= 1
        assert r.json()["error"]["code"] == "rate_limited"
        assert counts(settings) == before
        assert (
            metrics.REGISTRY.get_sample_value(
                "koda_admissions_rejected_total", {"reason": "rate_limited"}
            )
            == rejected_before + 1
        )
        # another user has a bucket of their own
        other = c.post("/v1/runs", json={"input": "x"}, headers=bearer(user + "-b"))
        assert other.status_code == 202


# --- reading runs ------------------------------------------------------------------


def test_get_run_shows_output_after_the_last_reset(gw: Shared, client: httpx.Client) -> None:
    run_id = submit(client, "reader", {"input": "story"}).json()["run_id"]
    r = client.get(f"/v1/runs/{run_id}", headers=bearer("reader"))
    assert r.status_code == 200
    view = r.json()
    assert view["status"] == "pending" and view["output"] == "" and view["attempt"] == 0
    assert view["started_at"] is None and view["error"] is None

    db_rows(
        gw.settings,
        "UPDATE runs SET status = 'done', attempt = 2, started_at = now(), "
        "first_chunk_at = now(), finished_at = now() WHERE id = :id",
        id=run_id,
    )
    for seq, kind, content in [
        (0, "chunk", "Once "),
        (1, "chunk", "upon"),
        (2, "reset", ""),
        (3, "chunk", "Once upon "),
        (4, "chunk", "a time"),
        (5, "done", "{}"),
    ]:
        db_rows(
            gw.settings,
            "INSERT INTO messages (run_id, seq, kind, content, attempt) VALUES (:r, :s, :k, :c, 1)",
            r=run_id,
            s=seq,
            k=kind,
            c=content,
        )
    view = client.get(f"/v1/runs/{run_id}", headers=bearer("reader")).json()
    assert view["status"] == "done" and view["attempt"] == 2
    assert view["output"] == "Once upon a time"
    assert set(view) == {
        "run_id",
        "status",
        "attempt",
        "session_id",
        "created_at",
        "started_at",
        "first_chunk_at",
        "finished_at",
        "error",
        "output",
        "schedule_id",
        "scheduled_for",
        "created_by",
    }
    assert all(view[k] for k in ("created_at", "started_at", "first_chunk_at", "finished_at"))
    assert view["schedule_id"] is None and view["scheduled_for"] is None  # a person's run


def test_another_users_run_is_404_like_an_unknown_run(client: httpx.Client) -> None:
    run_id = submit(client, "owner", {"input": "private"}).json()["run_id"]
    theirs = client.get(f"/v1/runs/{run_id}", headers=bearer("intruder"))
    unknown = client.get(f"/v1/runs/{uuid7()}", headers=bearer("intruder"))
    assert theirs.status_code == unknown.status_code == 404
    assert theirs.json() == unknown.json()
    assert client.get(f"/v1/runs/{run_id}", headers=bearer("owner")).status_code == 200
    assert client.get(f"/v1/runs/{run_id}").status_code == 401


# --- health, metrics, OpenAPI --------------------------------------------------------


def test_health_metrics_and_openapi(client: httpx.Client) -> None:
    assert client.get("/livez").json()["status"] == "ok"
    ready = client.get("/readyz")
    assert ready.status_code == 200
    assert ready.json() == {"status": "ok", "checks": {"postgres": "ok", "kafka": "ok"}}
    text_ = client.get("/metrics").text
    assert 'koda_http_requests_total{method="GET",route="/readyz",status="200"}' in text_
    assert "koda_admissions_total" in text_
    spec = client.get("/openapi.json").json()
    assert "/v1/runs" in spec["paths"] and "/v1/runs/{run_id}" in spec["paths"]


def test_readyz_is_503_when_the_runs_topic_is_missing(stack) -> None:
    settings = make_settings(stack)  # no topics created
    upgrade(settings)
    try:
        with (
            serve_app(create_app(settings, run_sweeper=False)) as url,
            httpx.Client(base_url=url, timeout=30) as c,
        ):
            r = c.get("/readyz")
            assert r.status_code == 503
            assert r.json()["checks"]["postgres"] == "ok"
            assert r.json()["checks"]["kafka"] != "ok"
            assert c.get("/livez").status_code == 200
    finally:
        drop_schema(settings)


# --- publish failures and the sweeper ------------------------------------------------


def _insert_run(
    settings: Settings, *, user: str, age_s: float, status: str = "pending", published: bool = False
) -> str:
    run_id, session_id = uuid7(), uuid7()
    db_rows(settings, "INSERT INTO sessions (id, user_id) VALUES (:s, :u)", s=session_id, u=user)
    db_rows(
        settings,
        "INSERT INTO runs (id, session_id, user_id, idempotency_key, status, input, partition, "
        "created_at, published_at) VALUES (:id, :s, :u, :k, :st, CAST(:inp AS jsonb), :p, "
        "now() - make_interval(secs => :age), CASE WHEN :pub THEN now() END)",
        id=run_id,
        s=session_id,
        u=user,
        k="test:" + run_id,
        st=status,
        inp=json.dumps({"text": "x"}),
        p=partition_for_key(user.encode(), settings.partitions),
        age=age_s,
        pub=published,
    )
    return run_id


async def test_sweep_once_republishes_stale_unpublished_pending_runs(env: Settings) -> None:
    stale = _insert_run(env, user="sweep-user", age_s=3600)
    fresh = _insert_run(env, user="sweep-user", age_s=0)
    running_run = _insert_run(env, user="sweep-user", age_s=3600, status="running")
    published = _insert_run(env, user="sweep-user", age_s=3600, published=True)
    gw = build_components(env.with_(sweep_after_s=30))
    await gw.publisher.start()
    try:
        assert await gw.sweeper.sweep_once() == 1
        assert await gw.sweeper.sweep_once() == 0
    finally:
        await gw.publisher.stop()
        await gw.engine.dispose()
    assert published_at(env, stale) is not None
    assert published_at(env, fresh) is None
    assert published_at(env, running_run) is None
    (record,) = [m for m in read_runs_topic(env)]
    assert json.loads(payload(record))["run_id"] == stale
    assert record.key() == b"sweep-user"
    assert record.partition() == partition_for_key(b"sweep-user", env.partitions)
    assert header_value(record.headers(), "schema") == b"run.requested/1"
    assert published not in payload(record).decode()


async def test_a_failed_sweep_releases_its_claim(env: Settings) -> None:
    stale = _insert_run(env, user="sweep-fail", age_s=3600)
    publisher = dead_publisher(env)
    gw = build_components(env.with_(sweep_after_s=30), publisher=publisher)
    await publisher.start()
    try:
        assert await gw.sweeper.sweep_once() == 0
    finally:
        await publisher.stop(timeout_s=0)
        await gw.engine.dispose()
    assert published_at(env, stale) is None  # eligible for the next sweep


def test_a_lost_publish_leaves_the_run_pending_until_the_sweeper_publishes_it(
    env: Settings,
) -> None:
    publisher = dead_publisher(env)
    failed_before = (
        metrics.REGISTRY.get_sample_value("koda_publish_total", {"outcome": "failed"}) or 0.0
    )
    app = create_app(env, components=build_components(env, publisher=publisher), run_sweeper=False)
    with (
        serve_app(app) as url,
        httpx.Client(base_url=url, timeout=30) as c,
    ):
        started = time.monotonic()
        r = c.post("/v1/runs", json={"input": "x"}, headers=bearer("lost-user"))
        elapsed = time.monotonic() - started
        assert r.status_code == 202
        assert elapsed < 10
        run_id = r.json()["run_id"]
        wait_until(
            lambda: (
                (
                    metrics.REGISTRY.get_sample_value("koda_publish_total", {"outcome": "failed"})
                    or 0.0
                )
                > failed_before
            ),
            what="the delivery failure",
        )
    asyncio.run(publisher.stop(timeout_s=0))
    (row,) = db_rows(env, "SELECT status, published_at FROM runs WHERE id = :id", id=run_id)
    assert row.status == "pending" and row.published_at is None
    assert read_runs_topic(env) == []

    async def sweep() -> int:
        gw = build_components(env.with_(sweep_after_s=0.1))
        await gw.publisher.start()
        try:
            return await gw.sweeper.sweep_once()
        finally:
            await gw.publisher.stop()
            await gw.engine.dispose()

    assert asyncio.run(sweep()) == 1
    assert published_at(env, run_id) is not None
    (record,) = read_runs_topic(env)
    assert json.loads(payload(record))["run_id"] == run_id


# --- the command line ------------------------------------------------------------------


def test_runs_submit_and_wait(gw: Shared) -> None:
    runner = CliRunner()
    result = runner.invoke(
        runs_app,
        ["submit", "hi from cli", "--user", "cli-user", "--gateway", gw.url, "--key", "cli-1"],
    )
    assert result.exit_code == 0, result.output
    run_id = result.stdout.strip()
    assert db_rows(gw.settings, "SELECT user_id FROM runs WHERE id = :id", id=run_id) == [
        ("cli-user",)
    ]
    db_rows(
        gw.settings,
        "UPDATE runs SET status = 'done', finished_at = now() WHERE id = :id",
        id=run_id,
    )
    db_rows(
        gw.settings,
        "INSERT INTO messages (run_id, seq, kind, content, attempt) "
        "VALUES (:r, 0, 'chunk', 'hello back', 1)",
        r=run_id,
    )
    result = runner.invoke(
        runs_app,
        [
            "submit",
            "hi from cli",
            "--user",
            "cli-user",
            "--gateway",
            gw.url,
            "--key",
            "cli-1",
            "--wait",
        ],
    )
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == "hello back"

    bad = runner.invoke(runs_app, ["submit", "x", "--user", "no/slash", "--gateway", gw.url])
    assert bad.exit_code == 2
    assert "401" in bad.stderr


def test_serve_stops_gracefully_on_sigterm(env: Settings) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    child_env = {
        **os.environ,
        "APP_ENV": "dev",
        "KODA_KAFKA_BOOTSTRAP": env.kafka_bootstrap,
        "KODA_DATABASE_URL": env.database_url,
        "KODA_NAMESPACE": env.namespace or "",
        "KODA_PARTITIONS": str(env.partitions),
        "KODA_GATEWAY_PORT": str(port),
    }
    code = (
        "from koda_runtime.gateway.server import serve; "
        "from koda_runtime.settings import Settings; "
        "serve(Settings.from_env())"
    )
    proc = subprocess.Popen(  # noqa: S603
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=child_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            try:
                return httpx.get(f"{url}/readyz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return proc.poll() is not None

        wait_until(ready, timeout=60, what="gateway process ready")
        assert proc.poll() is None
        r = httpx.post(f"{url}/v1/runs", json={"input": "x"}, headers=bearer("sig-user"))
        assert r.status_code == 202
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-2000:]
    assert "event=gateway_stopped" in err
    assert "dev:" not in err  # tokens are never logged
    assert "event=run_admitted" in err and "user_id=sig-user" in err
