"""The gateway's composition root: :func:`build_components` makes every collaborator.

Each object is handed its collaborators when it is built, and nothing connects
here. :meth:`Components.serving` is the running part (the app's lifespan enters
it): it starts the producer and the live feed, probes Postgres and Kafka (a
failure is logged and shows on ``/readyz``; the gateway still starts so it can
recover without a restart), starts the workers' tail and the sweeper, and on the
way out stops them, drains deliveries, stops the producer and disposes the engine
(those two only when it built them).

Handlers receive the components through FastAPI's ``Depends``
(gateway/dependencies.py), never by reaching into the app.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncEngine

from koda_runtime.errors import KodaError
from koda_runtime.gateway.admission import Admissions
from koda_runtime.gateway.auth import Authenticator
from koda_runtime.gateway.livefeed import LiveFeed
from koda_runtime.gateway.ratelimit import TokenBuckets
from koda_runtime.gateway.workers import WorkerDirectory
from koda_runtime.lifecycle.attempts import claim_bound
from koda_runtime.schemas.db import async_engine
from koda_runtime.schemas.runs.admission import RunAdmission
from koda_runtime.schemas.runs.control import ControlStore
from koda_runtime.schemas.runs.reads import RunReads
from koda_runtime.schemas.schedules import ScheduleStore
from koda_runtime.settings import Settings
from koda_runtime.topics.kafka.publisher import RunPublisher
from koda_runtime.topics.sweeper import Sweeper

log = logging.getLogger(__name__)

DRAIN_TIMEOUT_S = 5.0
FLUSH_TIMEOUT_S = 3.0
STARTUP_PROBE_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Components:
    """Everything a running gateway holds, each built once by :func:`build_components`."""

    settings: Settings
    auth: Authenticator
    limiter: TokenBuckets
    engine: AsyncEngine
    store: RunAdmission  # admission's writes and reads (schemas/runs/admission.py)
    reads: RunReads
    control: ControlStore
    schedules: ScheduleStore
    publisher: RunPublisher
    admissions: Admissions
    sweeper: Sweeper
    feed: LiveFeed
    workers: WorkerDirectory
    owns_engine: bool = True
    owns_publisher: bool = True

    @asynccontextmanager
    async def serving(self, *, sweep: bool = True) -> AsyncIterator[None]:
        """Connect and run everything until the block exits, then stop in reverse.

        With ``sweep`` false no background sweep runs (call ``sweeper.sweep_once``).
        """
        sweep_task: asyncio.Task[None] | None = None
        try:
            await self.publisher.start()
            await self.feed.start()  # before serving: streams must not miss a record
            await self._probe()
            self.workers.start()  # the heartbeat table; never a readiness dependency
            if sweep:
                sweep_task = asyncio.create_task(self.sweeper.run_forever(), name="gateway-sweeper")
            log.info(
                "event=gateway_started env=%s namespace=%s topic=%s",
                self.settings.app_env.value,
                self.settings.namespace or "-",
                self.publisher.topic,
            )
            yield
        finally:
            await self.feed.stop()
            await self.workers.stop()
            if sweep_task is not None:
                sweep_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await sweep_task
            await self.admissions.drain(DRAIN_TIMEOUT_S)
            if self.owns_publisher:
                await self.publisher.stop(FLUSH_TIMEOUT_S)
            if self.owns_engine:
                await self.engine.dispose()
            log.info("event=gateway_stopped")

    async def _probe(self) -> None:
        for name, probe in (
            ("postgres", self.store.ping()),
            ("kafka", self.publisher.check(STARTUP_PROBE_TIMEOUT_S)),
        ):
            try:
                await asyncio.wait_for(probe, STARTUP_PROBE_TIMEOUT_S + 1)
            except (KodaError, TimeoutError) as exc:
                log.warning("event=dependency_unavailable dependency=%s error=%s", name, exc)


def build_components(
    settings: Settings,
    *,
    engine: AsyncEngine | None = None,
    publisher: RunPublisher | None = None,
) -> Components:
    """Every collaborator of a gateway for ``settings``; nothing connects yet.

    ``engine`` and ``publisher`` may be given pre-built (tests): the components use
    them but neither stop nor dispose them; their owner does.
    """
    db = engine if engine is not None else async_engine(settings)
    pub = publisher if publisher is not None else RunPublisher(settings)
    store = RunAdmission(db)
    control = ControlStore(db)
    return Components(
        settings=settings,
        auth=Authenticator.from_settings(settings),
        limiter=TokenBuckets(settings.rate_per_s, settings.rate_burst),
        engine=db,
        store=store,
        reads=RunReads(db),
        control=control,
        schedules=ScheduleStore(db),
        publisher=pub,
        admissions=Admissions(
            store,
            pub,
            partitions=settings.partitions,
            control=control,
            merge_window_s=settings.merge_window_s,
            dedup_window_s=settings.dedup_window_s,
            max_claims=claim_bound(settings.max_attempts),
            names=settings.names,
            budgets=settings.cost_ledger,
            max_active=settings.max_active_runs_per_user,
        ),
        sweeper=Sweeper(
            store, pub, after_s=settings.sweep_after_s, interval_s=settings.sweep_interval_s
        ),
        feed=LiveFeed(settings),
        workers=WorkerDirectory(settings),
        owns_engine=engine is None,
        owns_publisher=publisher is None,
    )
