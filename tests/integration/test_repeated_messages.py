"""A repeated message is a new message, through the HTTP API (gateway + PostgreSQL).

Without an Idempotency-Key or a client_message_id the same body is one run only within
KODA_DEDUP_WINDOW_S (a double click): the gateways here run with a 2-second window so
the test waits seconds, not a minute. With a client_message_id the message's id decides:
a new id is a new run however soon, the same id the same run however late.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from koda_runtime.cli.runs import runs_app
from koda_runtime.gateway.app import create_app
from koda_runtime.settings import Settings
from tests.fixtures.gateway import db_rows, serve_app
from tests.sse_client import bearer
from tests.support import wait_until

WINDOW_S = 2.0


@pytest.fixture(scope="module")
def windowed(module_env: Settings) -> Iterator[httpx.Client]:
    with serve_app(create_app(module_env.with_(dedup_window_s=WINDOW_S))) as url:
        with httpx.Client(base_url=url, timeout=60) as c:
            yield c


def post(client: httpx.Client, user: str, body: dict[str, Any]) -> str:
    r = client.post("/v1/runs", json=body, headers=bearer(user))
    assert r.status_code == 202, r.text
    return str(r.json()["run_id"])


def a_user() -> str:
    return f"rep-{uuid.uuid4().hex[:8]}"


def created_at(settings: Settings, run_id: str) -> float:
    (row,) = db_rows(
        settings, "SELECT extract(epoch FROM created_at) AS at FROM runs WHERE id = :id", id=run_id
    )
    return float(row.at)


def db_now(settings: Settings) -> float:
    (row,) = db_rows(settings, "SELECT extract(epoch FROM now()) AS at")
    return float(row.at)


def test_the_same_body_a_window_apart_is_two_runs(
    module_env: Settings, windowed: httpx.Client
) -> None:
    user, body = a_user(), {"session_id": f"rep-{uuid.uuid4().hex[:8]}", "input": "yes"}
    first = post(windowed, user, body)
    assert post(windowed, user, body) == first  # a double click
    born = created_at(module_env, first)
    wait_until(
        lambda: db_now(module_env) > born + WINDOW_S, timeout=30, what="the window has passed"
    )
    second = post(windowed, user, body)
    assert second != first
    # Session-less, a double click is one run as well.
    lone = post(windowed, user, {"input": "hello"})
    assert post(windowed, user, {"input": "hello"}) == lone


def test_a_double_click_across_a_window_boundary_is_one_run(windowed: httpx.Client) -> None:
    """Keys are per window, so the second click of a pair that straddles two windows
    finds the first under the previous window's key, created less than a window ago."""
    user, body = a_user(), {"input": "straddle"}

    def late_in_a_window() -> int | None:
        now = time.time()
        bucket = math.floor(now / WINDOW_S)
        return bucket if now - bucket * WINDOW_S > 0.85 * WINDOW_S else None

    bucket = wait_until(late_in_a_window, timeout=10, interval=0.01, what="a window's end")
    first = post(windowed, user, body)
    wait_until(
        lambda: math.floor(time.time() / WINDOW_S) > bucket,
        timeout=10,
        interval=0.01,
        what="the next window",
    )
    assert post(windowed, user, body) == first


def test_a_new_client_message_id_is_a_new_run_and_the_same_one_is_not(
    windowed: httpx.Client,
) -> None:
    user, s = a_user(), f"rep-{uuid.uuid4().hex[:8]}"
    one = post(windowed, user, {"session_id": s, "input": "yes", "client_message_id": "m-1"})
    two = post(windowed, user, {"session_id": s, "input": "yes", "client_message_id": "m-2"})
    assert one != two  # within the window, but two messages
    again = post(windowed, user, {"session_id": s, "input": "yes", "client_message_id": "m-1"})
    assert again == one  # a client's resend of one message


def test_a_bad_client_message_id_is_refused_and_named(windowed: httpx.Client) -> None:
    r = windowed.post(
        "/v1/runs",
        json={"input": "x", "client_message_id": "has a space"},
        headers=bearer(a_user()),
    )
    assert r.status_code == 422, r.text
    assert r.json()["error"]["field"] == "client_message_id"
    assert "printable ASCII" in r.json()["error"]["message"]


def test_koda_runs_submit_sends_a_new_message_id_each_time(windowed: httpx.Client) -> None:
    """The same text twice through the command line, at once: two runs, as two messages;
    the same --message-id twice: one."""
    runner = CliRunner()
    user, url = a_user(), str(windowed.base_url)

    def cli(*extra: str) -> str:
        result = runner.invoke(
            runs_app, ["submit", "yes", "--user", user, "--gateway", url, "--session", user, *extra]
        )
        assert result.exit_code == 0, result.output
        return result.stdout.strip()

    assert cli() != cli()
    assert cli("--message-id", "m-7") == cli("--message-id", "m-7")
