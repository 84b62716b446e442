"""Stream tickets against a real gateway (uvicorn), Postgres and Kafka: a browser's
EventSource opens a run's events with a 60 s ticket of that run, never with the
long-lived token in a URL; and failed logins over a real socket are throttled."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest
from sqlalchemy import text

from koda_runtime.gateway.app import create_app
from koda_runtime.gateway.auth import StreamTickets
from koda_runtime.gateway.bootstrap import Components, build_components
from koda_runtime.gateway.eventstream import EventParser
from koda_runtime.localstack import StackInfo
from koda_runtime.naming import AppEnv
from koda_runtime.settings import Settings
from tests.fixtures.gateway import serve_app
from tests.fixtures.namespaces import make_settings, prepared_namespace
from tests.fixtures.runs import Submitter

ALICE = f"alice-{uuid.uuid4().hex}"
BOB = f"bob-{uuid.uuid4().hex}"
ADMIN = f"admin-{uuid.uuid4().hex}"


@dataclass
class Gateway:
    settings: Settings
    components: Components
    url: str
    sub: Submitter

    def finished_run(self, user: str, answer: str) -> str:
        """A run of ``user`` that ended ``done`` with ``answer`` (rows as a worker leaves them)."""
        run_id = self.sub.submit(user, {"text": "x"}, publish=False)
        with self.sub.engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO messages (run_id, seq, kind, content, attempt) VALUES"
                    " (:r, 0, 'chunk', :c, 1), (:r, 1, 'done', '', 1)"
                ),
                {"r": run_id, "c": answer},
            )
            conn.execute(
                text(
                    "UPDATE runs SET status = 'done', attempt = 1, finished_at = now()"
                    " WHERE id = :r"
                ),
                {"r": run_id},
            )
        return run_id


@pytest.fixture(scope="module")
def prod_gateway(stack: StackInfo) -> Iterator[Gateway]:
    settings = make_settings(
        stack,
        app_env=AppEnv.PROD,
        handler="openai",
        prod_tokens={ALICE: "alice", BOB: "bob"},
        admin_token=ADMIN,
        auth_failures=1000,
    )
    with prepared_namespace(settings):
        components = build_components(settings)
        sub = Submitter(settings)
        try:
            with serve_app(create_app(settings, components=components)) as url:
                yield Gateway(settings, components, url, sub)
        finally:
            sub.close()


@pytest.fixture(scope="module")
def dev_gateway(module_env: Settings) -> Iterator[Gateway]:
    components = build_components(module_env)
    sub = Submitter(module_env)
    try:
        with serve_app(create_app(module_env, components=components)) as url:
            yield Gateway(module_env, components, url, sub)
    finally:
        sub.close()


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def stream(url: str, path: str, **params: str) -> tuple[int, list[tuple[str, str]], str]:
    """(status, [(event, data)], body) of one whole events stream (it ends after ``done``)."""
    with httpx.stream("GET", url + path, params=params or None, timeout=30) as r:
        if r.status_code != 200:
            return r.status_code, [], r.read().decode()
        parser = EventParser()
        events = [(e.event, e.data) for chunk in r.iter_bytes() for e in parser.feed(chunk)]
        return r.status_code, events, ""


def ticket_for(gw: Gateway, run_id: str, token: str) -> httpx.Response:
    return httpx.post(f"{gw.url}/v1/runs/{run_id}/stream-ticket", headers=bearer(token))


def test_a_ticket_opens_its_own_run_for_its_owner_and_no_other(prod_gateway: Gateway) -> None:
    gw = prod_gateway
    run_a = gw.finished_run("alice", "answer of A")
    run_b = gw.finished_run("alice", "answer of B")
    issued = ticket_for(gw, run_a, ALICE)
    assert issued.status_code == 200, issued.text
    body = issued.json()
    assert 50 <= body["expires_at"] - time.time() <= 61
    url = urlsplit(body["events_url"])
    assert url.path == f"/v1/runs/{run_a}/events"
    assert parse_qs(url.query) == {"ticket": [body["ticket"]]}
    assert ALICE not in issued.text
    # The ticket alone (no header) opens run A's events, as EventSource would.
    status, events, _ = stream(gw.url, body["events_url"])
    assert status == 200
    assert [(kind, '"answer of A"' in data) for kind, data in events] == [
        ("chunk", True),
        ("done", False),
    ]
    # ...and nothing else: alice's other run, or another path of run A.
    status, events, refusal = stream(gw.url, f"/v1/runs/{run_b}/events", ticket=body["ticket"])
    assert (status, events) == (401, [])
    assert "invalid stream ticket" in refusal and "answer of B" not in refusal
    for path in (f"/v1/runs/{run_a}", f"/v1/runs/{run_a}/timeline"):
        r = httpx.get(gw.url + path, params={"ticket": body["ticket"]})
        assert r.status_code == 401, path
    # Only the owner gets one: another user's run answers like an unknown run.
    theirs = ticket_for(gw, run_a, BOB)
    unknown = ticket_for(gw, "01a00000-0000-7000-8000-000000000000", ALICE)
    assert theirs.status_code == unknown.status_code == 404
    assert theirs.json() == unknown.json()
    assert ticket_for(gw, run_a, "forged-token").status_code == 401
    # A ticket for run A signed with another key opens nothing either.
    forged, _ = StreamTickets(b"k" * 32).issue(run_a, "alice")
    assert stream(gw.url, f"/v1/runs/{run_a}/events", ticket=forged)[0] == 401


def test_an_expired_ticket_is_refused(prod_gateway: Gateway) -> None:
    gw = prod_gateway
    run_id = gw.finished_run("alice", "old answer")
    # Issued by this gateway's own key 61 s ago: past its 60 s.
    old, expires = gw.components.auth.tickets.issue(run_id, "alice", now=time.time() - 61)
    assert expires < time.time()
    status, events, refusal = stream(gw.url, f"/v1/runs/{run_id}/events", ticket=old)
    assert (status, events) == (401, [])
    assert "stream ticket expired" in refusal
    # The same ticket a second younger opens the stream: only the expiry refused it.
    fresh, _ = gw.components.auth.tickets.issue(run_id, "alice", now=time.time() - 50)
    assert stream(gw.url, f"/v1/runs/{run_id}/events", ticket=fresh)[0] == 200


def test_the_long_lived_token_in_a_url_opens_nothing(
    prod_gateway: Gateway, dev_gateway: Gateway
) -> None:
    gw = prod_gateway
    run_id = gw.finished_run("alice", "private answer")
    # The parameter works only on the events route, and there only in dev.
    for path in (f"/v1/runs/{run_id}", f"/v1/runs/{run_id}/timeline"):
        r = httpx.get(gw.url + path, params={"access_token": ALICE})
        assert r.status_code == 401, path
        assert ALICE not in r.text
    status, events, refusal = stream(gw.url, f"/v1/runs/{run_id}/events", access_token=ALICE)
    assert (status, events) == (401, [])
    assert "?access_token= is refused in prod" in refusal and ALICE not in refusal
    # The header still works.
    r = httpx.get(f"{gw.url}/v1/runs/{run_id}", headers=bearer(ALICE))
    assert r.status_code == 200 and r.json()["output"] == "private answer"
    # dev keeps ?access_token= on the events route (a dev token is no secret), only there.
    dev = dev_gateway
    dev_run = dev.finished_run("carol", "dev answer")
    assert stream(dev.url, f"/v1/runs/{dev_run}/events", access_token="dev:carol")[0] == 200
    assert stream(dev.url, f"/v1/runs/{dev_run}/events", access_token="dev:dave")[0] == 404
    r = httpx.get(f"{dev.url}/v1/runs/{dev_run}", params={"access_token": "dev:carol"})
    assert r.status_code == 401
    # And tickets work in dev too (the console uses them in every environment).
    issued = ticket_for(dev, dev_run, "dev:carol").json()
    assert stream(dev.url, issued["events_url"])[0] == 200


def test_an_address_that_keeps_failing_is_answered_429_over_a_real_socket(
    stack: StackInfo,
) -> None:
    settings = make_settings(
        stack,
        app_env=AppEnv.PROD,
        handler="openai",
        prod_tokens={ALICE: "alice"},
        admin_token=ADMIN,
        auth_failures=4,
        auth_failure_window_s=3600,
    )
    with prepared_namespace(settings), serve_app(create_app(settings)) as url:
        run_id = "01a00000-0000-7000-8000-000000000000"
        statuses = [
            httpx.get(f"{url}/v1/runs/{run_id}", headers=bearer(f"guess-{n}")).status_code
            for n in range(3)
        ]
        statuses.append(httpx.get(f"{url}/admin/workers", headers=bearer("guess")).status_code)
        assert statuses == [401, 401, 401, 401]
        for request in (
            httpx.get(f"{url}/v1/runs/{run_id}", headers=bearer(ALICE)),
            httpx.post(f"{url}/v1/runs", headers=bearer(ALICE), json={"input": "x"}),
            httpx.get(f"{url}/admin/workers", headers=bearer(ADMIN)),
        ):
            assert request.status_code == 429, request.text
            assert request.json()["error"]["code"] == "too_many_failed_logins"
            assert int(request.headers["Retry-After"]) >= 1
        # Health and metrics need no login and stay open.
        assert httpx.get(f"{url}/livez").status_code == 200
