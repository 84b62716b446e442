"""Run control routes: cancel a run, and list a user's or a session's runs.

``POST /v1/runs/{run_id}/cancel`` is owner-only (another user's run answers the same
404 as an unknown one) and idempotent: a terminal run answers 200 with its state and
nothing changes. A pending run becomes ``cancelled`` here and now (its trigger is
skipped by the worker that reads it); for a running one the request is made durable in
Postgres first, then signalled on the run-control topic (202), and the worker ends the
run ``cancelled``. History pages are newest first; ``before`` is the last run id of
the previous page.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import JSONResponse

from koda_runtime import metrics
from koda_runtime.errors import DatabaseError, PublishError
from koda_runtime.gateway.auth import valid_user_id
from koda_runtime.gateway.bootstrap import Components
from koda_runtime.gateway.dependencies import (
    ADMIN,
    Gateway,
    RunId,
    User,
    possible_run_id,
    run_not_found,
)
from koda_runtime.gateway.errors import BadRequest, InvalidField, NotFound
from koda_runtime.gateway.intake import SESSION_ID, check_content_type, decode_json, read_body
from koda_runtime.gateway.models import (
    CancelRequest,
    OperatorRunPage,
    OperatorRunSummary,
    RunCancel,
    RunPage,
    RunSummary,
    error_responses,
)
from koda_runtime.lifecycle.chunks import ChunkKind, chunk_key
from koda_runtime.lifecycle.control import CANCEL, MAX_REASON_CHARS, ControlRecord
from koda_runtime.lifecycle.states import RunStatus
from koda_runtime.schemas.runs.control import CANCELLED, REQUESTED, CancelOutcome, ListedRun
from koda_runtime.topics.catalogue import RUN_CHUNKS, partition_for_key
from koda_runtime.topics.records.codec import RUN_CHUNK, chunk_value, headers_for

log = logging.getLogger(__name__)

DEFAULT_LIMIT = 20
MAX_LIMIT = 100
CANCEL_BODY_LIMIT = 4096

router = APIRouter()


_DESCRIBED = {
    400: "A bad query parameter or body (the field is named)",
    401: "Missing or invalid bearer token",
    404: "Unknown run or session (or another user's)",
    415: "Body is not application/json",
    422: "A field is missing or invalid",
    503: "Postgres is unavailable; see Retry-After",
}


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    return error_responses({c: _DESCRIBED[c] for c in codes})


async def _reason(request: Request) -> str | None:
    """The optional ``{"reason": ...}`` body; an empty body is no reason."""
    body = await read_body(
        request.headers.get("content-length"), request.stream(), CANCEL_BODY_LIMIT
    )
    if not body.strip():
        return None
    check_content_type(request.headers.get("content-type"))
    obj = decode_json(body)
    if not isinstance(obj, dict):
        raise InvalidField("the body must be a JSON object", field="body")
    for name in obj:
        if name != "reason":
            raise InvalidField(
                f"unknown field {name[:64]!r}: the only field is reason", field=name[:64]
            )
    reason = obj.get("reason")
    if reason is None:
        return None
    if not isinstance(reason, str) or len(reason) > MAX_REASON_CHARS or "\x00" in reason:
        raise InvalidField(
            f"reason must be a string of at most {MAX_REASON_CHARS} characters", field="reason"
        )
    return reason


@router.post(
    "/v1/runs/{run_id}/cancel",
    response_model=RunCancel,
    responses={
        202: {"model": RunCancel, "description": "Running: the worker ends it cancelled"},
        **_errors(400, 401, 404, 415, 422, 503),
    },
    openapi_extra={
        "requestBody": {
            "required": False,
            "content": {"application/json": {"schema": CancelRequest.model_json_schema()}},
        }
    },
    summary="Cancel a run (idempotent)",
)
async def cancel_run(request: Request, gw: Gateway, user_id: User, run_id: RunId) -> Response:
    reason = await _reason(request)
    outcome = await gw.control.cancel(run_id, user_id, reason)
    if outcome is None:
        raise run_not_found()
    metrics.RUNS_CANCEL_REQUESTS.labels(outcome=outcome.outcome).inc()
    log.info(
        "event=run_cancel run_id=%s user_id=%s outcome=%s status=%s",
        run_id,
        user_id,
        outcome.outcome,
        outcome.status,
    )
    if outcome.outcome == CANCELLED:
        await _publish_end(gw, outcome)
    elif outcome.outcome == REQUESTED:
        await gw.admissions.signal(
            ControlRecord(run_id, user_id, CANCEL, reason=outcome.cancel_reason)
        )
    body = RunCancel(
        run_id=outcome.run_id,
        status=outcome.status,
        cancel_requested=outcome.cancel_requested_at is not None,
        cancel_reason=outcome.cancel_reason,
        events_url=f"/v1/runs/{run_id}/events",
    )
    return JSONResponse(
        body.model_dump(mode="json"), status_code=202 if outcome.outcome == REQUESTED else 200
    )


async def _publish_end(gw: Components, outcome: CancelOutcome) -> None:
    """The terminal event of a run cancelled while pending, for live viewers (Postgres
    has it already; a viewer that misses the record finds it at its next re-read)."""
    if outcome.event_seq is None or outcome.event_content is None:
        return
    partition = outcome.partition
    if partition is None:
        partition = partition_for_key(outcome.user_id.encode(), gw.settings.partitions)
    try:
        await asyncio.wait_for(
            gw.publisher.send(
                gw.settings.names.topic(RUN_CHUNKS),
                chunk_key(outcome.run_id, outcome.event_seq).encode(),
                chunk_value(
                    outcome.run_id,
                    outcome.event_seq,
                    ChunkKind.CANCELLED.value,
                    outcome.event_content,
                    0,
                ),
                list(headers_for(RUN_CHUNK)),
                partition=partition,
            ),
            gw.admissions.publish_wait_s,
        )
    except (PublishError, TimeoutError) as exc:
        log.warning("event=cancel_event_publish_failed run_id=%s error=%s", outcome.run_id, exc)
        return
    # A pending run has no earlier messages (no edge leads back to pending), so the
    # event just acknowledged is all of the run. Unmarked, the worker that skips the
    # trigger and the completeness pass would each produce it again.
    if outcome.event_seq == 0:
        try:
            await gw.control.mark_published(outcome.run_id, outcome.event_seq)
        except DatabaseError as exc:
            # The run is cancelled and its event delivered: the worst case is a re-send.
            log.warning("event=mark_published_failed runs=1 error=%s", exc)


def _limit(raw: str | None) -> int:
    if raw is None:
        return DEFAULT_LIMIT
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_LIMIT:
        raise BadRequest(
            f"limit must be an integer from 1 to {MAX_LIMIT}", field="limit", code="invalid_query"
        )
    return int(raw)


async def _rows(
    gw: Components,
    user_id: str | None,
    *,
    session_id: str | None,
    status: RunStatus | None,
    limit_raw: str | None,
    before: str | None,
    every_user: bool = False,
) -> tuple[list[ListedRun], int]:
    """One page of rows and the limit asked; ``every_user`` for the operators' listing,
    where ``before`` may be any user's run and ``user_id`` only filters."""
    limit = _limit(limit_raw)
    position = None
    if before is not None:
        if not possible_run_id(before):
            raise BadRequest(
                "before must be a run id from an earlier page", field="before", code="invalid_query"
            )
        position = await gw.control.cursor_position(before, None if every_user else user_id)
        if position is None:
            whose = "a run" if every_user else "one of your runs"
            raise BadRequest(
                f"before is not {whose}: pass next_before of the previous page",
                field="before",
                code="invalid_query",
            )
    rows = await gw.control.list_runs(
        user_id,
        every_user=every_user,
        session_id=session_id,
        status=status,
        limit=limit,
        before=position,
    )
    return rows, limit


def _summary(r: ListedRun) -> dict[str, Any]:
    return {
        "run_id": r.run_id,
        "session_id": r.session_id,
        "status": r.status,
        "attempt": r.attempt,
        "created_at": r.created_at,
        "finished_at": r.finished_at,
        "cancel_reason": r.cancel_reason,
        "merged_messages": r.merged,
        "schedule_id": r.schedule_id,
        "scheduled_for": r.scheduled_for,
    }


async def _page(
    gw: Components,
    user_id: str,
    *,
    session_id: str | None,
    status: RunStatus | None,
    limit_raw: str | None,
    before: str | None,
) -> RunPage:
    rows, limit = await _rows(
        gw, user_id, session_id=session_id, status=status, limit_raw=limit_raw, before=before
    )
    runs = [RunSummary(**_summary(r)) for r in rows]
    return RunPage(runs=runs, next_before=runs[-1].run_id if len(runs) == limit else None)


@router.get(
    "/v1/sessions/{session_id}/runs",
    response_model=RunPage,
    responses=_errors(400, 401, 404, 503),
    summary="A session's runs, newest first",
)
async def session_runs(
    session_id: str,
    gw: Gateway,
    user_id: User,
    limit: str | None = Query(None, description=f"1-{MAX_LIMIT}, default {DEFAULT_LIMIT}"),
    before: str | None = Query(None, description="next_before of the previous page"),
) -> RunPage:
    if not SESSION_ID.fullmatch(session_id) or not await gw.control.session_owned(
        session_id, user_id
    ):
        raise NotFound(
            "session not found: check the session id and the token's user", field="session_id"
        )
    return await _page(
        gw, user_id, session_id=session_id, status=None, limit_raw=limit, before=before
    )


@router.get(
    "/v1/runs",
    response_model=RunPage,
    responses=_errors(400, 401, 503),
    summary="Your runs, newest first, optionally by status and session",
)
async def list_runs(
    gw: Gateway,
    user_id: User,
    status: str | None = Query(None, description="One of " + ", ".join(s.value for s in RunStatus)),
    session_id: str | None = Query(None, description="Only this session's runs"),
    limit: str | None = Query(None, description=f"1-{MAX_LIMIT}, default {DEFAULT_LIMIT}"),
    before: str | None = Query(None, description="next_before of the previous page"),
) -> RunPage:
    wanted = _filters(status, session_id)
    return await _page(
        gw, user_id, session_id=session_id, status=wanted, limit_raw=limit, before=before
    )


def _filters(status: str | None, session_id: str | None) -> RunStatus | None:
    """The status asked for (None: any); BadRequest naming a bad status or session id."""
    wanted = None
    if status is not None:
        try:
            wanted = RunStatus(status)
        except ValueError:
            raise BadRequest(
                f"status must be one of {', '.join(s.value for s in RunStatus)}",
                field="status",
                code="invalid_query",
            ) from None
    if session_id is not None and not SESSION_ID.fullmatch(session_id):
        raise BadRequest(
            "session_id must be 1-128 chars of A-Z a-z 0-9 . _ : @ -",
            field="session_id",
            code="invalid_query",
        )
    return wanted


@router.get(
    "/admin/runs",
    response_model=OperatorRunPage,
    responses={
        **_errors(400, 503),
        **error_responses(
            {401: "Missing or wrong admin token", 403: "prod without KODA_ADMIN_TOKEN"}
        ),
    },
    dependencies=[ADMIN],
    tags=["admin"],
    summary="Every user's runs, newest first, optionally by user, status and session",
)
async def operator_runs(
    gw: Gateway,
    user_id: str | None = Query(None, description="Only this user's runs"),
    status: str | None = Query(None, description="One of " + ", ".join(s.value for s in RunStatus)),
    session_id: str | None = Query(None, description="Only this session's runs"),
    limit: str | None = Query(None, description=f"1-{MAX_LIMIT}, default {DEFAULT_LIMIT}"),
    before: str | None = Query(None, description="next_before of the previous page"),
) -> OperatorRunPage:
    wanted = _filters(status, session_id)
    if user_id is not None and not valid_user_id(user_id):
        raise BadRequest(
            "user_id must be 1-128 chars of A-Z a-z 0-9 . _ @ -",
            field="user_id",
            code="invalid_query",
        )
    rows, size = await _rows(
        gw,
        user_id,
        every_user=True,
        session_id=session_id,
        status=wanted,
        limit_raw=limit,
        before=before,
    )
    runs = [OperatorRunSummary(user_id=r.user_id, **_summary(r)) for r in rows]
    return OperatorRunPage(runs=runs, next_before=runs[-1].run_id if len(runs) == size else None)
