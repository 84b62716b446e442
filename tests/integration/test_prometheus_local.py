"""`koda services up --with-prometheus` on a scratch state dir: the real Prometheus
binary scrapes koda's /metrics from the target file `koda dev` writes, loads the alert
rules, and `koda services down` stops it with the rest of the stack."""

from __future__ import annotations

import json
import shutil
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import start_http_server
from typer.testing import CliRunner

from koda_runtime import metrics
from koda_runtime.cli.services import services_app
from koda_runtime.localstack import procs, prometheus, stack
from tests.support import wait_until


def api(base: str, path: str) -> Any:
    with urllib.request.urlopen(f"{base}{path}", timeout=5) as response:  # noqa: S310 - loopback
        body = json.loads(response.read())
    assert body["status"] == "success", body
    return body["data"]


@pytest.fixture
def metrics_endpoints() -> Iterator[tuple[int, int]]:
    """Two real /metrics servers of koda's registry, as a gateway's and a worker's."""
    servers = []
    ports = procs.free_ports(2)
    for port in ports:
        server, thread = start_http_server(port, addr="127.0.0.1", registry=metrics.REGISTRY)
        servers.append((server, thread))
    yield ports[0], ports[1]
    for server, thread in servers:
        server.shutdown()
        thread.join()


@pytest.fixture
def state_dir() -> Iterator[Path]:
    """A scratch state dir directly under /tmp (PostgreSQL's user must enter it)."""
    path = Path(tempfile.mkdtemp(prefix="koda-test-prometheus-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_prometheus_scrapes_the_dev_targets_and_loads_the_alerts(
    state_dir: Path, metrics_endpoints: tuple[int, int]
) -> None:
    gateway_port, worker_port = metrics_endpoints
    dead_worker = procs.free_port()
    runner = CliRunner()
    try:
        up = runner.invoke(
            services_app,
            ["up", "--with-prometheus", "--state-dir", str(state_dir)],
            env={"APP_ENV": None},  # the local stack is dev without being told
        )
        assert up.exit_code == 0, up.output
        assert "schema koda_dev migrated" in up.output
        status = prometheus.status(state_dir)
        assert status is not None and status["running"]
        base = status["url"]
        assert f"prometheus on {base}" in up.output
        assert prometheus.start(state_dir) == base  # idempotent: the running one is reused
        shown = runner.invoke(services_app, ["status", "--state-dir", str(state_dir)])
        assert f"prometheus {base}  running pid=" in shown.output
        prometheus.write_targets(
            state_dir,
            prometheus.DEV_TARGETS,
            [f"127.0.0.1:{gateway_port}"],
            [f"127.0.0.1:{worker_port}", f"127.0.0.1:{dead_worker}"],
        )

        def health() -> dict[tuple[str, str], str] | None:
            active = api(base, "/api/v1/targets?state=active")["activeTargets"]
            seen = {(t["labels"]["job"], t["labels"]["instance"]): t["health"] for t in active}
            return seen if "unknown" not in seen.values() and len(seen) == 3 else None

        seen = wait_until(health, timeout=60, interval=0.5, what="three targets scraped")
        assert seen == {
            ("koda-gateway", f"127.0.0.1:{gateway_port}"): "up",
            ("koda-worker", f"127.0.0.1:{worker_port}"): "up",
            ("koda-worker", f"127.0.0.1:{dead_worker}"): "down",
        }
        in_flight = api(base, '/api/v1/query?query=koda_runs_in_flight{job="koda-worker"}')
        assert [r["metric"]["instance"] for r in in_flight["result"]] == [
            f"127.0.0.1:{worker_port}"
        ]
        groups = api(base, "/api/v1/rules?type=alert")["groups"]
        alerts = {rule["name"] for group in groups for rule in group["rules"]}
        assert {"KodaWorkerStale", "KodaConsumerLagGrowing", "KodaBudgetExhausted"} <= alerts
    finally:
        down = runner.invoke(services_app, ["down", "--state-dir", str(state_dir)])
    assert down.exit_code == 0, down.output
    assert prometheus.running_pid(state_dir) is None
    assert procs.port_is_free(int(base.rsplit(":", 1)[1]))
    assert not stack.status(state_dir)["running"]
