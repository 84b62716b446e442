"""The gateway's ASGI app: :func:`create_app` wires routes to built components.

The components (gateway/bootstrap.py) are built without connecting; the app's
lifespan runs them (:meth:`~koda_runtime.gateway.bootstrap.Components.serving`): connect, probe,
serve, and on shutdown drain deliveries, stop the producer and dispose the engine.

``/admin`` is guarded as a whole (:class:`AdminGuard`): every path under it needs the
admin access of gateway/auth.py ``check_admin`` before any route sees the request,
whichever router declared the route and whether or not it also declares ``ADMIN``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.routing import BaseRoute

from koda_runtime import metrics
from koda_runtime.gateway.admin import router as admin_router
from koda_runtime.gateway.approvals import router as approvals_router
from koda_runtime.gateway.auth import admit_admin
from koda_runtime.gateway.batch import router as batch_router
from koda_runtime.gateway.bootstrap import Components, build_components
from koda_runtime.gateway.chat import router as chat_router
from koda_runtime.gateway.console import install_console
from koda_runtime.gateway.control import router as control_router
from koda_runtime.gateway.errors import GatewayError, error_response, install_error_handlers
from koda_runtime.gateway.memories import router as memories_router
from koda_runtime.gateway.responses import router as responses_router
from koda_runtime.gateway.routes import router
from koda_runtime.gateway.schedules import router as schedules_router
from koda_runtime.gateway.sse import router as sse_router
from koda_runtime.gateway.submit import METHOD, PATH, SubmitShortcut
from koda_runtime.gateway.usage import router as usage_router
from koda_runtime.gateway.webhooks import router as webhooks_router
from koda_runtime.settings import Settings

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_METHODS = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"})


def create_app(
    settings: Settings,
    *,
    components: Components | None = None,
    run_sweeper: bool = True,
) -> FastAPI:
    """The gateway ASGI app for ``settings``.

    ``components`` default to ``build_components(settings)``; tests pass their own
    (for example with a pre-built publisher). With ``run_sweeper`` false no
    background sweep runs (call ``components.sweeper.sweep_once``).
    """
    gw = components if components is not None else build_components(settings)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        async with gw.serving(sweep=run_sweeper):
            yield

    app = FastAPI(
        title="koda gateway",
        version="1",
        description="Submit long-running runs and read their output.",
        lifespan=lifespan,
    )
    # Read by koda_runtime.gateway.dependencies.get_components, the one place that looks for it.
    app.state.components = gw
    install_error_handlers(app)
    app.include_router(router)
    app.include_router(batch_router)
    app.include_router(control_router)
    app.include_router(approvals_router)
    app.include_router(sse_router)
    app.include_router(usage_router)
    app.include_router(admin_router)
    app.include_router(schedules_router)
    app.include_router(memories_router)
    app.include_router(responses_router)
    app.include_router(chat_router)
    app.include_router(webhooks_router)
    install_console(app)
    app.add_middleware(AdminGuard, components=gw)
    # Inside RequestMetrics (added after it, so outermost), which counts and logs it too.
    app.add_middleware(SubmitShortcut, components=gw, route=_route_of(router, PATH, METHOD))
    app.add_middleware(RequestMetrics)
    return app


ADMIN_PREFIX = "/admin"


def is_admin_path(path: str) -> bool:
    """``/admin`` or anything under it (``/administrator`` is not)."""
    return path == ADMIN_PREFIX or path.startswith(ADMIN_PREFIX + "/")


class AdminGuard:
    """ASGI middleware: a request for ``/admin`` or below is refused (401/403, or 429
    after too many failed logins) unless it has admin access; the rest pass untouched."""

    def __init__(self, app: ASGIApp, components: Components) -> None:
        self.app = app
        self.components = components

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and is_admin_path(_app_path(scope)):
            request = Request(scope, receive)
            try:
                admit_admin(request, self.components.auth, self.components.settings)
            except GatewayError as exc:
                await error_response(exc)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _app_path(scope: Scope) -> str:
    """The path routing matches against: without the app's ``root_path``."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


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


def _route_of(declared: APIRouter, path: str, method: str) -> BaseRoute:
    """``declared``'s route for ``method path`` (included without a prefix)."""
    for route in declared.routes:
        if isinstance(route, APIRoute) and route.path == path and method in (route.methods or ()):
            return route
    raise LookupError(f"no {method} {path} route is declared")


def _method(scope: Scope) -> str:
    method = str(scope.get("method", ""))
    return method if method in _METHODS else "OTHER"


def _route(scope: Scope) -> str:
    route = scope.get("route")
    path = getattr(route, "path", None)
    return path if isinstance(path, str) else "unmatched"
