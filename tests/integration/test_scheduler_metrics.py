"""The scheduler serves its metrics on KODA_SCHEDULER_PORT.

The scheduler has no HTTP server of its own; koda_runtime.metrics.start_metrics_server serves
the registry for it (the gateway and the workers serve /metrics from their own servers).
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from koda_runtime.localstack import StackInfo
from koda_runtime.schemas.migrate import upgrade
from koda_runtime.settings import Settings
from tests.fixtures.namespaces import drop_schema, make_settings
from tests.fixtures.processes import SchedulerProcess, free_port
from tests.support import wait_until


@pytest.fixture(scope="module")
def space(stack: StackInfo) -> Iterator[Settings]:
    settings = make_settings(stack)
    upgrade(settings)
    yield settings
    drop_schema(settings)


def test_the_scheduler_serves_metrics_on_its_port(space: Settings) -> None:
    port = free_port()
    env = {"KODA_SCHEDULER_PORT": str(port), "KODA_SCHEDULER_POLL": "0.2"}
    scheduler = SchedulerProcess(space, "scheduler-metrics", env).start()
    try:

        def scraped() -> str:
            assert scheduler.alive(), scheduler.log()
            try:
                response = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=1)
            except httpx.HTTPError:
                return ""
            return response.text if response.status_code == 200 else ""

        body = wait_until(scraped, timeout=60, interval=0.2, what="the scheduler's /metrics")
        assert "koda_schedule_fires_total" in body
        assert "koda_schedules_due" in body
    finally:
        assert scheduler.stop(30) == 0, scheduler.log()
