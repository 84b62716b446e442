"""What prod refuses at start (weak, placeholder, shared or repeated tokens), failed logins
throttled per client address, stream tickets, the console's headers and /admin guarded as
a whole: all without services (the app's components are built, never connected)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from fastapi.routing import APIRoute
from starlette.routing import BaseRoute, Mount

from koda_runtime.errors import ConfigError
from koda_runtime.gateway.app import create_app, is_admin_path
from koda_runtime.gateway.auth import (
    FailedLogins,
    StreamTickets,
    TooManyFailedLogins,
    ticket_secret,
)
from koda_runtime.gateway.bootstrap import build_components
from koda_runtime.gateway.console import CSP
from koda_runtime.gateway.dependencies import admin_access
from koda_runtime.gateway.errors import Unauthorized
from koda_runtime.naming import AppEnv
from koda_runtime.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
# Nothing listens there: a process that tried to connect would fail, not pass.
UNREACHABLE = {
    "KODA_KAFKA_BOOTSTRAP": "127.0.0.1:1",
    "KODA_DATABASE_URL": "postgresql://nobody@127.0.0.1:1/none",
}
PROD = {
    "APP_ENV": "prod",
    "KODA_HANDLER": "openai",
    "KODA_KAFKA_ALLOW_PLAINTEXT": "true",
    **UNREACHABLE,
}
ALICE = "alice-token-4f1c9e2b7a6d3058e1b2c4d6f8a0b3c5"
BOB = "bob-token-9a8b7c6d5e4f30112233445566778899"
ADMIN = "admin-token-0f1e2d3c4b5a69788796a5b4c3d2e1f0"


def prod(**env: str) -> Settings:
    return Settings.from_env({**PROD, **env})


def refusal(**env: str) -> str:
    with pytest.raises(ConfigError) as refused:
        prod(**env)
    return str(refused.value)


# --- what prod refuses at start -------------------------------------------------


@pytest.mark.parametrize(
    ("env", "says", "secret"),
    [
        (
            {"KODA_API_TOKENS": "tok-short:alice"},
            "the token of user 'alice' is 9 characters",
            "tok-short",
        ),
        (
            {"KODA_API_TOKENS": "REPLACE_ME_TOKEN_4f1c9e2b7a6d3058e1b2:alice"},
            "the token of user 'alice' is a placeholder",
            "REPLACE_ME_TOKEN_4f1c9e2b7a6d3058e1b2",
        ),
        (
            {"KODA_API_TOKENS": f"{ALICE}:alice,changeme-{BOB}:bob"},
            "the token of user 'bob' is a placeholder",
            f"changeme-{BOB}",
        ),
        ({"KODA_API_TOKENS": "a" * 40 + ":alice"}, "fewer than 6 different characters", "a" * 40),
        (
            {"KODA_API_TOKENS": f"{ALICE}:alice", "KODA_ADMIN_TOKEN": "s3cret"},
            "KODA_ADMIN_TOKEN is 6 characters",
            "s3cret",
        ),
        (
            {"KODA_API_TOKENS": f"{ALICE}:alice,{BOB}:bob", "KODA_ADMIN_TOKEN": BOB},
            "KODA_ADMIN_TOKEN is also the KODA_API_TOKENS token of user 'bob'",
            BOB,
        ),
        (
            {"KODA_API_TOKENS": f"{ALICE}:alice,{ALICE}:mallory"},
            "entry 2 (user 'mallory') repeats the token of user 'alice'",
            ALICE,
        ),
        ({"KODA_API_TOKENS": f"{ALICE}:ali ce"}, "user id 'ali ce' is not 1-128 chars", ALICE),
        ({"KODA_API_TOKENS": f"{ALICE}:alice\nx"}, "user id 'alice\\nx' is not", ALICE),
        (
            {"KODA_STREAM_TICKET_SECRET": "tickets"},
            "KODA_STREAM_TICKET_SECRET is 7 characters",
            "tickets",
        ),
    ],
)
def test_prod_refuses_unsafe_tokens_in_one_line_that_never_shows_them(
    env: dict[str, str], says: str, secret: str
) -> None:
    message = refusal(**env)
    assert says in message, message
    assert "\n" not in message.replace("\\n", "")
    assert secret not in message


def test_every_problem_is_counted_and_the_first_is_named() -> None:
    message = refusal(KODA_API_TOKENS="short:alice,REPLACE_ME:bob", KODA_ADMIN_TOKEN="x")
    assert message.startswith("refused in prod: KODA_API_TOKENS: the token of user 'alice'")
    assert message.endswith("(and 2 more)")


def test_spaces_around_tokens_and_users_are_dropped() -> None:
    settings = prod(
        KODA_API_TOKENS=f" {ALICE} : alice ,\n{BOB}:bob\n", KODA_ADMIN_TOKEN=f"  {ADMIN}\n"
    )
    assert dict(settings.prod_tokens) == {ALICE: "alice", BOB: "bob"}
    assert settings.admin_token == ADMIN
    # The same admin token with a pasted newline is still the user's: refused.
    message = refusal(KODA_API_TOKENS=f"{ALICE}:alice", KODA_ADMIN_TOKEN=f"{ALICE}\n")
    assert "KODA_ADMIN_TOKEN is also the KODA_API_TOKENS token of user 'alice'" in message


def test_real_tokens_make_a_valid_prod_and_dev_keeps_its_rules() -> None:
    settings = prod(KODA_API_TOKENS=f"{ALICE}:alice,{BOB}:bob", KODA_ADMIN_TOKEN=ADMIN)
    assert settings.app_env is AppEnv.PROD and len(settings.prod_tokens) == 2
    # dev authenticates dev:<user> tokens; its admin token may be anything.
    dev = Settings.from_env({"APP_ENV": "dev", "KODA_ADMIN_TOKEN": "s3cret", **UNREACHABLE})
    assert dev.admin_token == "s3cret"
    # A token listed twice is a mistake in any environment.
    with pytest.raises(ConfigError, match="repeats the token of user 'alice'"):
        Settings.from_env({"APP_ENV": "dev", "KODA_API_TOKENS": "t:alice,t:bob"})


def test_the_gateway_refuses_to_start_with_one_line() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KODA_") and k != "APP_ENV"}
    env |= PROD | {"KODA_API_TOKENS": f"{ALICE}:alice", "KODA_ADMIN_TOKEN": "REPLACE_ME"}
    proc = subprocess.run(  # noqa: S603
        [sys.executable, "-m", "koda_runtime.cli", "gateway"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "koda: refused in prod: KODA_ADMIN_TOKEN is 10 characters; prod needs at least 32 "
        "(e.g. `openssl rand -hex 32`)"
    ]
    assert ALICE not in proc.stderr + proc.stdout


# --- failed logins ----------------------------------------------------------------


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_failed_logins_are_limited_per_address_and_come_back_with_time() -> None:
    clock = Clock()
    failures = FailedLogins(3, 60.0, clock=clock)
    for _ in range(3):
        failures.check("10.0.0.1")
        failures.failed("10.0.0.1")
    with pytest.raises(TooManyFailedLogins) as refused:
        failures.check("10.0.0.1")
    assert refused.value.status == 429
    assert refused.value.headers == {"Retry-After": "20"}  # one failure back every 20 s
    failures.check("10.0.0.2")  # another address is not concerned
    clock.now += 19.0
    with pytest.raises(TooManyFailedLogins, match="retry after 1 s"):
        failures.check("10.0.0.1")
    clock.now += 1.0
    failures.check("10.0.0.1")  # one try back
    failures.failed("10.0.0.1")
    with pytest.raises(TooManyFailedLogins):
        failures.check("10.0.0.1")
    clock.now += 60.0
    failures.check("10.0.0.1")
    assert failures.addresses == 0  # a clean slate is forgotten


def test_failed_logins_remember_a_bounded_number_of_addresses() -> None:
    failures = FailedLogins(1, 60.0, max_addresses=100, clock=Clock())
    for n in range(1000):
        failures.failed(f"10.0.{n // 256}.{n % 256}")
    assert failures.addresses == 100
    with pytest.raises(TooManyFailedLogins):
        failures.check("10.0.3.231")  # the most recent are kept
    failures.check("10.0.0.0")  # the oldest were forgotten


# --- stream tickets ---------------------------------------------------------------


def test_a_ticket_opens_its_run_for_its_user_until_it_expires() -> None:
    clock = Clock(1_700_000_000.0)
    tickets = StreamTickets(b"k" * 32, clock=clock)
    ticket, expires = tickets.issue("run-a", "alice")
    assert expires == 1_700_000_060
    assert tickets.user_of(ticket, "run-a") == "alice"
    with pytest.raises(Unauthorized, match="invalid stream ticket"):
        tickets.user_of(ticket, "run-b")
    version, exp, user, mac = ticket.split(".")
    for forged in (
        f"{version}.{int(exp) + 3600}.{user}.{mac}",  # a later expiry
        f"{version}.{exp}.{tickets.issue('run-a', 'bob')[0].split('.')[2]}.{mac}",  # bob
        f"{version}.{exp}.{user}.{mac[:-2]}AA",
        StreamTickets(b"x" * 32, clock=clock).issue("run-a", "alice")[0],  # another key
        "",
        "t1.x.y.z",
        "t1.1.!!.@@",
        ticket + "." + ticket,
        "t1." + "9" * 600,
    ):
        with pytest.raises(Unauthorized, match="invalid stream ticket"):
            tickets.user_of(forged, "run-a")
    clock.now += 59.0
    assert tickets.user_of(ticket, "run-a") == "alice"
    clock.now += 1.0
    with pytest.raises(Unauthorized, match="stream ticket expired"):
        tickets.user_of(ticket, "run-a")


def test_every_replica_derives_the_same_ticket_key_and_a_change_of_tokens_changes_it() -> None:
    one = prod(KODA_API_TOKENS=f"{ALICE}:alice", KODA_ADMIN_TOKEN=ADMIN)
    other_replica = prod(KODA_API_TOKENS=f"{ALICE}:alice", KODA_ADMIN_TOKEN=ADMIN)
    assert ticket_secret(one) == ticket_secret(other_replica)
    rotated = prod(KODA_API_TOKENS=f"{BOB}:alice", KODA_ADMIN_TOKEN=ADMIN)
    assert ticket_secret(rotated) != ticket_secret(one)
    configured = prod(KODA_API_TOKENS=f"{ALICE}:alice", KODA_STREAM_TICKET_SECRET=BOB + ADMIN)
    assert ticket_secret(configured) != ticket_secret(one)
    assert ticket_secret(configured) == ticket_secret(configured.with_(admin_token=ADMIN))
    # Nothing secret to derive from: a key of this process only.
    bare = prod()
    assert ticket_secret(bare) != ticket_secret(bare)


# --- the app: throttling, /admin as a whole, the console's headers ----------------

DEV = Settings(
    app_env=AppEnv.DEV,
    kafka_bootstrap="127.0.0.1:1",
    database_url="postgresql://nobody@127.0.0.1:1/none",
    namespace="unit",
)
PROD_APP = DEV.with_(
    app_env=AppEnv.PROD,
    handler="openai",
    kafka_allow_plaintext=True,
    prod_tokens={ALICE: "alice"},
    admin_token=ADMIN,
    auth_failures=3,
)


@asynccontextmanager
async def app_for(settings: Settings, app: FastAPI | None = None) -> AsyncIterator[FastAPI]:
    components = build_components(settings)
    try:
        yield app or create_app(settings, components=components)
    finally:
        await components.engine.dispose()


def client(app: FastAPI, address: str = "10.0.0.1") -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=app, client=(address, 40000))
    return httpx.AsyncClient(transport=transport, base_url="http://gw")


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def test_an_address_past_its_failed_logins_gets_429_even_with_a_good_token() -> None:
    async with app_for(PROD_APP) as app, client(app) as c, client(app, "10.0.0.2") as other:
        wrong = [
            c.get("/v1/runs/r1", headers=bearer("guess-1")),
            c.post("/v1/runs", json={"input": "x"}, headers=bearer("guess-2")),  # the shortcut
            c.get("/v1/runs/r1/events", params={"ticket": "t1.1.YQ.YQ"}),
        ]
        for request in wrong:
            assert (await request).status_code == 401
        for request in (
            c.get("/v1/runs/r1", headers=bearer("guess-4")),
            c.get("/v1/runs/r1", headers=bearer(ALICE)),  # a right guess looks the same
            c.get("/admin/workers", headers=bearer(ADMIN)),
            c.post("/v1/runs", json={"input": "x"}, headers=bearer(ALICE)),
        ):
            r = await request
            assert r.status_code == 429, r.text
            assert r.json()["error"]["code"] == "too_many_failed_logins"
            assert int(r.headers["Retry-After"]) >= 1
            assert ALICE not in r.text and ADMIN not in r.text
        # Another address is not concerned.
        r = await other.get("/v1/runs/r1", headers=bearer("guess-5"))
        assert r.status_code == 401


async def test_wrong_admin_tokens_count_as_failed_logins() -> None:
    async with app_for(PROD_APP) as app, client(app) as c:
        for _ in range(3):
            assert (await c.get("/admin/workers", headers=bearer(ALICE))).status_code == 401
        assert (await c.get("/admin/workers", headers=bearer(ADMIN))).status_code == 429


def all_routes(app: FastAPI) -> list[tuple[str, BaseRoute]]:
    """(path, route) of every route of ``app.routes``, into FastAPI's included routers."""
    found: list[tuple[str, BaseRoute]] = []

    def walk(routes: list[BaseRoute], prefix: str) -> None:
        for route in routes:
            inner = getattr(route, "original_router", None)  # an included router
            if inner is not None:
                walk(list(inner.routes), prefix + route.include_context.prefix)  # type: ignore[attr-defined]
            elif isinstance(getattr(route, "path", None), str):
                found.append((prefix + route.path, route))  # type: ignore[attr-defined]

    walk(list(app.routes), "")
    return found


def admin_requests(app: FastAPI) -> list[tuple[str, str]]:
    """(method, path) of every /admin route the app has, path parameters filled in."""
    found: list[tuple[str, str]] = []
    for path, route in all_routes(app):
        if not is_admin_path(path) and not (isinstance(route, Mount) and path.startswith("/admin")):
            continue
        filled = path.replace("{", "").replace("}", "")
        methods = sorted(route.methods or {"GET"}) if isinstance(route, APIRoute) else ["GET"]
        found += [(m, filled) for m in methods if m != "HEAD"]
    return found


async def test_every_admin_route_is_guarded_and_a_forgotten_guard_is_covered() -> None:
    app_settings = PROD_APP.with_(auth_failures=1000)
    async with app_for(app_settings) as app:

        @app.get("/admin/forgot-its-guard")
        async def unguarded() -> dict[str, str]:
            return {"leaked": "everything"}

        requests = admin_requests(app)
        paths = {p for _, p in requests}
        # The routes of every router that serves /admin (the walk found them all).
        assert {
            "/admin/workers",
            "/admin/lag",
            "/admin/runs",
            "/admin/usage",
            "/admin/budgets",
            "/admin/budgets/user_id",
            "/admin/forgot-its-guard",
        } <= paths
        # Each declared route also declares the admin scheme (for OpenAPI).
        for path, route in all_routes(app):
            if (
                isinstance(route, APIRoute)
                and is_admin_path(path)
                and path != ("/admin/forgot-its-guard")
            ):
                calls = [d.call for d in route.dependant.dependencies]
                assert admin_access in calls, path
        async with client(app) as c:
            for method, path in requests:
                for headers in ({}, bearer("dev:alice"), bearer(ALICE), bearer(ADMIN + "x")):
                    r = await c.request(method, path, headers=headers, json={})
                    assert r.status_code == 401, (method, path, headers, r.text)
                    assert "everything" not in r.text
            r = await c.get("/admin/forgot-its-guard", headers=bearer(ADMIN))
            assert r.json() == {"leaked": "everything"}  # the guard let the admin through
            # /administrator is not under /admin (an unknown route, 404).
            assert (await c.get("/administrator")).status_code == 404
    # prod without an admin token: every /admin route is closed (403).
    async with app_for(app_settings.with_(admin_token=None)) as app, client(app) as c:
        for method, path in admin_requests(app):
            r = await c.request(method, path, headers=bearer(ALICE), json={})
            assert r.status_code == 403, (method, path, r.text)


async def test_the_console_sends_its_csp_and_nosniff() -> None:
    async with app_for(DEV) as app, client(app) as c:
        for path in (
            "/console",
            "/console/assets/console.js",
            "/console/assets/console.css",
            "/console/assets/favicon.svg",
        ):
            r = await c.get(path)
            assert r.status_code == 200, path
            assert r.headers["content-security-policy"] == CSP, path
            assert r.headers["x-content-type-options"] == "nosniff", path
    assert CSP == "default-src 'self'; frame-ancestors 'none'; object-src 'none'; base-uri 'none'"
