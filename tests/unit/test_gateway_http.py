"""The HTTP edge without services: every refusal happens before Postgres or Kafka.

The app's components come from ``build_components`` but its lifespan is not run:
the engine and the producer are never connected, so a test that reached them would
fail.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from koda_runtime import metrics
from koda_runtime.gateway.app import create_app
from koda_runtime.gateway.bootstrap import build_components
from koda_runtime.naming import AppEnv
from koda_runtime.settings import Settings

UNREACHABLE = Settings(
    app_env=AppEnv.DEV,
    kafka_bootstrap="127.0.0.1:1",
    database_url="postgresql://nobody@127.0.0.1:1/none",
    namespace="unit",
    body_limit_bytes=1024,
    rate_per_s=0.01,
    rate_burst=2,
)


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    components = build_components(UNREACHABLE)
    app = create_app(UNREACHABLE, components=components)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
        yield c
    await components.engine.dispose()


def auth(user: str = "alice") -> dict[str, str]:
    return {"Authorization": f"Bearer dev:{user}"}


def assert_error(response: httpx.Response, status: int, code: str, field: str | None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"code", "message", "field"}
    assert body["error"]["code"] == code
    assert body["error"]["field"] == field
    assert body["error"]["message"]
    return body["error"]


async def test_missing_and_forged_tokens_are_401(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/runs", json={"input": "x"})
    assert_error(r, 401, "unauthorized", None)
    assert r.headers["www-authenticate"].startswith("Bearer")
    r = await client.post("/v1/runs", json={"input": "x"}, headers={"Authorization": "Bearer x"})
    assert_error(r, 401, "unauthorized", None)
    r = await client.get("/v1/runs/abc", headers={"Authorization": "Bearer dev:bad user"})
    assert_error(r, 401, "unauthorized", None)


async def test_crlf_in_idempotency_key_is_400_naming_the_header(
    client: httpx.AsyncClient,
) -> None:
    # Raw ASGI headers: an HTTP/1.1 parser would refuse the bytes before the app,
    # but other servers and proxies may hand them over.
    r = await client.post(
        "/v1/runs",
        json={"input": "x"},
        headers=[*auth().items(), ("Idempotency-Key", "abc\r\nX-Injected: 1")],
    )
    error = assert_error(r, 400, "invalid_header", "Idempotency-Key")
    assert "Idempotency-Key" in error["message"]


async def test_over_long_idempotency_key_is_400(client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/v1/runs", json={"input": "x"}, headers={**auth(), "Idempotency-Key": "k" * 201}
    )
    assert_error(r, 400, "invalid_header", "Idempotency-Key")


async def test_refusals_in_order_and_counted(client: httpx.AsyncClient) -> None:
    before = (
        metrics.REGISTRY.get_sample_value(
            "koda_admissions_rejected_total", {"reason": "unsupported_media_type"}
        )
        or 0.0
    )
    r = await client.post(
        "/v1/runs", content=b"{}", headers={**auth(), "Content-Type": "text/plain"}
    )
    assert_error(r, 415, "unsupported_media_type", "Content-Type")
    after = metrics.REGISTRY.get_sample_value(
        "koda_admissions_rejected_total", {"reason": "unsupported_media_type"}
    )
    assert after == before + 1
    r = await client.post(
        "/v1/runs", content=b"x" * 2000, headers={**auth("bob"), "Content-Type": "application/json"}
    )
    assert_error(r, 413, "payload_too_large", "body")
    # the database is unreachable: a valid request gets 503 with Retry-After, not a 500
    unavailable = metrics.REGISTRY.get_sample_value(
        "koda_admissions_rejected_total", {"reason": "unavailable"}
    )
    r = await client.post("/v1/runs", json={"input": "x"}, headers=auth("bob"))
    assert_error(r, 503, "unavailable", None)
    assert (
        metrics.REGISTRY.get_sample_value(
            "koda_admissions_rejected_total", {"reason": "unavailable"}
        )
        == (unavailable or 0.0) + 1
    )
    assert int(r.headers["retry-after"]) >= 1
    # bob's burst of 2 is spent: the third request is refused before its body is read
    r = await client.post("/v1/runs", json={"input": "x"}, headers=auth("bob"))
    assert_error(r, 429, "rate_limited", None)
    assert int(r.headers["retry-after"]) >= 1


async def test_json_and_field_errors(client: httpx.AsyncClient) -> None:
    h = {**auth("carol"), "Content-Type": "application/json"}
    r = await client.post("/v1/runs", content=b'{"input": ', headers=h)
    assert_error(r, 400, "invalid_json", "body")
    r = await client.post("/v1/runs", json={"input": 1}, headers=auth("dave"))
    assert_error(r, 422, "invalid_field", "input")


async def test_fastapi_errors_have_the_same_shape(client: httpx.AsyncClient) -> None:
    assert_error(await client.get("/nowhere"), 404, "not_found", None)
    assert_error(await client.delete("/v1/runs"), 405, "method_not_allowed", None)


async def test_livez_and_openapi(client: httpx.AsyncClient) -> None:
    r = await client.get("/livez")
    assert r.status_code == 200 and r.json()["status"] == "ok"
    spec = (await client.get("/openapi.json")).json()
    assert {"/v1/runs", "/v1/runs/{run_id}", "/livez", "/readyz"} <= set(spec["paths"])
    post = spec["paths"]["/v1/runs"]["post"]
    assert "202" in post["responses"] and "429" in post["responses"]
    schema = post["requestBody"]["content"]["application/json"]["schema"]
    assert "input" in schema["required"]
    assert any(p["name"] == "Idempotency-Key" for p in post["parameters"])
    assert "HTTPBearer" in spec["components"]["securitySchemes"]


async def test_metrics_endpoint_exposes_koda_families(client: httpx.AsyncClient) -> None:
    await client.get("/livez")
    r = await client.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    text = r.text
    for family in (
        "koda_runs_total",
        "koda_run_duration_seconds",
        "koda_time_to_first_chunk_seconds",
        "koda_queue_age_seconds",
        "koda_runs_in_flight",
        "koda_consumer_lag",
        "koda_rebalances_total",
        "koda_handoff_seconds",
        "koda_dead_letters_total",
        "koda_retries_total",
        "koda_sse_connections",
        "koda_admissions_rejected_total",
        "koda_http_requests_total",
        "koda_http_request_seconds",
    ):
        assert f"# TYPE {family.removesuffix('_total')}" in text, family
    assert 'koda_http_requests_total{method="GET",route="/livez",status="200"}' in text


async def test_metrics_answer_without_postgres_and_say_the_budget_count_is_unknown(
    client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    metrics.BUDGET_EXHAUSTED_USERS.set(3)  # a count from before Postgres went away
    r = await client.get("/metrics")
    assert r.status_code == 200
    assert "koda_budget_exhausted_users NaN" in r.text
    assert "event=budget_count_failed" in caplog.text
