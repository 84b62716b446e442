"""``POST /v1/runs`` through the ASGI shortcut (gateway/submit.py) answers exactly as the
FastAPI route does, refusal by refusal, and only that endpoint takes the shortcut.

No services: Postgres is unreachable, so a request that passes every check ends in
the 503 of a database outage, on both paths.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from koda_runtime import metrics
from koda_runtime.gateway.app import create_app
from koda_runtime.gateway.bootstrap import build_components
from koda_runtime.gateway.routes import router
from koda_runtime.gateway.submit import METHOD, PATH, SubmitShortcut
from tests.unit.test_gateway_http import UNREACHABLE

OK_JSON = {"Content-Type": "application/json"}


def _auth(user: str) -> dict[str, str]:
    return {"Authorization": f"Bearer dev:{user}"}


# (name, headers, body): each refused at a different check, the last admitted (then 503).
CASES: list[tuple[str, dict[str, str] | list[tuple[str, str]], bytes]] = [
    ("no token", OK_JSON, b'{"input": "x"}'),
    ("forged token", {**OK_JSON, "Authorization": "Bearer x"}, b'{"input": "x"}'),
    ("no content type", _auth("a1"), b'{"input": "x"}'),
    ("xml", {**_auth("a2"), "Content-Type": "application/xml"}, b"<x/>"),
    ("latin-1", {**_auth("a3"), "Content-Type": "application/json; charset=latin-1"}, b"{}"),
    (
        "two keys",
        [
            *_auth("a4").items(),
            *OK_JSON.items(),
            ("Idempotency-Key", "a"),
            ("Idempotency-Key", "b"),
        ],
        b'{"input": "x"}',
    ),
    ("key too long", {**_auth("a5"), **OK_JSON, "Idempotency-Key": "k" * 201}, b'{"input": 1}'),
    ("too large", {**_auth("a6"), **OK_JSON}, b'{"input": "' + b"x" * 2000 + b'"}'),
    ("bad length", {**_auth("a7"), **OK_JSON, "Content-Length": "x"}, b"{}"),
    ("empty", {**_auth("a8"), **OK_JSON}, b""),
    ("bad utf-8", {**_auth("a9"), **OK_JSON}, b'{"input": "\xff"}'),
    ("bad json", {**_auth("b1"), **OK_JSON}, b'{"input": '),
    ("no input", {**_auth("b2"), **OK_JSON}, b'{"metadata": {}}'),
    ("unknown field", {**_auth("b3"), **OK_JSON}, b'{"input": "x", "extra": 1}'),
    ("bad session", {**_auth("b4"), **OK_JSON}, b'{"input": "x", "session_id": "a b"}'),
    ("admitted: Postgres is away", {**_auth("b5"), **OK_JSON}, b'{"input": "x"}'),
]
COMPARED_HEADERS = ("content-type", "www-authenticate", "retry-after")


@pytest.fixture
async def apps() -> AsyncIterator[tuple[httpx.AsyncClient, httpx.AsyncClient]]:
    """(with the shortcut, without it): the same app, but for the shortcut."""
    components = build_components(UNREACHABLE)
    shortcut = create_app(UNREACHABLE, components=components)
    routed = create_app(UNREACHABLE, components=components)
    routed.user_middleware = [
        m
        for m in routed.user_middleware
        if m.cls is not SubmitShortcut  # type: ignore[comparison-overlap]
    ]
    assert len(routed.user_middleware) == len(shortcut.user_middleware) - 1
    async with (
        httpx.AsyncClient(transport=httpx.ASGITransport(app=shortcut), base_url="http://gw") as a,
        httpx.AsyncClient(transport=httpx.ASGITransport(app=routed), base_url="http://gw") as b,
    ):
        yield a, b
    await components.engine.dispose()


def _answer(r: httpx.Response) -> tuple[int, dict[str, str], bytes]:
    return r.status_code, {h: r.headers.get(h, "") for h in COMPARED_HEADERS}, r.content


@pytest.mark.parametrize(("name", "headers", "body"), CASES, ids=[c[0] for c in CASES])
async def test_every_answer_is_the_routes_answer(
    apps: tuple[httpx.AsyncClient, httpx.AsyncClient],
    name: str,
    headers: Any,
    body: bytes,
) -> None:
    shortcut, routed = apps
    # Each path gets its own user (the rate limit allows two requests per user).
    if isinstance(headers, dict) and "Authorization" in headers:
        other = {**headers, "Authorization": headers["Authorization"] + "-r"}
    else:
        other = headers
    a = await shortcut.post(PATH, content=body, headers=headers)
    b = await routed.post(PATH, content=body, headers=other)
    assert a.status_code >= 400, a.text
    assert _answer(a) == _answer(b), name


async def test_the_rate_limit_answers_alike(
    apps: tuple[httpx.AsyncClient, httpx.AsyncClient],
) -> None:
    refused = []
    for client, user in zip(apps, ("rl-a", "rl-b"), strict=True):
        answers = [
            await client.post(PATH, content=b"<", headers={**_auth(user), **OK_JSON})
            for _ in range(3)
        ]
        assert [r.status_code for r in answers] == [400, 400, 429]
        refused.append(answers[-1])
    assert _answer(refused[0]) == _answer(refused[1])


async def test_requests_through_the_shortcut_are_counted_under_the_route(
    apps: tuple[httpx.AsyncClient, httpx.AsyncClient],
) -> None:
    shortcut, _ = apps
    label = f'koda_http_requests_total{{method="POST",route="{PATH}",status="401"}}'

    def count() -> float:
        for line in metrics.render().decode().splitlines():
            if line.startswith(label):
                return float(line.rpartition(" ")[2])
        return 0.0

    before = count()
    await shortcut.post(PATH, json={"input": "x"})
    assert count() == before + 1


async def test_only_post_v1_runs_takes_the_shortcut() -> None:
    components = build_components(UNREACHABLE)
    reached: list[tuple[str, str]] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        reached.append((scope["method"], scope["path"]))
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    route = next(r for r in router.routes if getattr(r, "path", None) == PATH)
    shortcut = SubmitShortcut(app, components, route)
    transport = httpx.ASGITransport(app=shortcut)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            assert (await client.post(PATH, json={"input": "x"})).status_code == 401
            for method, path in (("GET", PATH), ("POST", PATH + "/"), ("POST", "/v1/runsx")):
                assert (await client.request(method, path)).status_code == 204
    finally:
        await components.engine.dispose()
    assert reached == [("GET", PATH), ("POST", PATH + "/"), ("POST", "/v1/runsx")]
    assert METHOD == "POST"
