"""``/v1/webhooks``: the caller's endpoints for ended runs, and their deliveries.

* ``POST /v1/webhooks`` ``{url, description?, all_runs?}`` → 201 with the webhook and
  its signing ``secret`` (``whsec_...``): shown this once, never again. ``url`` must be
  https (http in dev) and, in prod, not a loopback, private or link-local address
  (``KODA_WEBHOOK_ALLOW_PRIVATE``): 422 ``invalid_field`` on ``url`` naming the rule.
  ``all_runs`` false: only the runs of schedules that name this webhook. A user has at
  most :data:`~koda_runtime.schemas.webhooks.MAX_WEBHOOKS_PER_USER` (409).
* ``GET /v1/webhooks``, ``GET /v1/webhooks/{id}``, ``DELETE /v1/webhooks/{id}`` (its
  deliveries go with it; schedules naming it fall back to the owner's webhooks).
* ``GET /v1/webhooks/{id}/deliveries?limit=&status=``: newest first, each with its
  attempts (time, duration, status code or error).

Owner-only: another user's webhook is 404 exactly like one that does not exist. The
dispatcher (``koda webhooks dispatch``, processors/webhooks.py) does the sending.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request, Response
from pydantic import BaseModel, Field

from koda_runtime.gateway.dependencies import Gateway, User
from koda_runtime.gateway.errors import InvalidField, NotFound
from koda_runtime.gateway.intake import check_content_type, decode_json, json_object, json_type
from koda_runtime.gateway.models import error_responses
from koda_runtime.gateway.quotas import LimitReached, read_body_within
from koda_runtime.lifecycle.ids import uuid7
from koda_runtime.schemas.webhooks import (
    DELIVERY_STATUSES,
    MAX_WEBHOOKS_PER_USER,
    TooManyWebhooks,
    Webhook,
    create_webhook,
    delete_webhook,
    get_webhook,
    list_deliveries,
    list_webhooks,
)
from koda_runtime.webhooks import UrlPolicy, WebhookUrlRefused, check_url, new_secret

FIELDS = ("url", "description", "all_runs")
MAX_DESCRIPTION_CHARS = 500
MAX_ID_CHARS = 128

_ERRORS = error_responses(
    {
        400: "Undecodable body",
        401: "Missing or invalid bearer token",
        404: "Unknown webhook (or another user's)",
        409: "create: the caller has the most webhooks allowed (error.limit)",
        413: "Body larger than the limit",
        415: "Body is not application/json",
        422: "A field is missing or invalid (url: the URL rule it breaks)",
    }
)

router = APIRouter(responses=_ERRORS, tags=["webhooks"])


class WebhookBody(BaseModel):
    id: str
    url: str
    description: str | None
    all_runs: bool = Field(
        description="true: every run of the owner that ends (except runs of schedules "
        "naming another webhook); false: only runs of schedules naming this one."
    )
    created_at: datetime


class CreatedWebhook(WebhookBody):
    secret: str = Field(
        description="The signing secret (whsec_ + base64), shown only in this answer."
    )


class WebhookList(BaseModel):
    webhooks: list[WebhookBody]


class AttemptBody(BaseModel):
    attempt: int
    started_at: datetime
    duration_ms: int
    status_code: int | None
    error: str | None


class DeliveryBody(BaseModel):
    id: str = Field(description="The webhook-id header of every attempt.")
    run_id: str
    status: str = Field(description="pending, delivered or failed (given up).")
    attempts: int
    next_attempt_at: datetime | None
    last_status_code: int | None
    last_error: str | None
    created_at: datetime
    delivered_at: datetime | None
    tries: list[AttemptBody]


class DeliveryList(BaseModel):
    deliveries: list[DeliveryBody]


def _body(w: Webhook) -> dict[str, Any]:
    return {
        "id": w.id,
        "url": w.url,
        "description": w.description,
        "all_runs": w.all_runs,
        "created_at": w.created_at,
    }


def parse_webhook(obj: Any, policy: UrlPolicy) -> dict[str, Any]:
    """The body's fields as ``webhooks`` columns; InvalidField naming the first bad one."""
    obj = json_object(obj, FIELDS)
    if obj.get("url") is None:
        raise InvalidField("url is required, e.g. https://example.com/koda-hook", field="url")
    try:
        url = check_url(obj["url"], policy)
    except WebhookUrlRefused as exc:
        raise InvalidField(exc.message, field="url", code=f"webhook_{exc.rule}_refused") from None
    description = obj.get("description")
    if description is not None and (
        not isinstance(description, str) or len(description) > MAX_DESCRIPTION_CHARS
    ):
        raise InvalidField(
            f"description must be null or a string of at most {MAX_DESCRIPTION_CHARS} "
            f"characters (got {json_type(description)})",
            field="description",
        )
    all_runs = obj.get("all_runs", True)
    if not isinstance(all_runs, bool):
        raise InvalidField(
            f"all_runs must be true or false, got {json_type(all_runs)}", field="all_runs"
        )
    return {"url": url, "description": description, "all_runs": all_runs}


def _not_found() -> NotFound:
    return NotFound("webhook not found: check the id and the token's user", field="webhook_id")


async def owned_webhook(webhook_id: str, gw: Gateway, user_id: User) -> Webhook:
    """The caller's webhook ``webhook_id``; 404 for an unknown one or another user's."""
    row = None
    if len(webhook_id) <= MAX_ID_CHARS and "\x00" not in webhook_id:
        row = await get_webhook(gw.engine, webhook_id, user_id)
    if row is None:
        raise _not_found()
    return row


Owned = Annotated[Webhook, Depends(owned_webhook)]


@router.post(
    "/v1/webhooks",
    status_code=201,
    response_model=CreatedWebhook,
    summary="Create a webhook; the answer carries its signing secret, shown only here",
)
async def create(request: Request, gw: Gateway, user_id: User) -> CreatedWebhook:
    check_content_type(request.headers.get("content-type"))
    settings = gw.settings
    raw = await read_body_within(request, settings.body_limit_bytes, settings.body_read_timeout_s)
    fields = parse_webhook(decode_json(raw), UrlPolicy.of(settings))
    secret = new_secret()
    values = {"id": "wh_" + uuid7().replace("-", ""), "user_id": user_id, "secret": secret}
    try:
        row = await create_webhook(gw.engine, {**values, **fields})
    except TooManyWebhooks as exc:
        raise LimitReached(
            f"you have {exc.count} webhooks, the most allowed: delete one first",
            status=409,
            code="too_many_webhooks",
            setting="webhooks per user",
            cap=MAX_WEBHOOKS_PER_USER,
            count=exc.count,
        ) from None
    return CreatedWebhook(**_body(row), secret=secret)


@router.get("/v1/webhooks", response_model=WebhookList, summary="Your webhooks")
async def list_all(gw: Gateway, user_id: User) -> WebhookList:
    return WebhookList(
        webhooks=[WebhookBody(**_body(w)) for w in await list_webhooks(gw.engine, user_id)]
    )


@router.get("/v1/webhooks/{webhook_id}", response_model=WebhookBody, summary="Read a webhook")
async def read(row: Owned) -> WebhookBody:
    return WebhookBody(**_body(row))


@router.delete(
    "/v1/webhooks/{webhook_id}", status_code=204, summary="Delete a webhook and its deliveries"
)
async def delete(row: Owned, gw: Gateway) -> Response:
    if not await delete_webhook(gw.engine, row.id, row.user_id):
        raise _not_found()
    return Response(status_code=204)


@router.get(
    "/v1/webhooks/{webhook_id}/deliveries",
    response_model=DeliveryList,
    summary="A webhook's deliveries, newest first, each with its attempts",
)
async def deliveries(
    row: Owned,
    gw: Gateway,
    limit: int = Query(50, ge=1, le=500, description="At most this many."),
    status: str | None = Query(None, description="pending, delivered or failed."),
) -> DeliveryList:
    if status is not None and status not in DELIVERY_STATUSES:
        raise InvalidField(f"status must be one of {', '.join(DELIVERY_STATUSES)}", field="status")
    found = await list_deliveries(gw.engine, row.id, row.user_id, limit=limit, status=status)
    return DeliveryList(
        deliveries=[
            DeliveryBody(
                id=d.id,
                run_id=d.run_id,
                status=d.status,
                attempts=d.attempts,
                next_attempt_at=d.next_attempt_at,
                last_status_code=d.last_status_code,
                last_error=d.last_error,
                created_at=d.created_at,
                delivered_at=d.delivered_at,
                tries=[AttemptBody(**vars(a)) for a in d.tries],
            )
            for d in found
        ]
    )
