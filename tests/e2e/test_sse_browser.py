"""A real browser (EventSource in headless Chromium) and ``koda runs follow`` follow one
run while its gateway is killed and started again on the same port: both reconnect by
themselves with Last-Event-ID and end holding exactly the run's output."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from playwright.sync_api import sync_playwright

from koda_runtime.lifecycle.chunks import visible_output
from koda_runtime.processors.handlers.demo import demo_tokens
from koda_runtime.settings import Settings
from tests.fixtures.processes import ROOT, GatewayProcess, WorkerProcess, settings_env
from tests.fixtures.runs import Submitter

CHROMIUM = Path("/usr/bin/chromium")
SSE_ENV = {"KODA_SSE_KEEPALIVE": "0.5", "KODA_SSE_RETRY_MS": "200"}

# The page: an EventSource with the token in the query string (it cannot set headers).
FOLLOW_JS = """
({runId, token}) => {
  const k = window.koda = {events: [], opens: 0, errors: 0, finished: false};
  const url = `/v1/runs/${runId}/events?access_token=${encodeURIComponent(token)}`;
  const es = new EventSource(url);
  es.onopen = () => { k.opens += 1; };
  es.onerror = () => { k.errors += 1; };
  for (const kind of ["chunk", "reset", "status", "done", "error", "cancelled"]) {
    es.addEventListener(kind, (e) => {
      k.events.push({id: e.lastEventId, kind: kind, data: JSON.parse(e.data)});
      if (kind === "done" || kind === "error" || kind === "cancelled") {
        k.finished = true;
        es.close();
      }
    });
  }
}
"""


def test_browser_and_cli_resume_across_a_gateway_restart(env: Settings) -> None:
    if not CHROMIUM.exists():
        pytest.fail("chromium is missing: run `make system-deps` (apt-get install chromium)")
    sub = Submitter(env)
    gateways = [GatewayProcess(env, dict(SSE_ENV)).start()]
    worker = WorkerProcess(env, "w1").start()
    user = "browser-user"
    inp = {"text": "hello from a browser", "demo": {"tokens": 80, "delay_ms": 100}}
    cli: subprocess.Popen[bytes] | None = None
    out = tempfile.NamedTemporaryFile(prefix="koda-follow-", suffix=".out", delete=False)
    err = tempfile.NamedTemporaryFile(prefix="koda-follow-", suffix=".err", delete=False)
    try:
        run_id = sub.submit(user, inp)
        cli = subprocess.Popen(  # noqa: S603
            [
                sys.executable,
                "-m",
                "koda_runtime.cli",
                "runs",
                "follow",
                run_id,
                "--user",
                user,
                "--gateway",
                gateways[0].url,
            ],
            env=settings_env(env),
            cwd=ROOT,
            stdout=out,
            stderr=err,
            start_new_session=True,
        )
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=str(CHROMIUM), headless=True)
            try:
                page = browser.new_page()
                page.goto(f"{gateways[0].url}/livez")
                page.evaluate(FOLLOW_JS, {"runId": run_id, "token": f"dev:{user}"})
                page.wait_for_function("window.koda.events.length >= 10", timeout=60_000)
                assert not page.evaluate("window.koda.finished")
                first = gateways[0]
                assert first.proc is not None
                os.kill(first.proc.pid, signal.SIGKILL)  # no goodbye: the stream just breaks
                first.proc.wait(10)
                page.wait_for_function("window.koda.errors >= 1", timeout=10_000)
                gateways.append(GatewayProcess(env, dict(SSE_ENV), port=first.port).start())
                page.wait_for_function("window.koda.finished", timeout=90_000)
                state = page.evaluate("window.koda")
            finally:
                browser.close()
        rows = sub.messages(run_id)
        events = state["events"]
        assert [int(e["id"]) for e in events] == [r.seq for r in rows]  # no gap, no duplicate
        assert [e["kind"] for e in events] == [r.kind for r in rows]
        got = [(int(e["id"]), e["kind"], e["data"].get("content", "")) for e in events]
        assert visible_output(got) == "".join(demo_tokens(inp))
        assert state["opens"] >= 2, state  # it reconnected on its own
        assert "Traceback" not in gateways[1].log()
        # The terminal client resumed by itself too, and printed exactly the output.
        assert cli.wait(60) == 0, Path(err.name).read_text()
        assert Path(out.name).read_text() == "".join(demo_tokens(inp)) + "\n"
        assert "connection lost" in Path(err.name).read_text()
    finally:
        if cli is not None and cli.poll() is None:
            cli.kill()
            cli.wait()
        worker.stop()
        for g in gateways:
            g.stop()
        sub.close()
        for f in (out, err):
            f.close()
            Path(f.name).unlink(missing_ok=True)
