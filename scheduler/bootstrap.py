"""The scheduler process's composition root: engine, producer, sweeper, the pass loop,
and its HTTP endpoints.

SIGTERM or SIGINT ends the loop after the pass in progress (its runs are inserted and
published, or left pending for a sweeper), then the producer is flushed and the
engine disposed; the process exits 0.

On ``KODA_SCHEDULER_PORT`` (``KODA_WORKER_HOST``; none when 0) it serves, from its event
loop, like the worker (processors/health.py):

* ``/livez``: 503 once the pass loop has shown no progress (a pass begun or ended, a
  batch begun) for ``STALL_AFTER_S``: a statement that hangs. The loop wakes at least
  every ``KODA_SCHEDULER_POLL``; an event loop that is blocked answers nothing at all.
* ``/readyz``: 200 once a pass has completed and while the last one did not fail; 503
  before the first pass and while Postgres (or the broker) makes passes fail, with the
  reason. A replica that cannot fire is not ready, so a rollout keeps the old one.
* ``/metrics``: koda's registry, in OpenMetrics when the scraper asks for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from koda_runtime import metrics
from koda_runtime.kafka import producer_config
from koda_runtime.scheduler.service import Scheduler
from koda_runtime.schemas.db import async_engine
from koda_runtime.schemas.runs.admission import RunAdmission
from koda_runtime.schemas.schedules import ScheduleStore
from koda_runtime.settings import Settings
from koda_runtime.topics.kafka.publisher import RunPublisher
from koda_runtime.topics.sweeper import Sweeper

log = logging.getLogger(__name__)

ROLE = "scheduler"
FLUSH_TIMEOUT_S = 5.0
# One batch at a time plus the sweeper: Postgres connections per replica.
POOL_SIZE = 4
ROUTES = ("/livez", "/readyz", "/metrics")
# A pass's statements and its producer waits are bounded well below this (the pool's
# 30 s timeout, the publisher's delivery timeout); past it the loop is stuck.
STALL_AFTER_S = 300.0


def live(
    scheduler: Scheduler, clock: Callable[[], float] = time.monotonic
) -> tuple[bool, dict[str, Any]]:
    """``/livez``: False once the pass loop has made no progress for ``STALL_AFTER_S``."""
    silent = clock() - scheduler.last_progress
    detail = {"silent_s": round(silent, 3), "stall_after_s": STALL_AFTER_S}
    return silent <= STALL_AFTER_S, detail


def ready(scheduler: Scheduler) -> tuple[bool, dict[str, Any]]:
    """``/readyz``: True once a pass has completed and while the last one did not fail."""
    detail: dict[str, Any] = {"passes": scheduler.passes}
    if scheduler.last_error is not None:
        detail["reason"] = f"the last pass failed: {scheduler.last_error}"
        return False, detail
    if scheduler.passes == 0:
        detail["reason"] = "no pass has completed yet"
        return False, detail
    return True, detail


def health_app(scheduler: Scheduler) -> web.Application:
    """The scheduler's ``ROUTES`` as an aiohttp application."""

    def probe(check: Callable[[], tuple[bool, dict[str, Any]]]) -> Any:
        async def handler(_request: web.Request) -> web.Response:
            ok, detail = check()
            body = {"status": "ok" if ok else "unavailable", **detail}
            return web.json_response(body, status=200 if ok else 503)

        return handler

    async def scrape(request: web.Request) -> web.Response:
        body, content_type = metrics.exposition(request.headers.get("Accept"))
        return web.Response(body=body, headers={"Content-Type": content_type})

    app = web.Application()
    app.router.add_get("/livez", probe(lambda: live(scheduler)))
    app.router.add_get("/readyz", probe(lambda: ready(scheduler)))
    app.router.add_get("/metrics", scrape)
    return app


async def start_health(scheduler: Scheduler, host: str, port: int) -> web.AppRunner:
    """Serve :func:`health_app` on ``host:port``; ``cleanup()`` the runner to stop.
    Raises OSError when the port is taken."""
    runner = web.AppRunner(health_app(scheduler), access_log=None, handle_signals=False)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError:
        await runner.cleanup()
        raise
    return runner


async def serve(settings: Settings) -> None:
    """Run one scheduler replica until SIGTERM/SIGINT."""
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    engine = async_engine(settings, pool_size=POOL_SIZE)
    publisher = RunPublisher(settings, config=producer_config(settings, ROLE))
    await publisher.start()
    runs = RunAdmission(engine)
    scheduler = Scheduler(
        ScheduleStore(engine),
        runs,
        publisher,
        partitions=settings.partitions,
        batch=settings.scheduler_batch,
        poll_s=settings.scheduler_poll_s,
        budgets=settings.cost_ledger,
    )
    # A replica killed between a run's insert and its publish leaves the run pending;
    # this sweeper (the gateway's too) publishes it even when no gateway runs.
    sweeper = Sweeper(
        runs, publisher, after_s=settings.sweep_after_s, interval_s=settings.sweep_interval_s
    )
    sweeping = asyncio.create_task(sweeper.run_forever(), name="scheduler-sweeper")
    health = None
    try:
        if settings.scheduler_port:
            health = await start_health(scheduler, settings.worker_host, settings.scheduler_port)
        log.info(
            "event=scheduler_started env=%s namespace=%s replica=%s",
            settings.app_env.value,
            settings.namespace or "-",
            scheduler.salt,
        )
        await scheduler.run_forever(stopping)
    finally:
        sweeping.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sweeping
        if health is not None:
            await health.cleanup()
        await publisher.stop(FLUSH_TIMEOUT_S)
        await engine.dispose()
        log.info("event=scheduler_stopped")


def run_scheduler(settings: Settings) -> None:
    asyncio.run(serve(settings))
