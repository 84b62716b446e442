"""HTTP handlers: decode, call the admission service or the store, answer.

``POST /v1/runs`` checks, in order: bearer token (401), per-user quota (429),
content type (415), ``Idempotency-Key`` (400), size (413), UTF-8 and JSON (400),
fields (422). Every refusal happens before anything is written and is counted
in ``koda_admissions_rejected_total{reason}`` (reason = the error code; a
Postgres outage, answered 503, counts as ``unavailable``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import APIRouter, Request, Response, Security
from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect

from koda_runtime import metrics
from koda_runtime.errors import DatabaseError, KodaError
from koda_runtime.gateway.auth import BEARER, authenticate_request
from koda_runtime.gateway.components import Components
from koda_runtime.gateway.dependencies import Gateway, User
from koda_runtime.gateway.errors import BadRequest, GatewayError, NotFound, RateLimited, http_error
from koda_runtime.gateway.exceptions import Refused
from koda_runtime.gateway.intake import (
    check_content_type,
    check_idempotency_key,
    decode_json,
    parse_run_request,
    read_body,
)
from koda_runtime.gateway.models import (
    Health,
    RunAccepted,
    RunDetail,
    RunSubmission,
    error_responses,
)

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 2.0
MAX_RUN_ID_CHARS = 128

router = APIRouter()

_ERRORS = error_responses(
    {
        400: "Undecodable body or bad header",
        401: "Missing or invalid bearer token",
        402: "Over the user's budget: names the budget, the spend and when it resets",
        404: "Unknown run or session (or another user's)",
        413: "Body larger than the limit",
        415: "Body is not application/json",
        422: "A field is missing or invalid",
        429: "Over the per-user quota; see Retry-After",
        503: "Postgres is unavailable; see Retry-After",
    }
)


def _events_url(run_id: str) -> str:
    return f"/v1/runs/{run_id}/events"


@router.post(
    "/v1/runs",
    status_code=202,
    response_model=RunAccepted,
    responses=_ERRORS,
    # Authenticated in the handler, so that a refused token is counted like every refusal.
    dependencies=[Security(BEARER)],
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": RunSubmission.model_json_schema()}},
        },
        "parameters": [
            {
                "name": "Idempotency-Key",
                "in": "header",
                "required": False,
                "description": "Up to 200 printable ASCII chars; the same key returns the "
                "same run. Without it the key is derived from session_id, "
                "client_message_id and the body.",
                "schema": {"type": "string", "maxLength": 200},
            }
        ],
    },
    summary="Submit a run",
)
async def submit_run(request: Request, gw: Gateway) -> RunAccepted:
    user_id: str | None = None
    try:
        user_id = authenticate_request(request, gw.auth)
        decision = gw.limiter.take(user_id)
        if not decision.allowed:
            raise RateLimited(decision.retry_after_s)
        check_content_type(request.headers.get("content-type"))
        client_key = check_idempotency_key(request.headers.getlist("idempotency-key"))
        try:
            body = await read_body(
                request.headers.get("content-length"),
                request.stream(),
                gw.settings.body_limit_bytes,
            )
        except ClientDisconnect:
            raise BadRequest(
                "the client disconnected before sending the whole body",
                field="body",
                code="client_disconnected",
            ) from None
        run_request = parse_run_request(decode_json(body))
        run = await gw.admissions.submit(user_id, run_request, client_key)
    except DatabaseError:
        metrics.ADMISSIONS_REJECTED.labels(reason="unavailable").inc()
        raise
    except (GatewayError, Refused) as exc:
        refusal = http_error(exc)
        metrics.ADMISSIONS_REJECTED.labels(reason=refusal.code).inc()
        log.info(
            "event=admission_rejected user_id=%s reason=%s field=%s",
            user_id or "-",
            refusal.code,
            refusal.field or "-",
        )
        raise
    return RunAccepted(
        run_id=run.run_id,
        status=run.status,
        events_url=_events_url(run.run_id),
        merged=run.merged,
    )


@router.get(
    "/v1/runs/{run_id}",
    response_model=RunDetail,
    responses={k: _ERRORS[k] for k in (401, 404, 503)},
    summary="Read a run and its output so far",
)
async def get_run(run_id: str, gw: Gateway, user_id: User) -> RunDetail:
    view = None
    if len(run_id) <= MAX_RUN_ID_CHARS:
        view = await gw.store.get_run(run_id, user_id)
    if view is None:
        # Another user's run answers exactly like a run that does not exist.
        raise NotFound("run not found: check the run id and the token's user", field="run_id")
    return RunDetail.model_validate(view, from_attributes=True)


@router.get("/livez", response_model=Health, summary="The process is alive")
async def livez() -> Health:
    return Health(status="ok")


@router.get(
    "/readyz",
    response_model=Health,
    responses={503: {"model": Health, "description": "A hard dependency is unavailable"}},
    summary="Postgres answers and the producer reaches a broker that has the runs topic",
)
async def readyz(gw: Gateway) -> Response:

    async def check(name: str, probe: Any) -> tuple[str, str]:
        try:
            await asyncio.wait_for(probe, READY_TIMEOUT_S)
        except TimeoutError:
            return name, f"timed out after {READY_TIMEOUT_S}s"
        except KodaError as exc:
            return name, str(exc)
        return name, "ok"

    results = dict(
        await asyncio.gather(
            check("postgres", gw.store.ping()),
            check("kafka", gw.publisher.check(READY_TIMEOUT_S)),
        )
    )
    ready = all(v == "ok" for v in results.values())
    health = Health(status="ok" if ready else "unavailable", checks=results)
    return JSONResponse(health.model_dump(), status_code=200 if ready else 503)


@router.get("/metrics", include_in_schema=False)
async def prometheus_metrics(gw: Gateway) -> Response:
    # koda_workers{state} as of this scrape: a worker whose beats stopped turns
    # stale here even while the gateway's tail of the workers topic is down.
    gw.workers.report()
    if gw.settings.cost_ledger:
        await _count_spent_budgets(gw)
    return Response(metrics.render(), media_type=metrics.CONTENT_TYPE)


async def _count_spent_budgets(gw: Components) -> None:
    """koda_budget_exhausted_users as of this scrape; NaN when Postgres cannot say.

    The scrape still answers without Postgres (every other family is in memory); a
    stale count would keep an alert firing, or quiet, on a figure nobody read."""
    try:
        count = float(await asyncio.wait_for(gw.store.spent_user_count(), READY_TIMEOUT_S))
    except (DatabaseError, TimeoutError) as exc:
        log.warning("event=budget_count_failed error=%s", exc or type(exc).__name__)
        count = float("nan")
    metrics.BUDGET_EXHAUSTED_USERS.set(count)
