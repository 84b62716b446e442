"""The scheduler process's composition root: engine, producer, sweeper, the pass loop.

SIGTERM or SIGINT ends the loop after the pass in progress (its runs are inserted and
published, or left pending for a sweeper), then the producer is flushed and the
engine disposed; the process exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

from koda_runtime import metrics
from koda_runtime.db import async_engine
from koda_runtime.gateway.publisher import RunPublisher
from koda_runtime.gateway.scheduled import ScheduleStore
from koda_runtime.gateway.store import RunStore
from koda_runtime.gateway.sweeper import Sweeper
from koda_runtime.kafka import producer_config
from koda_runtime.scheduler.service import Scheduler
from koda_runtime.settings import Settings

log = logging.getLogger(__name__)

ROLE = "scheduler"
FLUSH_TIMEOUT_S = 5.0
# One batch at a time plus the sweeper: Postgres connections per replica.
POOL_SIZE = 4


async def serve(settings: Settings) -> None:
    """Run one scheduler replica until SIGTERM/SIGINT."""
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    engine = async_engine(settings, pool_size=POOL_SIZE)
    publisher = RunPublisher(settings, config=producer_config(settings, ROLE))
    await publisher.start()
    runs = RunStore(engine)
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
    # this sweeper (the gateway's) publishes it even when no gateway runs.
    sweeper = Sweeper(
        runs, publisher, after_s=settings.sweep_after_s, interval_s=settings.sweep_interval_s
    )
    sweeping = asyncio.create_task(sweeper.run_forever(), name="scheduler-sweeper")
    if settings.scheduler_port:
        metrics.start_metrics_server(settings.scheduler_port, settings.worker_host)
    log.info(
        "event=scheduler_started env=%s namespace=%s replica=%s",
        settings.app_env.value,
        settings.namespace or "-",
        scheduler.salt,
    )
    try:
        await scheduler.run_forever(stopping)
    finally:
        sweeping.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sweeping
        await publisher.stop(FLUSH_TIMEOUT_S)
        await engine.dispose()
        log.info("event=scheduler_stopped")


def run_scheduler(settings: Settings) -> None:
    asyncio.run(serve(settings))
