"""The worker's composition root (processors/bootstrap.py) shares one of each part, and
its two backwards links (the app's services, the runtime behind the rebalance hooks)
fail by name when they are missing instead of on an unbound name.

Nothing here connects: building the worker only constructs its parts.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator

import pytest

from koda_runtime.naming import AppEnv
from koda_runtime.processors.bootstrap import Worker, build_worker
from koda_runtime.processors.faust_app import KodaApp, faust_settings
from koda_runtime.processors.rebalance import RuntimeHooks
from koda_runtime.settings import Settings

SETTINGS = Settings(app_env=AppEnv.DEV, worker_id="w-wiring")


@pytest.fixture
def worker() -> Iterator[Worker]:
    with tempfile.TemporaryDirectory(prefix="koda-faust-") as datadir:
        yield build_worker(SETTINGS, datadir)


def test_the_root_builds_one_of_each_part_and_hands_it_on(worker: Worker) -> None:
    services = worker.app.services
    # The group writer is the root's: the executor writes through the one the app closes.
    assert services.group_writer is worker.executor.writer
    assert services.runtime is worker.runtime
    assert services.ops is worker.ops
    # The emitter sends through the app's producer.
    assert worker.executor.emitter._send == worker.app.produce  # type: ignore[attr-defined]
    # The backwards link: the intake's hooks reach the runtime built after the intake.
    assert services.intake._hooks.runtime is worker.runtime  # type: ignore[attr-defined]
    # What the intake hands over lands on the dispatcher's queue.
    services.intake._feed._deliver([])
    assert services.dispatcher.queue.get_nowait() == []


async def test_a_hook_called_before_its_runtime_is_attached_says_so() -> None:
    hooks = RuntimeHooks()
    with pytest.raises(RuntimeError, match="before its worker runtime was attached"):
        await hooks.assigned([0])
    with pytest.raises(RuntimeError, match="before its worker runtime was attached"):
        await hooks.revoked([0])


def test_the_hooks_take_one_runtime(worker: Worker) -> None:
    with pytest.raises(RuntimeError, match="already have a worker runtime"):
        worker.app.services.intake._hooks.attach(worker.runtime)  # type: ignore[attr-defined]


async def test_an_app_without_its_worker_services_names_the_builder() -> None:
    with tempfile.TemporaryDirectory(prefix="koda-faust-") as datadir:
        app = KodaApp("w-wiring", **faust_settings(SETTINGS, datadir))
        with pytest.raises(RuntimeError, match="no worker services: build the worker"):
            await app.leave()


def test_an_app_hosts_its_services_once(worker: Worker) -> None:
    with pytest.raises(RuntimeError, match="already given to this app"):
        worker.app.host(worker.app.services)
