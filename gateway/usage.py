"""Usage reports and budgets over HTTP: ``/v1/usage`` (the caller's own spend),
``/admin/usage`` and ``/admin/budgets`` (operators; admin access as in gateway/admin.py).

Reports are ``{"rows": [...], "totals": {...}}`` over the ledger; money is a decimal
string, never a float. ``from`` is inclusive, ``to`` exclusive; both ISO 8601 (a date
means midnight UTC). Bad parameters are 422 naming the parameter; nothing is written.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping
from datetime import datetime
from decimal import Decimal
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from sqlalchemy.ext.asyncio import AsyncConnection

from koda_runtime.gateway.bootstrap import Components
from koda_runtime.gateway.dependencies import ADMIN, Gateway, User
from koda_runtime.gateway.errors import BadRequest, InvalidField, NotFound
from koda_runtime.gateway.intake import check_content_type
from koda_runtime.gateway.models import error_responses
from koda_runtime.lifecycle.ledger import check_window, parse_time, parse_usd
from koda_runtime.schemas import ledger
from koda_runtime.schemas.db import failing_as

router = APIRouter(tags=["usage"])
USER_GROUPS = ("day", "model", "kind")
BUDGET_FIELDS = ("monthly_usd", "daily_usd", "soft_ratio")
MAX_USER_ID_CHARS = 128
MAX_BUDGET_BODY = 4096

_ERRORS = error_responses(
    {
        401: "Missing or wrong token",
        403: "prod without KODA_ADMIN_TOKEN (/admin)",
        422: "A parameter is missing or invalid",
        503: "Postgres is unavailable",
    }
)

T = TypeVar("T")
V = TypeVar("V")


async def _ledger(gw: Components, work: Callable[[AsyncConnection], Awaitable[T]]) -> T:
    """``work`` (schemas/ledger.py's reads and budget writes) in one transaction."""
    with failing_as("using the ledger"):
        async with gw.engine.begin() as conn:
            return await work(conn)


def _parsed(
    given: Mapping[str, Any], names: tuple[str, ...], parse: Callable[[Any, str], V]
) -> dict[str, V | None]:
    """Each of ``names`` parsed from ``given`` (None when absent); InvalidField names the
    first that ``parse`` refuses."""
    out: dict[str, V | None] = {}
    for name in names:
        raw = given.get(name)
        try:
            out[name] = None if raw is None else parse(raw, name)
        except ValueError as exc:
            raise InvalidField(str(exc), field=name) from None
    return out


def _params(
    request: Request, groups: tuple[str, ...]
) -> tuple[str, datetime | None, datetime | None]:
    q = request.query_params
    for name in q:
        if name not in ("group_by", "from", "to", "user_id"):
            raise InvalidField(
                f"unknown parameter {name[:64]!r}: accepted are group_by, from, to"
                + (", user_id" if "user" in groups else ""),
                field=name[:64],
            )
    group_by = q.get("group_by")
    if group_by not in groups:
        raise InvalidField(
            f"group_by must be one of {', '.join(groups)}, got {group_by!r}", field="group_by"
        )
    bounds = _parsed(q, ("from", "to"), parse_time)
    try:
        check_window(bounds["from"], bounds["to"])
    except ValueError as exc:
        raise InvalidField(str(exc), field="from") from None
    return group_by, bounds["from"], bounds["to"]


async def _report(
    request: Request, gw: Components, groups: tuple[str, ...], owner: str | None
) -> JSONResponse:
    """The usage report the query asks for: of ``owner`` alone (who may not name another
    user), or, with ``owner`` None, of everyone or of the ``user_id`` parameter."""
    group_by, since, until = _params(request, groups)
    user_id = request.query_params.get("user_id")
    if owner is not None:
        if user_id is not None:
            raise InvalidField(
                "user_id is not a parameter here: the token names the user", field="user_id"
            )
        user_id = owner
    elif user_id is not None and not 0 < len(user_id) <= MAX_USER_ID_CHARS:
        raise InvalidField(f"user_id must be 1-{MAX_USER_ID_CHARS} chars", field="user_id")
    report = await _ledger(
        gw, lambda c: ledger.usage_report(c, group_by, user_id=user_id, since=since, until=until)
    )
    return JSONResponse(report)


@router.get(
    "/v1/usage",
    responses=_ERRORS,
    summary="The caller's own usage and spend, grouped by day, model or kind",
)
async def my_usage(request: Request, gw: Gateway, user_id: User) -> JSONResponse:
    return await _report(request, gw, USER_GROUPS, owner=user_id)


@router.get(
    "/admin/usage",
    responses=_ERRORS,
    dependencies=[ADMIN],
    summary="Everyone's usage and spend, grouped by user, day, model or kind",
)
async def all_usage(request: Request, gw: Gateway) -> JSONResponse:
    return await _report(request, gw, ledger.GROUPS, owner=None)


def _user(user_id: str) -> str:
    if not 0 < len(user_id) <= MAX_USER_ID_CHARS or not user_id.isprintable():
        raise InvalidField(
            f"user_id must be 1-{MAX_USER_ID_CHARS} printable chars", field="user_id"
        )
    return user_id


async def _budget_body(request: Request) -> tuple[Decimal | None, Decimal | None, Decimal]:
    check_content_type(request.headers.get("content-type"))
    body = await request.body()
    if len(body) > MAX_BUDGET_BODY:
        raise BadRequest(f"the body is larger than {MAX_BUDGET_BODY} bytes", field="body")
    try:
        obj = json.loads(body, parse_float=Decimal)
    except (ValueError, RecursionError):
        raise BadRequest("the body is not valid JSON", field="body", code="invalid_json") from None
    if not isinstance(obj, dict):
        raise InvalidField("the body must be a JSON object", field="body")
    for name in obj:
        if name not in BUDGET_FIELDS:
            raise InvalidField(
                f"unknown field {str(name)[:64]!r}: accepted are {', '.join(BUDGET_FIELDS)}",
                field=str(name)[:64],
            )
    amounts = _parsed(obj, ("monthly_usd", "daily_usd"), parse_usd)
    if amounts["monthly_usd"] is None and amounts["daily_usd"] is None:
        raise InvalidField(
            "give monthly_usd and/or daily_usd (DELETE removes a user's budgets)",
            field="monthly_usd",
        )
    raw_soft = obj.get("soft_ratio", "0.8")
    try:
        soft = parse_usd(raw_soft, "soft_ratio")
    except ValueError as exc:
        raise InvalidField(str(exc), field="soft_ratio") from None
    if not 0 < soft <= 1 or soft != soft.quantize(Decimal("0.001")):
        raise InvalidField(
            f"soft_ratio must be in (0, 1] with at most 3 decimals, got {raw_soft!r}",
            field="soft_ratio",
        )
    return amounts["monthly_usd"], amounts["daily_usd"], soft


@router.put(
    "/admin/budgets/{user_id}",
    responses=_ERRORS,
    dependencies=[ADMIN],
    summary="Set a user's monthly and/or daily budget (USD, decimal strings)",
)
async def put_budget(user_id: str, request: Request, gw: Gateway) -> JSONResponse:
    user = _user(user_id)
    monthly, daily, soft = await _budget_body(request)
    budget = await _ledger(gw, lambda c: ledger.set_budget(c, user, monthly, daily, soft))
    return JSONResponse(budget.as_json())


@router.get(
    "/admin/budgets",
    responses=_ERRORS,
    dependencies=[ADMIN],
    summary="Every user's budgets with this month's and today's spend",
)
async def get_budgets(gw: Gateway) -> JSONResponse:
    budgets = await _ledger(gw, lambda c: ledger.list_budgets(c))
    return JSONResponse({"budgets": [b.as_json() for b in budgets]})


@router.delete(
    "/admin/budgets/{user_id}",
    responses={**_ERRORS, **error_responses({404: "No budget for this user"})},
    dependencies=[ADMIN],
    summary="Remove a user's budgets (no cap any more)",
)
async def delete_budget(user_id: str, gw: Gateway) -> JSONResponse:
    user = _user(user_id)
    if not await _ledger(gw, lambda c: ledger.delete_budget(c, user)):
        raise NotFound(f"no budget is set for user {user!r}", field="user_id")
    return JSONResponse({"deleted": user})
