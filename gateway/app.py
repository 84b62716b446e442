"""The gateway's composition root: :func:`create_app` builds everything from Settings.

Nothing connects at import or in ``create_app``: the lifespan creates the engine
and the producer, probes both (a failure is logged and shows on ``/readyz``; the
gateway still starts so it can recover without a restart), starts the sweeper,
and on shutdown drains deliveries, stops the producer and disposes the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.admin import router as admin_router
from gateway.admission import Admissions
from gateway.auth import Authenticator
from gateway.components import Components
from gateway.console import install_console
from gateway.control import router as control_router
from gateway.control_store import ControlStore
from gateway.errors import install_error_handlers
from gateway.memories import router as memories_router
from gateway.publisher import RunPublisher
from gateway.ratelimit import TokenBuckets
from gateway.routes import router
from gateway.schedules import router as schedules_router
from gateway.sse import install_live_feed
from gateway.sse import router as sse_router
from gateway.store import RunStore
from gateway.sweeper import Sweeper
from gateway.usage import router as usage_router
from gateway.workers import WorkerDirectory
from koda import metrics
from koda.db import async_engine
from koda.errors import KodaError
from koda.settings import Settings

log = logging.getLogger(__name__)

DRAIN_TIMEOUT_S = 5.0
FLUSH_TIMEOUT_S = 3.0
STARTUP_PROBE_TIMEOUT_S = 5.0

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_METHODS = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"})


def create_app(
    settings: Settings,
    *,
    engine: AsyncEngine | None = None,
    publisher: RunPublisher | None = None,
    run_sweeper: bool = True,
) -> FastAPI:
    """The gateway ASGI app for ``settings``.

    ``engine`` and ``publisher`` may be given pre-built (tests); the app starts a
    given publisher if needed but closes neither: their owner does. With
    ``run_sweeper`` false no background sweep runs (call ``Sweeper.sweep_once``).
    """

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        own_engine = engine is None
        own_publisher = publisher is None
        db = engine if engine is not None else async_engine(settings)
        pub = publisher if publisher is not None else RunPublisher(settings)
        sweep_task: asyncio.Task[None] | None = None
        feed = install_live_feed(app, settings)
        directory = WorkerDirectory(settings)
        admissions: Admissions | None = None
        try:
            await pub.start()
            await feed.start()  # before serving: streams must not miss a record
            store = RunStore(db)
            await _probe(store, pub)
            control = ControlStore(db)
            admissions = Admissions(
                store,
                pub,
                partitions=settings.partitions,
                control=control,
                merge_window_s=settings.merge_window_s,
                names=settings.names,
                budgets=settings.cost_ledger,
            )
            sweeper = Sweeper(
                store, pub, after_s=settings.sweep_after_s, interval_s=settings.sweep_interval_s
            )
            app.state.components = Components(
                settings=settings,
                auth=Authenticator.from_settings(settings),
                limiter=TokenBuckets(settings.rate_per_s, settings.rate_burst),
                store=store,
                publisher=pub,
                admissions=admissions,
                sweeper=sweeper,
                control=control,
            )
            directory.start()  # the heartbeat table; never a readiness dependency
            app.state.workers = directory
            if run_sweeper:
                sweep_task = asyncio.create_task(sweeper.run_forever(), name="gateway-sweeper")
            log.info(
                "event=gateway_started env=%s namespace=%s topic=%s",
                settings.app_env.value,
                settings.namespace or "-",
                pub.topic,
            )
            yield
        finally:
            await feed.stop()
            await directory.stop()
            if sweep_task is not None:
                sweep_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await sweep_task
            if admissions is not None:
                await admissions.drain(DRAIN_TIMEOUT_S)
            if own_publisher:
                await pub.stop(FLUSH_TIMEOUT_S)
            if own_engine:
                await db.dispose()
            log.info("event=gateway_stopped")

    app = FastAPI(
        title="koda gateway",
        version="1",
        description="Submit long-running runs and read their output.",
        lifespan=lifespan,
    )
    install_error_handlers(app)
    app.include_router(router)
    app.include_router(control_router)
    app.include_router(sse_router)
    app.include_router(usage_router)
    app.include_router(admin_router)
    app.include_router(schedules_router)
    app.include_router(memories_router)
    install_console(app)
    app.add_middleware(RequestMetrics)
    return app


async def _probe(store: RunStore, publisher: RunPublisher) -> None:
    for name, probe in (
        ("postgres", store.ping()),
        ("kafka", publisher.check(STARTUP_PROBE_TIMEOUT_S)),
    ):
        try:
            await asyncio.wait_for(probe, STARTUP_PROBE_TIMEOUT_S + 1)
        except (KodaError, TimeoutError) as exc:
            log.warning("event=dependency_unavailable dependency=%s error=%s", name, exc)


class RequestMetrics:
    """Counts and times every request by route template; logs one line per request."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                metrics.HTTP_REQUEST_SECONDS.labels(
                    method=_method(scope), route=_route(scope)
                ).observe(time.perf_counter() - started)
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            method, route = _method(scope), _route(scope)
            metrics.HTTP_REQUESTS.labels(method=method, route=route, status=str(status)).inc()
            if route not in ("/metrics", "/livez", "/readyz"):
                user_id = scope.get("state", {}).get("user_id", "-")
                log.info(
                    "event=http_request method=%s route=%s status=%d user_id=%s duration_ms=%.1f",
                    method,
                    route,
                    status,
                    user_id,
                    (time.perf_counter() - started) * 1000,
                )


def _method(scope: Scope) -> str:
    method = str(scope.get("method", ""))
    return method if method in _METHODS else "OTHER"


def _route(scope: Scope) -> str:
    route = scope.get("route")
    path = getattr(route, "path", None)
    return path if isinstance(path, str) else "unmatched"
