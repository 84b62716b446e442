"""The broker is down while the gateway publishes: Postgres keeps the run, the
sweeper republishes it once the broker is back, and a worker finishes it."""

from __future__ import annotations

import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from koda_runtime.localstack import StackInfo, down, kafka_node_start, kafka_node_stop, up
from koda_runtime.schemas.migrate import upgrade
from koda_runtime.settings import Settings
from koda_runtime.topics.admin import apply_topics
from tests.fixtures.namespaces import make_settings
from tests.fixtures.processes import GatewayProcess, WorkerProcess
from tests.fixtures.runs import Submitter
from tests.support import wait_until


@pytest.fixture(scope="module")
def private_stack() -> Iterator[tuple[Path, StackInfo]]:
    """A stack of this module's own: its broker is stopped on purpose."""
    state = Path(tempfile.mkdtemp(prefix="koda-outage-", dir="/tmp"))
    try:
        yield state, up(state)
    finally:
        try:
            down(state)
        finally:
            shutil.rmtree(state, ignore_errors=True)


def test_run_published_while_broker_down_is_swept_and_done(private_stack) -> None:
    state, info = private_stack
    settings: Settings = make_settings(
        info, sweep_after_s=1.0, sweep_interval_s=0.5, publish_timeout_s=3.0
    )
    upgrade(settings)
    apply_topics(settings)
    sub = Submitter(settings)
    gateway = GatewayProcess(
        settings,
        {"KODA_SWEEP_AFTER": "1", "KODA_SWEEP_INTERVAL": "0.5", "KODA_PUBLISH_TIMEOUT": "3"},
    ).start()
    worker = WorkerProcess(settings, "w1").start()
    try:
        auth = {"Authorization": "Bearer dev:outage-user"}
        warm = httpx.post(
            f"{gateway.url}/v1/runs",
            headers=auth,
            json={"input": {"text": "warm", "demo": {"tokens": 2, "delay_ms": 1}}},
        )
        assert warm.status_code == 202
        wait_until(
            lambda: sub.all_terminal([warm.json()["run_id"]]), timeout=60, what="warm-up run"
        )

        kafka_node_stop(state, 1)
        resp = httpx.post(
            f"{gateway.url}/v1/runs",
            headers=auth,
            timeout=30,
            json={"input": {"text": "during outage", "demo": {"tokens": 3, "delay_ms": 1}}},
        )
        assert resp.status_code == 202, resp.text
        run_id = resp.json()["run_id"]
        # The publish fails (message timeout); the run is pending and marked unpublished.
        wait_until(
            lambda: (
                sub.query("SELECT status, published_at FROM runs WHERE id = :r", r=run_id)[0]
                == ("pending", None)
            ),
            timeout=20,
            what="publish failure recorded",
        )
        kafka_node_start(state, 1)
        wait_until(lambda: sub.all_terminal([run_id]), timeout=120, what="swept run done")
        row = sub.query("SELECT status, attempt FROM runs WHERE id = :r", r=run_id)[0]
        assert (row.status, row.attempt) == ("done", 1)
        assert re.search(r"event=sweep_done republished=[1-9]", gateway.log()), gateway.log()[
            -3000:
        ]
    finally:
        worker.stop()
        gateway.stop()
        sub.close()
