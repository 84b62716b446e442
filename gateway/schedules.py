"""``/v1/schedules``: create, read, change, pause, resume, fire now and delete schedules.

Owner-only: a schedule of another user answers 404 exactly like one that does not exist.
Bodies are checked like ``POST /v1/runs`` (content type 415, size 413, UTF-8 and JSON
400) and every field is validated before anything is written (422 naming the field;
a bad cron or time zone shows a valid example). ``koda scheduler`` does the firing;
these routes only keep the row and its ``next_fire_at`` right (computed from
Postgres's clock, which the scheduler reads too).

An owner has at most KODA_MAX_SCHEDULES_PER_USER schedules (one more: 409
``too_many_schedules``). ``run-now`` creates a run of the owner's own asking, so it
goes through what ``POST /v1/runs`` does: the per-user rate limiter (429
``rate_limited``), then the schedule's ``daily_cap`` as the scheduler applies it (429
``daily_cap_reached``, Retry-After until the local day ends), a spent budget (402) and
the cap on active runs (429 ``too_many_active_runs``).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import re
from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request, Response
from pydantic import BaseModel, Field

from koda_runtime import metrics
from koda_runtime.caps import CapReached
from koda_runtime.errors import KodaError
from koda_runtime.gateway.bootstrap import Components
from koda_runtime.gateway.dependencies import Gateway, User
from koda_runtime.gateway.errors import InvalidField, NotFound
from koda_runtime.gateway.intake import (
    SESSION_ID,
    check_content_type,
    decode_json,
    json_object,
    json_type,
    parse_run_request,
)
from koda_runtime.gateway.models import error_responses
from koda_runtime.gateway.quotas import LimitReached, limit_reached, read_body_within
from koda_runtime.gateway.submit import take_rate_token
from koda_runtime.lifecycle.ids import uuid7
from koda_runtime.scheduling import (
    EXAMPLE_CRON,
    EXAMPLE_TIMEZONE,
    CronSpec,
    Overlap,
    Policy,
    QuietHours,
    ScheduleInvalid,
    minute_floor,
)
from koda_runtime.schemas.schedules import ScheduleRow, ScheduleStore
from koda_runtime.schemas.webhooks import get_webhook, schedule_webhooks
from koda_runtime.topics.scheduled import fire

DEFAULTS = Policy()
MAX_DAILY_CAP = 100_000
MAX_CATCHUP_S = 7 * 86400
MAX_ID_CHARS = 128
RUN_NOW_WAIT_S = 2.0
FIELDS = (
    "cron",
    "timezone",
    "input",
    "enabled",
    "quiet_hours",
    "daily_cap",
    "overlap",
    "catchup_s",
    "session_id",
    "webhook_id",
)
_HHMM = re.compile(r"([01][0-9]|2[0-3]):([0-5][0-9])")
_QUIET_EXAMPLE = '{"start": "22:00", "end": "07:00"}'

_ERRORS = error_responses(
    {
        400: "Undecodable body",
        401: "Missing or invalid bearer token",
        404: "Unknown schedule or session (or another user's)",
        408: "The body did not arrive within KODA_BODY_READ_TIMEOUT",
        409: "create: the owner has KODA_MAX_SCHEDULES_PER_USER schedules (error.limit)",
        413: "Body larger than the limit",
        415: "Body is not application/json",
        402: "run-now: the owner's budget is spent (names the budget, spend and reset)",
        422: "A field is missing or invalid",
        429: "run-now: over the rate (rate_limited), the schedule's daily_cap reached "
        "(daily_cap_reached) or KODA_MAX_ACTIVE_RUNS_PER_USER runs not yet ended "
        "(too_many_active_runs); see Retry-After",
        503: "Postgres is unavailable; see Retry-After",
    }
)


class QuietHoursBody(BaseModel):
    start: str = Field(description="Local time HH:MM the quiet window starts (inclusive).")
    end: str = Field(
        description="Local time HH:MM it ends (exclusive); before start: crosses midnight."
    )


class ScheduleBody(BaseModel):
    """A schedule as the API shows it."""

    id: str
    cron: str = Field(description=f'5-field cron on the zone\'s wall clock, e.g. "{EXAMPLE_CRON}".')
    timezone: str = Field(description=f'IANA time zone, e.g. "{EXAMPLE_TIMEZONE}".')
    input: dict[str, Any] = Field(description="Each fire's run input.")
    enabled: bool = Field(description="False: paused; due minutes are skipped (reason paused).")
    quiet_hours: QuietHoursBody | None = Field(
        description="Fires in this local window are skipped."
    )
    daily_cap: int = Field(
        description="Fires skipped once the owner has this many scheduled runs that local day."
    )
    overlap: str = Field(
        description="skip: skip a fire while the previous run is not terminal; allow."
    )
    catchup_s: int = Field(
        description="After downtime, minutes at most this old still fire; older are missed."
    )
    next_fire_at: datetime | None
    last_fire_at: datetime | None
    session_id: str | None = Field(
        description="null: a new session per fire; else every run joins it."
    )
    webhook_id: str | None = Field(
        default=None,
        description="The owner's webhook this schedule's runs go to (alone); "
        "null: the owner's webhooks.",
    )


class ScheduleList(BaseModel):
    schedules: list[ScheduleBody]


class ScheduledRun(BaseModel):
    run_id: str
    status: str
    events_url: str
    schedule_id: str
    scheduled_for: datetime


def _body(row: ScheduleRow) -> ScheduleBody:
    quiet = row.quiet_hours
    return ScheduleBody(
        id=row.id,
        cron=row.cron,
        timezone=row.timezone,
        input=row.input,
        enabled=row.enabled,
        quiet_hours=None
        if quiet is None
        else QuietHoursBody(start=QuietHours.text(quiet.start), end=QuietHours.text(quiet.end)),
        daily_cap=row.daily_cap,
        overlap=row.overlap,
        catchup_s=row.catchup_s,
        next_fire_at=row.next_fire_at,
        last_fire_at=row.last_fire_at,
        session_id=row.session_id,
    )


def _integer(obj: dict[str, Any], name: str, lo: int, hi: int, example: int) -> int:
    value = obj[name]
    if type(value) is not int or not lo <= value <= hi:
        got = value if type(value) is int else json_type(value)
        raise InvalidField(
            f"{name} must be an integer {lo}..{hi}, e.g. {example} (got {got})", field=name
        )
    return value


def _minute_of_day(value: Any, name: str) -> int:
    if not isinstance(value, str) or not _HHMM.fullmatch(value):
        raise InvalidField(
            f"quiet_hours.{name} must be a local time HH:MM (00:00-23:59); e.g. {_QUIET_EXAMPLE}",
            field=f"quiet_hours.{name}",
        )
    hours, minutes = value.split(":")
    return int(hours) * 60 + int(minutes)


def _quiet(value: Any) -> tuple[int | None, int | None]:
    if value is None:
        return None, None
    if not isinstance(value, dict) or set(value) != {"start", "end"}:
        raise InvalidField(
            f'quiet_hours must be null or an object with "start" and "end"; e.g. {_QUIET_EXAMPLE}',
            field="quiet_hours",
        )
    start, end = _minute_of_day(value["start"], "start"), _minute_of_day(value["end"], "end")
    try:
        QuietHours(start, end)
    except ScheduleInvalid as exc:
        raise InvalidField(exc.message, field="quiet_hours") from None
    return start, end


def parse_fields(obj: Any, *, creating: bool) -> dict[str, Any]:
    """The body's fields as ``schedules`` columns; InvalidField names the first bad one.

    ``cron`` and ``timezone`` are returned as given (checked together by the caller,
    which knows the stored one of a partial update)."""
    obj = json_object(obj, FIELDS)
    if creating:
        for name in ("cron", "timezone", "input"):
            if obj.get(name) is None:
                example = {"cron": f'"{EXAMPLE_CRON}"', "timezone": f'"{EXAMPLE_TIMEZONE}"'}
                raise InvalidField(
                    f"{name} is required" + (f", e.g. {example[name]}" if name in example else ""),
                    field=name,
                )
    elif not obj:
        raise InvalidField(f"send at least one of {', '.join(FIELDS)}", field="body")
    out: dict[str, Any] = {}
    for name in ("cron", "timezone"):
        if name in obj:
            out[name] = obj[name]
    if "input" in obj:
        out["input"] = parse_run_request({"input": obj["input"]}).input
    if "enabled" in obj:
        if not isinstance(obj["enabled"], bool):
            raise InvalidField(
                f"enabled must be true or false, got {json_type(obj['enabled'])}", field="enabled"
            )
        out["enabled"] = obj["enabled"]
    if "quiet_hours" in obj:
        out["quiet_start"], out["quiet_end"] = _quiet(obj["quiet_hours"])
    if "daily_cap" in obj:
        out["daily_cap"] = _integer(obj, "daily_cap", 1, MAX_DAILY_CAP, DEFAULTS.daily_cap)
    if "catchup_s" in obj:
        out["catchup_s"] = _integer(obj, "catchup_s", 0, MAX_CATCHUP_S, DEFAULTS.catchup_s)
    if "overlap" in obj:
        if obj["overlap"] not in [o.value for o in Overlap]:
            raise InvalidField('overlap must be "skip" or "allow"', field="overlap")
        out["overlap"] = obj["overlap"]
    if "session_id" in obj:
        session = obj["session_id"]
        if session is not None and (
            not isinstance(session, str) or not SESSION_ID.fullmatch(session)
        ):
            raise InvalidField(
                "session_id must be null (a new session per fire) or 1-128 chars of "
                "A-Z a-z 0-9 . _ : @ -",
                field="session_id",
            )
        if not creating:
            raise InvalidField(
                "session_id is fixed at creation: create a new schedule to change it",
                field="session_id",
            )
        out["session_id"] = session
    if "webhook_id" in obj:
        webhook = obj["webhook_id"]
        if webhook is not None and (not isinstance(webhook, str) or not 1 <= len(webhook) <= 128):
            raise InvalidField(
                "webhook_id must be null (the owner's webhooks) or the id of one of your "
                "webhooks (GET /v1/webhooks)",
                field="webhook_id",
            )
        out["webhook_id"] = webhook
    return out


async def _check_webhook(gw: Components, user_id: str, fields: dict[str, Any]) -> None:
    """422 on webhook_id unless it is null or one of the caller's webhooks."""
    webhook = fields.get("webhook_id")
    if webhook is not None and await get_webhook(gw.engine, webhook, user_id) is None:
        raise InvalidField(
            f"webhook_id {webhook[:64]!r} is not one of your webhooks (GET /v1/webhooks)",
            field="webhook_id",
        )


async def _with_webhooks(gw: Components, bodies: list[ScheduleBody]) -> list[ScheduleBody]:
    found = await schedule_webhooks(gw.engine, [b.id for b in bodies])
    return [b.model_copy(update={"webhook_id": found.get(b.id)}) for b in bodies]


def _spec(cron: Any, timezone: Any) -> CronSpec:
    try:
        return CronSpec.parse(cron, timezone)
    except ScheduleInvalid as exc:
        raise InvalidField(exc.message, field=exc.field) from None


async def _next_fire(store: ScheduleStore, spec: CronSpec) -> datetime | None:
    return next(spec.fires_after(await store.now()), None)


async def _read_json(request: Request, gw: Components) -> Any:
    check_content_type(request.headers.get("content-type"))
    settings = gw.settings
    body = await read_body_within(request, settings.body_limit_bytes, settings.body_read_timeout_s)
    return decode_json(body)


def _not_found() -> NotFound:
    return NotFound("schedule not found: check the id and the token's user", field="schedule_id")


async def owned_schedule(schedule_id: str, gw: Gateway, user_id: User) -> ScheduleRow:
    """The caller's schedule ``schedule_id``; 404 for an unknown one or another user's."""
    row = None
    if len(schedule_id) <= MAX_ID_CHARS and "\x00" not in schedule_id:
        row = await gw.schedules.get(schedule_id, user_id)
    if row is None:
        raise _not_found()
    return row


Owned = Annotated[ScheduleRow, Depends(owned_schedule)]


async def _changed(gw: Components, row: ScheduleRow, changes: dict[str, Any]) -> ScheduleBody:
    updated = await gw.schedules.update(row.id, row.user_id, changes)
    if updated is None:  # deleted since it was read
        raise _not_found()
    return (await _with_webhooks(gw, [_body(updated)]))[0]


router = APIRouter(responses=_ERRORS, tags=["schedules"])


@router.post(
    "/v1/schedules", status_code=201, response_model=ScheduleBody, summary="Create a schedule"
)
async def create_schedule(request: Request, gw: Gateway, user_id: User) -> ScheduleBody:
    fields = parse_fields(await _read_json(request, gw), creating=True)
    await _check_webhook(gw, user_id, fields)
    spec = _spec(fields["cron"], fields["timezone"])
    values = {
        "id": uuid7(),
        "user_id": user_id,
        "session_id": None,
        "enabled": DEFAULTS.enabled,
        "quiet_start": None,
        "quiet_end": None,
        "daily_cap": DEFAULTS.daily_cap,
        "overlap": DEFAULTS.overlap.value,
        "catchup_s": DEFAULTS.catchup_s,
        **fields,
        "cron": spec.expression,
        "timezone": spec.timezone,
        "next_fire_at": await _next_fire(gw.schedules, spec),
    }
    try:
        row = await gw.schedules.create(values, max_per_user=gw.settings.max_schedules_per_user)
    except CapReached as exc:
        raise limit_reached(exc) from None
    return (await _with_webhooks(gw, [_body(row)]))[0]


@router.get("/v1/schedules", response_model=ScheduleList, summary="Your schedules")
async def list_schedules(
    gw: Gateway,
    user_id: User,
    limit: int = Query(100, ge=1, le=1000, description="At most this many."),
) -> ScheduleList:
    bodies = [_body(r) for r in await gw.schedules.owned(user_id, limit)]
    return ScheduleList(schedules=await _with_webhooks(gw, bodies))


@router.get("/v1/schedules/{schedule_id}", response_model=ScheduleBody, summary="Read a schedule")
async def get_schedule(row: Owned, gw: Gateway) -> ScheduleBody:
    return (await _with_webhooks(gw, [_body(row)]))[0]


@router.patch(
    "/v1/schedules/{schedule_id}",
    response_model=ScheduleBody,
    summary="Change a schedule (a new cron or zone recomputes the next fire from now)",
)
async def update_schedule(current: Owned, request: Request, gw: Gateway) -> ScheduleBody:
    changes = parse_fields(await _read_json(request, gw), creating=False)
    await _check_webhook(gw, current.user_id, changes)
    if "cron" in changes or "timezone" in changes:
        spec = _spec(changes.get("cron", current.cron), changes.get("timezone", current.timezone))
        changes.update(
            cron=spec.expression,
            timezone=spec.timezone,
            next_fire_at=await _next_fire(gw.schedules, spec),
        )
    return await _changed(gw, current, changes)


@router.delete("/v1/schedules/{schedule_id}", status_code=204, summary="Delete a schedule")
async def delete_schedule(row: Owned, gw: Gateway) -> Response:
    if not await gw.schedules.delete(row.id, row.user_id):
        raise _not_found()
    return Response(status_code=204)


@router.post(
    "/v1/schedules/{schedule_id}/pause",
    response_model=ScheduleBody,
    summary="Pause: due minutes are skipped (reason paused) until resumed",
)
async def pause_schedule(row: Owned, gw: Gateway) -> ScheduleBody:
    return await _changed(gw, row, {"enabled": False})


@router.post(
    "/v1/schedules/{schedule_id}/resume",
    response_model=ScheduleBody,
    summary="Resume from the next fire after now (paused minutes are not replayed)",
)
async def resume_schedule(current: Owned, gw: Gateway) -> ScheduleBody:
    changes: dict[str, Any] = {"enabled": True}
    if not current.enabled:
        spec = _spec(current.cron, current.timezone)
        changes["next_fire_at"] = await _next_fire(gw.schedules, spec)
    return await _changed(gw, current, changes)


@router.post(
    "/v1/schedules/{schedule_id}/run-now",
    status_code=202,
    response_model=ScheduledRun,
    summary="Fire once now, whatever the cron, quiet hours or pause (counts toward the cap)",
)
async def run_schedule_now(row: Owned, gw: Gateway) -> ScheduledRun:
    take_rate_token(gw, row.user_id)
    now = await gw.schedules.now()
    minute = minute_floor(now)
    await _check_daily_cap(gw, row, now)
    fired = await fire(
        gw.store,
        gw.publisher,
        row,
        minute,
        partitions=gw.settings.partitions,
        key=f"sched:{row.id}:now:{uuid7()}",
        budgets=gw.settings.cost_ledger,
        max_active=gw.settings.max_active_runs_per_user,
    )
    if fired.delivery is not None:
        # As POST /v1/runs: wait briefly for the ack; a slow or failed publish is the
        # sweeper's to repeat, the run is durable already.
        with contextlib.suppress(TimeoutError, KodaError):
            await asyncio.wait_for(asyncio.shield(fired.delivery), RUN_NOW_WAIT_S)
            await gw.store.mark_published([fired.run.run_id])
    return ScheduledRun(
        run_id=fired.run.run_id,
        status=fired.run.status,
        events_url=f"/v1/runs/{fired.run.run_id}/events",
        schedule_id=row.id,
        scheduled_for=minute,
    )


async def _check_daily_cap(gw: Components, row: ScheduleRow, now: datetime) -> None:
    """Refuse (429) a ``run-now`` when the owner has ``row.daily_cap`` scheduled runs on
    the schedule's local day already: the rule the scheduler skips a fire by. Read
    unlocked, like the scheduler's: requests at the same instant may each pass it."""
    spec = _spec(row.cron, row.timezone)
    day = spec.local(now).date()
    start, end = spec.day_bounds(day)
    (count,) = await gw.schedules.scheduled_counts([(row.user_id, start, end)])
    if count < row.daily_cap:
        return
    retry_after_s = max(1, math.ceil((end - now).total_seconds()))
    metrics.QUOTA_REFUSALS.labels(quota="schedule_daily").inc()
    raise LimitReached(
        f"you have {count} scheduled runs on {day.isoformat()} ({spec.timezone}) and this "
        f"schedule's daily_cap={row.daily_cap} allows no more: retry after "
        f"{retry_after_s} s (the local day's end), or raise daily_cap",
        status=429,
        code="daily_cap_reached",
        setting="daily_cap",
        cap=row.daily_cap,
        count=count,
        field="daily_cap",
        retry_after_s=retry_after_s,
    )
