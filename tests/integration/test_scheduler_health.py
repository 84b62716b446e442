"""A real ``koda scheduler`` serves /livez, /readyz and /metrics on KODA_SCHEDULER_PORT.

/readyz is 503 until a pass completes and while passes fail: here PostgreSQL is away
(the scheduler connects through a Toxiproxy the test disables, tests/fixtures/pgproxy.py)
at start-up and again later, and the process stays alive and live throughout. /metrics
answers OpenMetrics to a scraper that asks for it (exemplars need that format).
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from koda_runtime.localstack import StackInfo
from koda_runtime.schemas.migrate import upgrade
from koda_runtime.settings import Settings
from tests.fixtures.namespaces import drop_schema, make_settings
from tests.fixtures.pgproxy import pg_proxy
from tests.fixtures.processes import SchedulerProcess, free_port
from tests.support import wait_until

OPENMETRICS = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"


@pytest.fixture(scope="module")
def space(stack: StackInfo) -> Iterator[Settings]:
    settings = make_settings(stack)
    upgrade(settings)
    yield settings
    drop_schema(settings)


def test_the_scheduler_probes_follow_postgres_and_it_serves_metrics(space: Settings) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with pg_proxy(space.database_url) as proxy:
        proxy.cut()  # away from the start
        env = {
            "KODA_SCHEDULER_PORT": str(port),
            "KODA_SCHEDULER_POLL": "0.2",
            "KODA_DATABASE_URL": proxy.url,
        }
        scheduler = SchedulerProcess(space, "scheduler-health", env).start()
        try:

            def get(path: str, **headers: str) -> httpx.Response | None:
                assert scheduler.alive(), scheduler.log()
                try:
                    return httpx.get(f"{base}{path}", timeout=2, headers=headers)
                except httpx.HTTPError:
                    return None

            def unready() -> dict[str, object] | None:
                r = get("/readyz")
                if r is None or r.status_code != 503:
                    return None
                body: dict[str, object] = r.json()
                return body if "the last pass failed" in str(body.get("reason")) else None

            def ready() -> bool:
                r = get("/readyz")
                return r is not None and r.status_code == 200

            down = wait_until(unready, timeout=60, interval=0.2, what="/readyz while PG is away")
            assert down["status"] == "unavailable" and down["passes"] == 0
            live = get("/livez")
            assert live is not None and live.status_code == 200
            assert live.json()["status"] == "ok"

            proxy.restore()
            wait_until(ready, timeout=30, interval=0.2, what="/readyz after the first pass")

            plain = get("/metrics")
            assert plain is not None and plain.status_code == 200
            assert plain.headers["content-type"].startswith("text/plain")
            assert "koda_schedule_fires_total" in plain.text
            assert "koda_schedules_due" in plain.text
            open_metrics = get("/metrics", accept=OPENMETRICS)
            assert open_metrics is not None
            assert open_metrics.headers["content-type"].startswith("application/openmetrics-text")
            assert open_metrics.text.rstrip().endswith("# EOF")

            proxy.cut()  # away mid-life
            wait_until(unready, timeout=30, interval=0.2, what="/readyz once PG is away again")
            live = get("/livez")
            assert live is not None and live.status_code == 200
            proxy.restore()
            wait_until(ready, timeout=30, interval=0.2, what="/readyz once PG is back")
            missing = get("/nope")
            assert missing is not None and missing.status_code == 404
        finally:
            status = scheduler.stop(30)
    assert status == 0, scheduler.log()
