"""``POST /v1/runs``: the checks and the admission, and the ASGI shortcut that serves it.

:func:`accept` is the endpoint's whole behaviour. It checks, in order: bearer token
(401), per-user rate (429, :func:`take_rate_token`, which ``run-now`` of a schedule
shares), content type (415), ``Idempotency-Key`` (400), size (413), a body slower than
KODA_BODY_READ_TIMEOUT (408), UTF-8 and JSON (400), fields (422). Then it admits the
run, which a session of another user (404), a spent budget (402) or the user's runs not
yet ended reaching KODA_MAX_ACTIVE_RUNS_PER_USER (429, ``too_many_active_runs``) still
refuse, unless the key already has a run (a replay answers that run). A message merged
into a running run is refused by a spent budget too (402), and by the caps on merges
per run and on the merged input's size (409, gateway/quotas.py). Every refusal happens
before anything is written and is counted in ``koda_admissions_rejected_total{reason}``
(reason = the error code; a Postgres outage, answered 503, counts as ``unavailable``).

**Why a shortcut.** Submissions are the gateway's hot path: at 32 concurrent clients,
FastAPI's routing, dependency solving, response-model validation and the
exception and exit-stack middlewares took about a third of the gateway's CPU per
request (py-spy, ``tests.bench.profile --through w3``). Those layers add nothing to this
endpoint, which takes no parameters and reads its body itself. :class:`SubmitShortcut`
sits inside the request-metrics middleware, so the metrics and the access line stay
the same. It answers ``POST /v1/runs`` itself with the same :func:`accept`. Errors are
rendered by the gateway's own handlers, so the answers are the same byte for byte.
Everything else goes to the app. The route stays declared on the app for OpenAPI, and
it is served there when the shortcut is not installed.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from opentelemetry.trace import SpanKind
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute

from koda_runtime import metrics, tracing
from koda_runtime.caps import CapReached
from koda_runtime.errors import DatabaseError, Refused
from koda_runtime.gateway.auth import authenticate_request
from koda_runtime.gateway.bootstrap import Components
from koda_runtime.gateway.errors import (
    DOMAIN_ERRORS,
    GatewayError,
    RateLimited,
    answer_error,
    http_error,
)
from koda_runtime.gateway.intake import (
    check_content_type,
    check_idempotency_key,
    decode_json,
    parse_run_request,
)
from koda_runtime.gateway.models import RunAccepted
from koda_runtime.gateway.quotas import limit_reached, read_body_within
from koda_runtime.schemas.runs.control import MergeCaps

log = logging.getLogger(__name__)

PATH = "/v1/runs"
METHOD = "POST"
# The errors the gateway's handlers answer (4xx, 503); anything else is a 500.
ANSWERED: tuple[type[Exception], ...] = (GatewayError, *DOMAIN_ERRORS)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def events_url(run_id: str) -> str:
    """Where a run's output streams (``GET``, Server-Sent Events)."""
    return f"/v1/runs/{run_id}/events"


def take_rate_token(gw: Components, user_id: str) -> None:
    """Spend one of ``user_id``'s submissions (KODA_RATE_PER_S, KODA_RATE_BURST), or
    raise RateLimited (429 with Retry-After). Every request that creates a run of the
    user's own asking takes one: ``POST /v1/runs`` and a schedule's ``run-now``."""
    decision = gw.limiter.take(user_id)
    if not decision.allowed:
        raise RateLimited(decision.retry_after_s)


async def accept(request: Request, gw: Components) -> RunAccepted:
    """Check and admit one submission; raises the refusal (a GatewayError or a domain
    error, rendered by the gateway's error handlers) when it is not admitted.

    In the request's span (koda/tracing.py), which continues a client's ``traceparent``
    and whose context the run's record carries."""
    with tracing.span(
        "POST /v1/runs", kind=SpanKind.SERVER, parent=request.headers.get("traceparent")
    ) as span:
        accepted = await _accept(request, gw)
        if span.is_recording():
            span.set_attributes({"koda.run_id": accepted.run_id, "koda.merged": accepted.merged})
        return accepted


async def _accept(request: Request, gw: Components) -> RunAccepted:
    user_id: str | None = None
    try:
        user_id = authenticate_request(request, gw.auth)
        take_rate_token(gw, user_id)
        check_content_type(request.headers.get("content-type"))
        client_key = check_idempotency_key(request.headers.getlist("idempotency-key"))
        body = await read_body_within(
            request, gw.settings.body_limit_bytes, gw.settings.body_read_timeout_s
        )
        run_request = parse_run_request(decode_json(body))
        run = await gw.admissions.submit(
            user_id, run_request, client_key, merge_caps=MergeCaps.of(gw.settings)
        )
    except DatabaseError:
        metrics.ADMISSIONS_REJECTED.labels(reason="unavailable").inc()
        raise
    except CapReached as exc:
        # The handlers know no domain cap: answer it here, as what it is in HTTP.
        raise _rejected(user_id, limit_reached(exc)) from None
    except (GatewayError, Refused) as exc:
        _rejected(user_id, http_error(exc))
        raise
    return RunAccepted(
        run_id=run.run_id,
        status=run.status,
        events_url=events_url(run.run_id),
        merged=run.merged,
    )


def _rejected(user_id: str | None, refusal: GatewayError) -> GatewayError:
    """Count and log a refused submission; ``refusal`` is its answer."""
    metrics.ADMISSIONS_REJECTED.labels(reason=refusal.code).inc()
    log.info(
        "event=admission_rejected user_id=%s reason=%s field=%s",
        user_id or "-",
        refusal.code,
        refusal.field or "-",
    )
    return refusal


class SubmitShortcut:
    """ASGI middleware: ``POST /v1/runs`` answered by :func:`accept`, the rest by ``app``.

    ``components`` are the app's; ``route`` is the app's declared route for the
    endpoint, put in the scope as routing would, so that the request metrics label
    it ``/v1/runs``. An error no handler answers propagates, to become the 500 of the
    app's outer error middleware, as it would from the route.
    """

    def __init__(self, app: ASGIApp, components: Components, route: BaseRoute) -> None:
        self.app = app
        self.components = components
        self.route = route

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != METHOD or _route_path(scope) != PATH:
            await self.app(scope, receive, send)
            return
        scope["route"] = self.route
        request = Request(scope, receive)
        try:
            accepted = await accept(request, self.components)
        except ANSWERED as exc:
            response: Response = await answer_error(request, exc)
        else:
            response = Response(
                accepted.model_dump_json(), status_code=202, media_type="application/json"
            )
        await response(scope, receive, send)


def _route_path(scope: Scope) -> str:
    """The path routing matches against: without the app's ``root_path``."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    if root and path.startswith(root):
        return path[len(root) :]
    return path
