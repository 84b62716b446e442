"""``GET /admin/workers`` without services: the report shape and who may read it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta

import httpx

from koda_runtime import metrics
from koda_runtime.gateway.app import create_app
from koda_runtime.gateway.bootstrap import build_components
from koda_runtime.naming import AppEnv
from koda_runtime.settings import Settings
from koda_runtime.topics.records.heartbeats import Beat

BASE = Settings(
    app_env=AppEnv.DEV,
    kafka_bootstrap="127.0.0.1:1",
    database_url="postgresql://nobody@127.0.0.1:1/none",
    namespace="unit",
    expected_workers=2,
)
PROD = BASE.with_(app_env=AppEnv.PROD, handler="openai", kafka_allow_plaintext=True)


@asynccontextmanager
async def client_for(settings: Settings) -> AsyncIterator[httpx.AsyncClient]:
    """The app with its components built (its lifespan does not run: nothing connects)."""
    components = build_components(settings)
    app = create_app(settings, components=components)
    directory = components.workers  # not started: filled by hand below
    now = datetime.now(UTC)
    # w-1 is claimed by two live processes (their beats interleave): a conflict.
    for worker_id, age_s, pid, instance in (
        ("w-1", 2.0, 11, "i-a"),
        ("w-1", 1.5, 12, "i-b"),
        ("w-1", 1.0, 11, "i-a"),
        ("w-2", 60.0, 13, "i-c"),
    ):
        beat = Beat(
            worker_id, now - timedelta(seconds=age_s), 1, "v9", (0, 2), "node", pid, instance
        )
        directory.table.apply(worker_id.encode(), beat.encode())
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://gw"
        ) as client:
            yield client
    finally:
        await components.engine.dispose()


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def test_report_shape_in_dev_is_open() -> None:
    async with client_for(BASE) as client:
        r = await client.get("/admin/workers")
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["status"], body["expected"], body["alive"], body["stale"]) == ("degraded", 2, 1, 1)
    w1, w2 = body["workers"]
    assert set(w1) == {
        "worker_id",
        "lastBeatMs",
        "in_flight",
        "version",
        "partitions",
        "host",
        "pid",
        "instance",
        "stale",
        "conflict",
    }
    assert (w1["pid"], w1["instance"], w1["conflict"], w2["conflict"]) == (11, "i-a", True, False)
    (conflict,) = body["conflicts"]
    assert conflict["worker_id"] == "w-1"
    assert [(p["host"], p["pid"], p["instance"], p["stale"]) for p in conflict["processes"]] == [
        ("node", 11, "i-a", False),
        ("node", 12, "i-b", False),
    ]
    assert (w1["worker_id"], w1["stale"], w1["partitions"], w1["version"]) == (
        "w-1",
        False,
        [0, 2],
        "v9",
    )
    assert 900 <= w1["lastBeatMs"] < 30_000
    assert (w2["worker_id"], w2["stale"]) == ("w-2", True)


async def test_a_configured_token_is_required_in_any_environment() -> None:
    cases: list[tuple[Settings, Callable[[], dict[str, str]], int]] = [
        (BASE.with_(admin_token="s3cret"), dict, 401),
        (BASE.with_(admin_token="s3cret"), lambda: bearer("wrong"), 401),
        (BASE.with_(admin_token="s3cret"), lambda: bearer("dev:alice"), 401),
        (BASE.with_(admin_token="s3cret"), lambda: bearer("s3cret"), 200),
        (PROD, dict, 403),
        (PROD, lambda: bearer("s3cret"), 403),
        # prod refuses admin tokens under 32 characters
        (PROD.with_(admin_token="s3cret" * 6), lambda: bearer("wrong"), 401),
        (PROD.with_(admin_token="s3cret" * 6), lambda: bearer("s3cret" * 6), 200),
    ]
    for settings, headers, status in cases:
        async with client_for(settings) as client:
            r = await client.get("/admin/workers", headers=headers())
        assert r.status_code == status, (settings.app_env, headers(), r.text)
        if status != 200:
            assert set(r.json()["error"]) == {"code", "message", "field"}
            assert "s3cret" not in r.text


async def test_openapi_documents_the_admin_and_health_routes() -> None:
    async with client_for(BASE) as client:
        paths = (await client.get("/openapi.json")).json()["paths"]
    assert {"/admin/workers", "/livez", "/readyz"} <= set(paths)


async def test_metrics_count_alive_and_stale_workers_at_scrape_time() -> None:
    metrics.WORKERS.labels(state="alive").set(-1)  # whatever the tail set last
    metrics.WORKERS.labels(state="stale").set(-1)
    async with client_for(BASE) as client:
        r = await client.get("/metrics")
    assert r.status_code == 200
    assert 'koda_workers{state="alive"} 1.0' in r.text
    assert 'koda_workers{state="stale"} 1.0' in r.text
    assert "koda_workers_expected 2.0" in r.text
