"""HTTP handlers: decode, call the admission service or the store, answer.

``POST /v1/runs`` is gateway/submit.py's: its checks, its admission, and the shortcut
that serves it without FastAPI's routing layers.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any
from urllib.parse import quote

from fastapi import APIRouter, Request, Response, Security
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from koda_runtime import metrics
from koda_runtime.errors import DatabaseError, KodaError
from koda_runtime.gateway.auth import BEARER
from koda_runtime.gateway.bootstrap import Components
from koda_runtime.gateway.dependencies import Gateway, RunId, User, run_not_found
from koda_runtime.gateway.models import Health, RunAccepted, RunSubmission, error_responses
from koda_runtime.gateway.submit import accept, events_url
from koda_runtime.schemas.runs.reads import RunView

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 2.0

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
        429: "Over the per-user quota (`rate_limited`), or the user has "
        "KODA_MAX_ACTIVE_RUNS_PER_USER runs not yet ended (`too_many_active_runs`, naming "
        "the cap); see Retry-After",
        503: "Postgres is unavailable; see Retry-After",
    }
)


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
    # Served by gateway/submit.py's shortcut in the app; declared here for OpenAPI.
    return await accept(request, gw)


@router.get(
    "/v1/runs/{run_id}",
    response_model=RunView,
    responses={k: _ERRORS[k] for k in (401, 404, 503)},
    summary="Read a run and its output so far",
)
async def get_run(gw: Gateway, user_id: User, run_id: RunId) -> RunView:
    view = await gw.reads.get_run(run_id, user_id)
    if view is None:
        # Another user's run answers exactly like a run that does not exist.
        raise run_not_found()
    return view


class StreamTicket(BaseModel):
    ticket: str = Field(description="Opens this run's events for this user until it expires.")
    expires_at: int = Field(description="When the ticket stops opening streams (Unix seconds).")
    events_url: str = Field(description="The run's events with the ticket (for EventSource).")


@router.post(
    "/v1/runs/{run_id}/stream-ticket",
    response_model=StreamTicket,
    responses={k: _ERRORS[k] for k in (401, 404, 503)},
    summary="A 60 s ticket that opens this run's events (for EventSource, which cannot "
    "send a header)",
)
async def stream_ticket(gw: Gateway, user_id: User, run_id: RunId) -> StreamTicket:
    if await gw.reads.stream_head(run_id, user_id) is None:
        raise run_not_found()
    ticket, expires_at = gw.auth.tickets.issue(run_id, user_id)
    return StreamTicket(
        ticket=ticket,
        expires_at=expires_at,
        events_url=f"{events_url(quote(run_id, safe=''))}?ticket={ticket}",
    )


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
