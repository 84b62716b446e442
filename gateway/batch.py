"""``POST /v1/runs/batch``: many runs in one request, each with its own key and answer.

The body is ``{"runs": [item, ...]}``, at most KODA_BATCH_MAX_RUNS items (more: 413
``batch_too_large``, naming the setting). An item is a ``POST /v1/runs`` body plus
``idempotency_key`` (required: the item's Idempotency-Key) and ``user`` (optional):

* a user's own token: ``user`` may be omitted or name that user (403 otherwise);
* a service token: ``user`` names the user the item is for; omitted, the
  ``X-Koda-User`` header's user (an item naming neither is refused with 400).

Each item is admitted exactly as ``POST /v1/runs`` admits one (rate, budget, active
runs, sessions, merges), through :meth:`Admissions.submit`, concurrently: the
admission queue writes the items that arrive together in one transaction (its group
commit), so a batch is not a second way to insert a run. The answer is 200 with one
result per item, in order: ``{"status": 202, "run": <RunAccepted>}`` or
``{"status": <4xx/503>, "error": <the error object POST /v1/runs would answer>}``.
One refused item never fails another; the same batch again answers the same runs.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from fastapi import APIRouter, Request, Security
from pydantic import BaseModel, Field

from koda_runtime import metrics
from koda_runtime.caps import CapReached
from koda_runtime.errors import DatabaseError, Refused
from koda_runtime.gateway.auth import BEARER, request_principal, valid_user_id
from koda_runtime.gateway.bootstrap import Components
from koda_runtime.gateway.dependencies import Gateway
from koda_runtime.gateway.errors import (
    BadRequest,
    Forbidden,
    GatewayError,
    InvalidField,
    PayloadTooLarge,
    http_error,
)
from koda_runtime.gateway.intake import (
    check_content_type,
    check_idempotency_key,
    decode_json,
    json_type,
    parse_run_request,
)
from koda_runtime.gateway.models import ErrorDetail, RunAccepted, error_responses
from koda_runtime.gateway.principal import CURRENT, ON_BEHALF_HEADER, Principal
from koda_runtime.gateway.quotas import limit_reached, read_body_within
from koda_runtime.gateway.submit import events_url, take_rate_token
from koda_runtime.schemas.runs.control import MergeCaps

log = logging.getLogger(__name__)

PATH = "/v1/runs/batch"
BATCH_SETTING = "KODA_BATCH_MAX_RUNS"
# The whole body may hold this many bodies of POST /v1/runs, at most (16 MiB).
MAX_BATCH_BODY_BYTES = 16 << 20

router = APIRouter()


class BatchItemResult(BaseModel):
    """One item's answer: ``run`` when admitted (202), else ``error``."""

    status: int = Field(description="What POST /v1/runs would have answered for this item.")
    run: RunAccepted | None = None
    error: ErrorDetail | None = Field(
        None, description="The item's refusal; fields are named `runs[<index>].<field>`."
    )


class BatchAccepted(BaseModel):
    """``200`` answer of ``POST /v1/runs/batch``: one result per item, in order."""

    runs: list[BatchItemResult]


class BatchTooLarge(PayloadTooLarge):
    code = "batch_too_large"


def batch_body_limit(gw: Components) -> int:
    """The batch's body limit: room for KODA_BATCH_MAX_RUNS bodies of POST /v1/runs."""
    settings = gw.settings
    return min(MAX_BATCH_BODY_BYTES, settings.body_limit_bytes * settings.batch_max_runs)


@router.post(
    PATH,
    response_model=BatchAccepted,
    responses=error_responses(
        {
            400: "Undecodable body, or a bad X-Koda-User header",
            401: "Missing or invalid bearer token",
            403: "A service token without the `submit` scope",
            413: "More runs than KODA_BATCH_MAX_RUNS, or a body over the batch's limit",
            415: "Body is not application/json",
            422: "The body is not {runs: [...]}",
            503: "Postgres is unavailable; see Retry-After",
        }
    ),
    # Authenticated in the handler, so that a refused token is counted like every refusal.
    dependencies=[Security(BEARER)],
    summary="Submit many runs, each with its own idempotency key and its own answer",
)
async def submit_batch(request: Request, gw: Gateway) -> BatchAccepted:
    principal = request_principal(request, gw.auth, require_user=False)
    check_content_type(request.headers.get("content-type"))
    body = await read_body_within(request, batch_body_limit(gw), gw.settings.body_read_timeout_s)
    items = _items(decode_json(body), gw.settings.batch_max_runs)
    results = await asyncio.gather(*(_one(gw, principal, i, item) for i, item in enumerate(items)))
    accepted = sum(1 for r in results if r.run is not None)
    log.info(
        "event=batch_admitted principal=%s runs=%d accepted=%d",
        principal.created_by,
        len(results),
        accepted,
    )
    return BatchAccepted(runs=list(results))


def _items(obj: Any, max_runs: int) -> list[Any]:
    """The body's items; 422 for a body that is not ``{"runs": [...]}``, 413 past the cap."""
    if not isinstance(obj, dict):
        raise InvalidField(
            f'the body must be a JSON object {{"runs": [...]}}, got {json_type(obj)}',
            field="body",
        )
    for name in obj:
        if name != "runs":
            raise InvalidField(
                f'unknown field {name[:40]!r}: the body is {{"runs": [...]}}', field=name[:40]
            )
    runs = obj.get("runs")
    if not isinstance(runs, list) or not runs:
        raise InvalidField("runs must be a non-empty list of runs", field="runs")
    if len(runs) > max_runs:
        raise BatchTooLarge(
            f"the batch has {len(runs)} runs; {BATCH_SETTING} allows at most {max_runs} "
            "per request: split it",
            field="runs",
        )
    return runs


async def _one(gw: Components, principal: Principal, index: int, item: Any) -> BatchItemResult:
    """Admit item ``index``; its refusal becomes its result, never the batch's."""
    where = f"runs[{index}]"
    user_id: str | None = None
    try:
        if not isinstance(item, dict):
            raise InvalidField(f"{where} must be a JSON object, got {json_type(item)}", field=where)
        fields = dict(item)
        user_id = _user_of(principal, fields.pop("user", None), where)
        key = fields.pop("idempotency_key", None)
        if not isinstance(key, str):
            raise InvalidField(
                f"{where}.idempotency_key is required: 1-200 printable ASCII chars, the "
                "same for the same run when the batch is sent again",
                field=f"{where}.idempotency_key",
            )
        try:
            client_key = check_idempotency_key([key])
        except GatewayError as exc:
            exc.field = f"{where}.idempotency_key"
            raise
        try:
            run_request = parse_run_request(fields)
        except GatewayError as exc:
            exc.field = f"{where}.{exc.field}" if exc.field else where
            raise
        size = len(json.dumps(fields, ensure_ascii=False).encode())
        if size > gw.settings.body_limit_bytes:
            raise PayloadTooLarge(
                f"{where} is {size} bytes; a run's body may be at most "
                f"{gw.settings.body_limit_bytes} (KODA_BODY_LIMIT)",
                field=where,
            )
        take_rate_token(gw, user_id)
        # This item's run records the batch's principal, acting for the item's user (the
        # gather runs each item in a context of its own).
        CURRENT.set(principal.acting_for(user_id))
        run = await gw.admissions.submit(
            user_id, run_request, client_key, merge_caps=MergeCaps.of(gw.settings)
        )
    except CapReached as exc:
        return _refused(user_id, where, limit_reached(exc))
    except (GatewayError, Refused, DatabaseError) as exc:
        return _refused(user_id, where, http_error(exc))
    return BatchItemResult(
        status=202,
        error=None,
        run=RunAccepted(
            run_id=run.run_id,
            status=run.status,
            events_url=events_url(run.run_id),
            merged=run.merged,
        ),
    )


def _user_of(principal: Principal, named: Any, where: str) -> str:
    """The user item ``where`` is for (see the module's docstring)."""
    if named is not None and (not isinstance(named, str) or not valid_user_id(named)):
        raise InvalidField(
            f"{where}.user must be a user id: 1-128 chars of A-Z a-z 0-9 . _ @ -",
            field=f"{where}.user",
        )
    if principal.kind == "user":
        if named is not None and named != principal.user_id:
            raise Forbidden(
                f"{where}.user names another user: a user's token submits for its own "
                "user only (a backend acting for users needs a service token)",
                field=f"{where}.user",
            )
        return principal.user_id
    user_id = named or principal.user_id
    if not user_id:
        raise BadRequest(
            f"{where} names no user: give it a user, or send the {ON_BEHALF_HEADER} header "
            "for the whole batch",
            field=f"{where}.user",
            code="missing_user",
        )
    return str(user_id)


def _refused(user_id: str | None, where: str, refusal: GatewayError) -> BatchItemResult:
    metrics.ADMISSIONS_REJECTED.labels(reason=refusal.code).inc()
    log.info(
        "event=admission_rejected route=batch item=%s user_id=%s reason=%s field=%s",
        where,
        user_id or "-",
        refusal.code,
        refusal.field or "-",
    )
    error = refusal.body()["error"]
    return BatchItemResult(
        status=refusal.status,
        run=None,
        error=ErrorDetail(code=error["code"], message=error["message"], field=error["field"]),
    )
