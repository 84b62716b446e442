"""The ``{run_id}`` path parameter, written once (gateway/dependencies.py ``RunId``).

Failure mode: a route that takes the id as a bare ``str`` sends an id no run can have to
Postgres: NUL fails there as a database error (a 503 for what is a client's unknown id),
and an over-long id costs a query. Every run route must answer such an id with the 404
of an unknown run before any read, and only after the token was checked (401 first).
The app's database here is unreachable: a route that reached it would answer 503.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from koda_runtime.gateway.app import create_app
from koda_runtime.gateway.bootstrap import build_components
from koda_runtime.gateway.dependencies import (
    MAX_RUN_ID_CHARS,
    possible_run_id,
    run_id_path,
    run_not_found,
)
from koda_runtime.gateway.errors import NotFound
from koda_runtime.naming import AppEnv
from koda_runtime.settings import Settings

UNREACHABLE = Settings(
    app_env=AppEnv.DEV,
    kafka_bootstrap="127.0.0.1:1",
    database_url="postgresql://nobody@127.0.0.1:1/none",
    namespace="unit",
)
AUTH = {"Authorization": "Bearer dev:alice"}
ROUTES = [
    ("GET", "/v1/runs/{}"),
    ("POST", "/v1/runs/{}/stream-ticket"),
    ("GET", "/v1/runs/{}/events"),
    ("POST", "/v1/runs/{}/cancel"),
    ("GET", "/v1/runs/{}/timeline"),
    ("POST", "/v1/runs/{}/approve"),
    ("POST", "/v1/runs/{}/reject"),
]
IMPOSSIBLE = {"too-long": "r" * (MAX_RUN_ID_CHARS + 1), "nul": "run%00id"}


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    components = build_components(UNREACHABLE)
    app = create_app(UNREACHABLE, components=components)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
        yield c
    await components.engine.dispose()


def test_possible_run_ids() -> None:
    assert possible_run_id("0190f1c2-aaaa-7bbb-8ccc-0123456789ab")
    assert possible_run_id("r" * MAX_RUN_ID_CHARS)
    assert not possible_run_id("r" * (MAX_RUN_ID_CHARS + 1))
    assert not possible_run_id("")
    assert not possible_run_id("a\x00b")


async def test_the_parameter_refuses_an_impossible_id_as_not_found() -> None:
    assert await run_id_path("run-1") == "run-1"
    with pytest.raises(NotFound) as raised:
        await run_id_path("a\x00b")
    expected = run_not_found()
    assert (raised.value.status, raised.value.message, raised.value.field) == (
        404,
        expected.message,
        "run_id",
    )


@pytest.mark.parametrize("which", list(IMPOSSIBLE))
@pytest.mark.parametrize(("method", "path"), ROUTES, ids=[p for _, p in ROUTES])
async def test_every_run_route_answers_an_impossible_id_404_before_any_read(
    client: httpx.AsyncClient, method: str, path: str, which: str
) -> None:
    r = await client.request(method, path.format(IMPOSSIBLE[which]), headers=AUTH)
    assert r.status_code == 404, r.text
    assert r.json() == {
        "error": {
            "code": "not_found",
            "message": "run not found: check the run id and the token's user",
            "field": "run_id",
        }
    }


@pytest.mark.parametrize(("method", "path"), ROUTES, ids=[p for _, p in ROUTES])
async def test_the_token_is_checked_before_the_id(
    client: httpx.AsyncClient, method: str, path: str
) -> None:
    r = await client.request(method, path.format(IMPOSSIBLE["too-long"]))
    assert r.status_code == 401, r.text


async def test_openapi_names_the_parameter_once_per_route(client: httpx.AsyncClient) -> None:
    spec = (await client.get("/openapi.json")).json()
    for method, path in ROUTES:
        operation = spec["paths"][path.format("{run_id}")][method.lower()]
        names = [(p["in"], p["name"]) for p in operation.get("parameters", [])]
        assert names.count(("path", "run_id")) == 1, (path, names)
