"""The web console in headless Chromium against a real gateway and real workers.

One stack per module (a gateway process, two workers, this module's topics and
schema); each test opens its own page and fails on any JavaScript console error.
Screenshots of every view go to $KODA_ARTIFACTS (else a temp dir, printed).
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import Browser, Page, sync_playwright
from sqlalchemy import text

from koda_runtime.lifecycle.control import merge_inputs
from koda_runtime.processors.handlers.demo import demo_tokens
from koda_runtime.schemas.migrate import upgrade
from koda_runtime.settings import Settings
from koda_runtime.topics.admin import apply_topics
from koda_runtime.topics.catalogue import WORKERS
from koda_runtime.topics.records.heartbeats import Beat, beat_headers
from tests.fixtures.namespaces import delete_topics, drop_schema, make_settings
from tests.fixtures.processes import GatewayProcess, WorkerProcess
from tests.fixtures.runs import Submitter
from tests.support import wait_until

CHROMIUM = Path("/usr/bin/chromium")
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
# With an admin token configured the operator views need it, in dev as in prod.
ADMIN_TOKEN = "console-ops-token"
GATEWAY_ENV = {
    "KODA_SSE_KEEPALIVE": "0.5",
    "KODA_SSE_RETRY_MS": "200",
    "KODA_ADMIN_TOKEN": ADMIN_TOKEN,
}
ARTIFACTS = Path(os.environ.get("KODA_ARTIFACTS") or tempfile.mkdtemp(prefix="koda-console-"))


class Stack:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.sub = Submitter(settings)
        self.gateway = GatewayProcess(settings, dict(GATEWAY_ENV)).start()
        self.workers = [WorkerProcess(settings, f"w{i}").start() for i in (1, 2)]

    def api(self, user: str, method: str, path: str, **kw: Any) -> httpx.Response:
        token = ADMIN_TOKEN if path.startswith("/admin/") else f"dev:{user}"
        headers = {"Authorization": f"Bearer {token}"}
        return httpx.request(method, self.gateway.url + path, headers=headers, timeout=10, **kw)


@pytest.fixture(scope="module")
def stack(stack) -> Iterator[Stack]:
    settings = make_settings(stack)
    apply_topics(settings)
    upgrade(settings)
    s = Stack(settings)
    try:
        yield s
    finally:
        for w in s.workers:
            w.stop()
        s.gateway.stop()
        s.sub.close()
        delete_topics(settings)
        drop_schema(settings)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if not CHROMIUM.exists():
        pytest.fail("chromium is missing: run `make system-deps` (apt-get install chromium)")
    print(f"console screenshots: {ARTIFACTS}")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        data_dir = tempfile.mkdtemp(prefix="koda-chromium-")
        # wait_for_function evaluates its string in the page, which the console's CSP
        # forbids (no eval); tests/e2e/test_console_csp.py runs the console under it.
        context = pw.chromium.launch_persistent_context(
            data_dir, executable_path=str(CHROMIUM), headless=True, args=ARGS, bypass_csp=True
        )
        try:
            yield context  # type: ignore[misc]
        finally:
            context.close()


class Console:
    """One page signed in as ``user`` (with the admin token unless ``admin`` is false),
    collecting console errors."""

    def __init__(self, browser: Any, stack: Stack, user: str, *, admin: bool = True) -> None:
        self.page: Page = browser.new_page()
        self.errors: list[str] = []
        self.page.on("console", self._console)
        self.page.on("pageerror", lambda e: self.errors.append(f"pageerror: {e}"))
        self.page.goto(f"{stack.gateway.url}/console")
        self.page.evaluate("sessionStorage.clear()")
        self.page.reload()
        self.page.fill("#token", f"dev:{user}")
        if admin:
            self.page.fill("#admin-token", ADMIN_TOKEN)
        self.page.click("#signin button[type=submit]")
        self.ready("chat")

    def _console(self, message: Any) -> None:
        if message.type == "error":
            self.errors.append(message.text)

    def ready(self, view: str) -> None:
        self.page.wait_for_selector(f"#view[data-view='{view}'][data-ready='true']")

    def open(self, hash_: str) -> None:
        self.page.evaluate("h => { location.hash = h; }", hash_)
        self.ready(hash_.split("/")[0])

    def shot(self, name: str) -> None:
        self.page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)

    def send(self, inp: dict[str, Any]) -> None:
        self.page.click("details summary")
        self.page.fill("#chat-input-json", json.dumps(inp))
        self.page.click("#chat-send")
        self.page.wait_for_function("document.querySelector('#chat-run a') !== null")

    def run_id(self) -> str:
        return str(self.page.text_content("#chat-run a"))

    def close(self, allowed: tuple[str, ...] = ()) -> None:
        errors = [e for e in self.errors if not any(a in e for a in allowed)]
        self.page.close()
        assert errors == [], errors


# Records every distinct text the output shows, to prove it grew chunk by chunk.
WATCH_OUTPUT = """() => {
  const out = document.querySelector('#chat-output');
  window.seen = [];
  new MutationObserver(() => window.seen.push(out.textContent))
    .observe(out, {childList: true, characterData: true, subtree: true});
}"""


def test_an_answer_streams_token_by_token_and_equals_the_output(browser, stack) -> None:
    c = Console(browser, stack, "alice")
    inp = {"text": "hello console", "demo": {"tokens": 30, "delay_ms": 40}}
    c.page.evaluate(WATCH_OUTPUT)
    c.send(inp)
    c.page.wait_for_selector("#chat-output[data-finished='true']", timeout=60_000)
    want = "".join(demo_tokens(inp))
    assert c.page.text_content("#chat-output") == want
    run = stack.api("alice", "GET", f"/v1/runs/{c.run_id()}").json()
    assert run["output"] == want and run["status"] == "done"
    seen = [s for s in c.page.evaluate("window.seen") if s]
    assert len(set(seen)) >= 10, seen  # many partial answers, not one final paint
    assert all(want.startswith(s) for s in seen)
    assert c.page.text_content("#chat-status") == "done"
    c.shot("chat")
    c.close()


def test_the_stop_button_cancels_the_run(browser, stack) -> None:
    c = Console(browser, stack, "carol")
    c.send({"text": "stop me", "demo": {"tokens": 400, "delay_ms": 50}})
    c.page.wait_for_function("document.querySelector('#chat-output').textContent.length > 20")
    c.page.click("#chat-stop")
    c.page.wait_for_selector("#chat-output[data-finished='true']", timeout=30_000)
    run_id = c.run_id()
    assert stack.sub.statuses([run_id]) == {run_id: "cancelled"}
    assert c.page.text_content("#chat-status") == "cancelled"
    c.close()


def test_a_retry_shows_its_attempt_and_a_reset(browser, stack) -> None:
    c = Console(browser, stack, "dave")
    inp = {"text": "retry me", "demo": {"tokens": 10, "fail_attempts": 1}}
    c.send(inp)
    c.page.wait_for_selector("#chat-output[data-finished='true']", timeout=60_000)
    assert c.page.text_content("#chat-attempt") == "retry: attempt 2"
    assert "reset" in str(c.page.text_content("#chat-notes"))
    assert c.page.text_content("#chat-output") == "".join(demo_tokens(inp))
    c.close()


def test_a_second_message_merges_as_a_reset_then_the_merged_answer(browser, stack) -> None:
    c = Console(browser, stack, "grace")
    first = {"text": "first question", "demo": {"tokens": 100, "delay_ms": 40}}
    c.send(first)
    run_id = c.run_id()
    c.page.wait_for_function("document.querySelector('#chat-output').textContent.length > 10")
    c.page.fill("#chat-input-json", "")
    c.page.fill("#chat-text", "and in French")
    c.page.click("#chat-send")  # the same session, still picked
    c.page.wait_for_selector("#chat-notes .merged")
    c.page.wait_for_selector("#chat-notes .reset", timeout=30_000)
    c.page.wait_for_selector("#chat-output[data-finished='true']", timeout=60_000)
    assert c.run_id() == run_id
    want = "".join(demo_tokens(merge_inputs(first, {"text": "and in French"})))
    assert c.page.text_content("#chat-output") == want
    assert stack.api("grace", "GET", f"/v1/runs/{run_id}").json()["output"] == want
    # The merged message is shown inside its run's turn, after the first one.
    c.page.wait_for_function(
        "[...document.querySelectorAll('#chat-live-user .message')].map(m => m.textContent)"
        ".join('|') === 'first question|and in French'"
    )
    assert c.page.text_content("#chat-live-user .message.merged") == "and in French"
    c.close()


def test_the_chat_shows_the_session_as_a_conversation(browser, stack) -> None:
    """Each earlier message and its answer, oldest first, the followed run at the bottom;
    the demo model's echo_turns shows the worker gave the new run the earlier turn."""
    c = Console(browser, stack, "heidi")
    first = {"text": "my name is Ada", "demo": {"tokens": 3, "delay_ms": 0}}
    c.send(first)
    first_id = c.run_id()
    c.page.wait_for_selector("#chat-output[data-finished='true']", timeout=60_000)
    second = {"text": "what is my name?", "demo": {"tokens": 3, "delay_ms": 0, "echo_turns": True}}
    c.page.fill("#chat-input-json", json.dumps(second))  # the JSON box is still open
    c.page.click("#chat-send")  # the same session, still picked
    c.page.wait_for_function(
        "old => document.querySelector('#chat-run a').textContent !== old", arg=first_id
    )
    c.page.wait_for_selector("#chat-output[data-finished='true']", timeout=60_000)
    answer = "".join(demo_tokens(second))
    assert c.page.text_content("#chat-output") == f"turns=1 | my name is Ada\n{answer}"
    c.page.wait_for_function("document.querySelectorAll('#chat-conversation .turn').length === 1")
    turn = c.page.locator("#chat-conversation .turn")
    assert turn.get_attribute("data-run") == first_id
    assert turn.locator(".turn-user .message").all_text_contents() == ["my name is Ada"]
    assert turn.locator(".turn-answer").text_content() == "".join(demo_tokens(first))
    assert c.page.locator("#chat-live-user .message").all_text_contents() == ["what is my name?"]
    # The turn sits above the followed run, which sits above the form.
    order = c.page.evaluate(
        "[...document.querySelectorAll('#chat-conversation, #chat-output, #chat-send')]"
        ".map(n => n.id || n.parentElement.id)"
    )
    assert order == ["chat-conversation", "chat-output", "chat-send"]
    c.shot("chat-conversation")
    c.close()


def test_the_chat_survives_a_gateway_kill_mid_stream(browser, stack) -> None:
    c = Console(browser, stack, "erin")
    inp = {"text": "survive a restart", "demo": {"tokens": 60, "delay_ms": 80}}
    c.send(inp)
    c.page.wait_for_function("document.querySelector('#chat-output').textContent.length > 30")
    first = stack.gateway
    assert first.proc is not None
    os.kill(first.proc.pid, signal.SIGKILL)
    first.proc.wait(10)
    c.page.wait_for_selector("#chat-notes .dropped", timeout=10_000)
    stack.gateway = GatewayProcess(stack.settings, dict(GATEWAY_ENV), port=first.port).start()
    c.page.wait_for_selector("#chat-output[data-finished='true']", timeout=90_000)
    assert c.page.text_content("#chat-output") == "".join(demo_tokens(inp))
    # The browser reports the refused reconnects as failed loads; nothing else may fail.
    c.close(allowed=("ERR_CONNECTION_REFUSED", "ERR_INCOMPLETE_CHUNKED_ENCODING"))


def test_runs_list_filters_pages_and_opens_a_detail(browser, stack) -> None:
    wait_until(lambda: stack.sub.query("SELECT 1 FROM ledger WHERE user_id = 'alice'"))
    c = Console(browser, stack, "alice")
    for i in range(21):
        stack.api("alice", "POST", "/v1/runs", json={"input": {"text": f"page {i}"}})
    c.open("runs")
    assert c.page.locator("#runs-list tbody tr").count() == 20
    c.page.click("#runs-older")
    c.page.wait_for_function("document.querySelectorAll('#runs-list tbody tr').length < 20")
    assert c.page.locator("#runs-list tbody tr").count() >= 2
    c.page.select_option("#runs-status", "done")
    c.page.click("#runs-filter button[type=submit]")
    wait_until(
        lambda: stack.sub.query(
            "SELECT 1 FROM runs WHERE user_id = 'alice' AND input->>'text' = 'hello console'"
            " AND status = 'done'"
        )
    )
    c.page.wait_for_function(
        "[...document.querySelectorAll('#runs-list tbody tr')]"
        ".every(r => r.textContent.includes('done'))"
    )
    c.shot("runs")
    # "created after": a future time leaves nothing and no older page; a past one all.
    tomorrow = (datetime.now() + timedelta(days=1)).strftime("%Y-%m-%dT%H:%M")
    c.page.fill("#runs-since", tomorrow)
    c.page.click("#runs-filter button[type=submit]")
    c.page.wait_for_function("document.querySelectorAll('#runs-list tbody tr').length === 0")
    assert c.page.is_disabled("#runs-older")
    yesterday = (datetime.now() - timedelta(days=1)).strftime("%Y-%m-%dT%H:%M")
    c.page.fill("#runs-since", yesterday)
    c.page.click("#runs-filter button[type=submit]")
    c.page.wait_for_function("document.querySelectorAll('#runs-list tbody tr').length > 0")
    row = stack.sub.query(
        "SELECT id, worker_id, partition FROM runs WHERE input->>'text' = 'hello console'"
    )[0]
    c.open(f"run/{row.id}")
    text = str(c.page.text_content("#view"))
    assert row.worker_id in text and f"Partition{row.partition}" in text
    timeline = str(c.page.text_content("#run-timeline"))
    for step in ("created", "started", "first chunk", "finished", "done"):
        assert step in timeline, timeline
    assert "Cost$0." in text  # the demo model's priced calls
    c.shot("run-detail")
    c.close()


def test_operators_list_every_users_runs_and_one_users(browser, stack) -> None:
    c = Console(browser, stack, "alice")
    c.open("runs")
    c.page.check("#runs-all")  # alice's 21 runs are the newest: ask for carol's stopped one
    c.page.select_option("#runs-status", "cancelled")
    c.page.click("#runs-filter button[type=submit]")
    c.page.wait_for_function(
        "[...document.querySelectorAll('#runs-list tbody tr')]"
        ".some(r => r.dataset.user === 'carol')"
    )
    c.page.uncheck("#runs-all")
    c.page.select_option("#runs-status", "")
    c.page.fill("#runs-user", "carol")
    c.page.click("#runs-filter button[type=submit]")
    c.page.wait_for_function(
        "(() => { const rows = [...document.querySelectorAll('#runs-list tbody tr')];"
        " return rows.length > 0 && rows.every(r => r.dataset.user === 'carol'); })()"
    )
    c.shot("runs-operators")
    c.close()
    # The API under it: pages across users, bad input named, the admin token required.
    first = stack.api("alice", "GET", "/admin/runs?limit=2").json()
    second = stack.api("alice", "GET", f"/admin/runs?limit=2&before={first['next_before']}")
    ids = [r["run_id"] for r in first["runs"] + second.json()["runs"]]
    assert len(ids) == len(set(ids)) == 4
    for query, field in (("user_id=a%20b", "user_id"), ("limit=0", "limit"),
                         ("status=lost", "status"), ("before=nope", "before")):  # fmt: skip
        bad = stack.api("alice", "GET", f"/admin/runs?{query}")
        assert bad.status_code == 400 and bad.json()["error"]["field"] == field, bad.text
    as_user = httpx.get(
        stack.gateway.url + "/admin/runs", headers={"Authorization": "Bearer dev:alice"}
    )
    assert as_user.status_code == 401


def test_output_with_markup_renders_as_text_and_others_runs_stay_closed(browser, stack) -> None:
    evil = '<script>window.pwned = 1</script><img src=x onerror="window.pwned = 2">'
    run_id = stack.sub.submit("mallory", {"text": "x"}, publish=False)
    with stack.sub.engine.begin() as conn:
        from sqlalchemy import text

        conn.execute(
            text(
                "INSERT INTO messages (run_id, seq, kind, content, attempt) VALUES"
                " (:r, 0, 'chunk', :c, 1), (:r, 1, 'error', :c, 1)"
            ),
            {"r": run_id, "c": evil},
        )
        conn.execute(
            text(
                "UPDATE runs SET status = 'failed', error = :c, attempt = 1, finished_at = now()"
                " WHERE id = :r"
            ),
            {"r": run_id, "c": evil},
        )
    c = Console(browser, stack, "mallory")
    c.open(f"run/{run_id}")
    assert c.page.text_content("#run-output") == evil
    assert c.page.text_content("#run-dlq") == evil
    assert c.page.locator("#view img, #view script").count() == 0
    assert c.page.evaluate("window.pwned") is None
    c.close()
    other = Console(browser, stack, "bob")
    other.open(f"run/{run_id}")
    assert "run not found" in str(other.page.text_content("#run-error"))
    assert evil not in str(other.page.text_content("#view"))
    other.close(allowed=("404",))  # the browser logs the refused fetch itself


def test_workers_view_shows_beats_partitions_and_real_lag(browser, stack) -> None:
    # A worker that stopped beating a minute ago, as its last beat sits on the topic.
    gone = Beat("w-gone", datetime.now(UTC) - timedelta(seconds=60), 0, "0.0.9", (), "old-host")
    stack.sub.producer.produce(
        stack.settings.names.topic(WORKERS),
        key=b"w-gone",
        value=gone.encode(),
        headers=beat_headers(),
    )
    assert stack.sub.producer.flush(10) == 0
    # Without the admin token the operator views say what is missing and show nothing.
    user_only = Console(browser, stack, "alice", admin=False)
    user_only.open("workers")
    assert "sign in with the admin token" in str(user_only.page.text_content("#view-error"))
    assert user_only.page.locator("#workers-lag").count() == 0
    user_only.open("usage")
    top_users = str(user_only.page.text_content("#usage-top-users"))
    assert "sign in with the admin token" in top_users and "alice" not in top_users
    user_only.close(allowed=("401",))  # the browser logs the refused fetches itself
    c = Console(browser, stack, "alice")
    c.open("workers")
    c.page.wait_for_selector("tr[data-worker='w1']:not(.stale)", timeout=20_000)
    c.page.wait_for_selector("tr[data-worker='w2']:not(.stale)")
    c.page.wait_for_selector("tr.stale[data-worker='w-gone']", timeout=20_000)
    lag = stack.api("alice", "GET", "/admin/lag").json()
    assert len(lag["partitions"]) == stack.settings.partitions
    assert sum(p["end_offset"] for p in lag["partitions"]) > 0  # the runs submitted so far
    assert c.page.locator("#workers-lag tbody tr").count() == stack.settings.partitions
    c.shot("workers")
    c.close()


def test_schedules_view_pauses_resumes_and_runs_now(browser, stack) -> None:
    made = stack.api(
        "frank",
        "POST",
        "/v1/schedules",
        json={"cron": "0 9 * * 1-5", "timezone": "Europe/Paris", "input": {"text": "daily"}},
    )
    assert made.status_code == 201, made.text
    sid = made.json()["id"]
    c = Console(browser, stack, "frank")
    c.open("schedules")
    row = f"tr[data-schedule='{sid}']"
    c.page.click(f"{row} button[data-action='pause']")
    c.page.wait_for_selector(f"{row} button[data-action='resume']")
    assert stack.sub.query("SELECT enabled FROM schedules WHERE id = :i", i=sid)[0].enabled is False
    c.page.click(f"{row} button[data-action='resume']")
    c.page.wait_for_selector(f"{row} button[data-action='pause']")
    c.page.click(f"{row} button[data-action='run-now']")
    c.page.wait_for_selector("#schedules-message a")
    fired = str(c.page.text_content("#schedules-message a"))
    assert (
        stack.sub.query("SELECT schedule_id FROM runs WHERE id = :i", i=fired)[0].schedule_id == sid
    )
    c.shot("schedules")
    c.close()


def test_webhooks_view_creates_one_shows_its_secret_once_and_lists_deliveries(
    browser, stack
) -> None:
    c = Console(browser, stack, "gina")
    c.open("webhooks")
    c.page.fill("#webhook-url", "http://127.0.0.1:9/hook")
    c.page.click("#view form button[type=submit]")
    c.page.wait_for_selector("#webhook-secret")
    secret = str(c.page.text_content("#webhook-secret"))
    (hook,) = stack.api("gina", "GET", "/v1/webhooks").json()["webhooks"]
    assert secret.startswith("whsec_") and "secret" not in hook
    # A delivery and its failed attempt, as the dispatcher records them; the error text
    # holds markup, which the view shows as text.
    run_id = stack.sub.submit("gina", {"text": "hook me"}, publish=False)
    with stack.sub.engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO webhook_deliveries (id, webhook_id, run_id, user_id, attempts)"
                " VALUES ('msg_console', :w, :r, 'gina', 1)"
            ),
            {"w": hook["id"], "r": run_id},
        )
        conn.execute(
            text(
                "INSERT INTO webhook_attempts (delivery_id, attempt, started_at, duration_ms,"
                " error) VALUES ('msg_console', 1, now(), 12, '<b>HTTP 503</b>')"
            )
        )
    c.open(f"webhooks/{hook['id']}")
    row = "tr[data-delivery='msg_console']"
    c.page.wait_for_selector(row)
    shown = str(c.page.text_content(row))
    assert run_id in shown and "pending" in shown and "<b>HTTP 503</b>" in shown
    assert c.page.locator(f"{row} b").count() == 0
    c.page.click(f"tr[data-webhook='{hook['id']}'] button[data-action='delete']")
    c.page.wait_for_selector("#webhooks-message:has-text('deleted')")
    assert stack.api("gina", "GET", "/v1/webhooks").json()["webhooks"] == []
    c.close()


def test_usage_view_draws_cost_by_day_and_model_and_top_users(browser, stack) -> None:
    wait_until(lambda: stack.sub.query("SELECT 1 FROM ledger WHERE user_id = 'alice'"))
    c = Console(browser, stack, "alice")
    c.open("usage")
    assert c.page.locator("#usage-by-day rect").count() >= 1
    assert "demo-1" in str(c.page.text_content("#usage-by-model"))
    assert "alice" in str(c.page.text_content("#usage-top-users"))
    c.shot("usage")
    c.close()
