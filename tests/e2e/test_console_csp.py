"""The console under its own Content-Security-Policy, in headless Chromium against a real
gateway process: it signs in, submits and streams a run's answer with a stream ticket
(never the token in a URL) without one CSP violation, and no page can frame it.

Only Playwright calls that run nothing through ``eval`` are used here (``wait_for_selector``,
``evaluate`` over the DevTools protocol): ``wait_for_function`` is refused by the CSP.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import BrowserContext, sync_playwright
from sqlalchemy import text

from koda_runtime.gateway.console import CSP
from koda_runtime.localstack import StackInfo
from tests.fixtures.namespaces import make_settings, prepared_namespace
from tests.fixtures.processes import GatewayProcess
from tests.fixtures.runs import Submitter

CHROMIUM = Path("/usr/bin/chromium")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run"]


@pytest.fixture(scope="module")
def gateway(stack: StackInfo) -> Iterator[tuple[GatewayProcess, Submitter]]:
    settings = make_settings(stack)
    with prepared_namespace(settings):
        sub = Submitter(settings)
        gw = GatewayProcess(settings, {"KODA_SSE_KEEPALIVE": "0.5"}).start()
        try:
            yield gw, sub
        finally:
            gw.stop()
            sub.close()


@pytest.fixture(scope="module")
def browser() -> Iterator[BrowserContext]:
    if not CHROMIUM.exists():
        pytest.fail("chromium is missing: run `make system-deps` (apt-get install chromium)")
    with sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            tempfile.mkdtemp(prefix="koda-chromium-"),
            executable_path=str(CHROMIUM),
            headless=True,
            args=ARGS,
        )
        try:
            yield context
        finally:
            context.close()


def test_the_console_streams_under_its_csp_with_a_ticket(
    browser: BrowserContext, gateway: tuple[GatewayProcess, Submitter]
) -> None:
    gw, sub = gateway
    page = browser.new_page()
    errors: list[str] = []
    urls: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(f"pageerror: {e}"))
    page.on("request", lambda r: urls.append(r.url))
    response = page.goto(f"{gw.url}/console")
    assert response is not None and response.headers["content-security-policy"] == CSP
    assert response.headers["x-content-type-options"] == "nosniff"
    assert page.evaluate("document.querySelector('#token').type") == "password"
    page.fill("#token", "dev:erin-csp")
    page.click("#signin button[type=submit]")
    page.wait_for_selector("#view[data-view='chat'][data-ready='true']")
    page.click("details summary")
    page.fill("#chat-input-json", json.dumps({"text": "under the csp"}))
    page.click("#chat-send")
    link = page.wait_for_selector("#chat-run a")
    assert link is not None
    run_id = link.text_content()
    # No worker runs here: the answer is written as a worker leaves it, and the stream
    # (re-reading Postgres every keep-alive) delivers it.
    with sub.engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO messages (run_id, seq, kind, content, attempt) VALUES"
                " (:r, 0, 'chunk', 'streamed under the csp', 1), (:r, 1, 'done', '', 1)"
            ),
            {"r": run_id},
        )
        conn.execute(
            text("UPDATE runs SET status = 'done', attempt = 1, finished_at = now() WHERE id = :r"),
            {"r": run_id},
        )
    page.wait_for_selector("#chat-output:has-text('streamed under the csp')", timeout=20_000)
    events = [u for u in urls if f"/v1/runs/{run_id}/events" in u]
    assert events and all("?ticket=t1." in u for u in events), events
    assert not [u for u in urls if "access_token" in u or "erin-csp" in u]
    page.close()
    assert errors == [], errors


def test_no_page_can_frame_the_console(
    browser: BrowserContext, gateway: tuple[GatewayProcess, Submitter]
) -> None:
    gw, _ = gateway
    page = browser.new_page()
    # Another origin (about:blank here) frames the console: the browser refuses to show it.
    with page.expect_console_message(
        lambda m: "frame-ancestors" in m.text, timeout=20_000
    ) as refused:
        page.set_content(f'<iframe id="f" src="{gw.url}/console"></iframe>')
    assert "The request has been blocked" in refused.value.text
    assert page.frame_locator("#f").locator("#signin").count() == 0
    page.close()
