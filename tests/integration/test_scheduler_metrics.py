"""The scheduler serves its metrics on KODA_SCHEDULER_PORT.

The scheduler has no HTTP server of its own; koda.metrics.start_metrics_server serves
the registry for it (the gateway and the workers serve /metrics from their own servers).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from koda.settings import Settings
from schemas.migrate import upgrade
from tests.integration.conftest import drop_schema, make_settings
from tests.support import wait_until
from tests.workers import ROOT, free_port, settings_env


@pytest.fixture(scope="module")
def space(stack) -> Iterator[Settings]:  # type: ignore[no-untyped-def]
    settings = make_settings(stack)
    upgrade(settings)
    yield settings
    drop_schema(settings)


def test_the_scheduler_serves_metrics_on_its_port(space: Settings) -> None:
    port = free_port()
    with tempfile.NamedTemporaryFile(prefix="koda-scheduler-", suffix=".log") as log:
        proc = subprocess.Popen(  # noqa: S603
            [sys.executable, "-m", "koda", "scheduler"],
            env=settings_env(space, KODA_SCHEDULER_PORT=str(port), KODA_SCHEDULER_POLL="0.2"),
            cwd=ROOT,
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
        try:

            def scraped() -> str:
                assert proc.poll() is None, Path(log.name).read_text()
                try:
                    response = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=1)
                except httpx.HTTPError:
                    return ""
                return response.text if response.status_code == 200 else ""

            body = wait_until(scraped, timeout=60, interval=0.2, what="the scheduler's /metrics")
            assert "koda_schedule_fires_total" in body
            assert "koda_schedules_due" in body
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(30) == 0, Path(log.name).read_text()
