"""The web console at ``/console``, and the reads it needs that no other route gives.

The console is static files (gateway/console_static/: HTML, CSS and plain JavaScript
modules, no build step, nothing fetched from another host) that call the public
API with the bearer token the user signs in with, and ``/admin/*`` with the admin
token. Three endpoints exist for it:

* ``GET /v1/runs/{run_id}/timeline`` (owner only, 404 otherwise): the run's
  lifecycle as Postgres holds it: its timestamps, worker, partition, attempts,
  failures, cancel request, error, the non-chunk messages it emitted (status,
  reset, done, error, cancelled, each with its attempt and time) and its cost
  from the ledger.
* ``GET /v1/sessions/{session_id}/turns`` (owner only, 404 otherwise): the session as
  a conversation, for the chat: each run's user messages (merged ones inside their
  run), its answer so far, status and error, oldest first.
* ``GET /admin/lag`` (admin access as in gateway/admin.py): per runs partition,
  the end offset, the worker group's committed offset and the lag, asked of the
  broker when the request comes (the figures ``koda_consumer_lag`` reports), through
  the worker directory's one offsets reader (gateway/workers.py).

Every console response (the page and its assets) carries :data:`SECURITY_HEADERS`: a
Content-Security-Policy that lets the page load and call nothing but its own origin,
run no inline script, and be framed by no page, and ``X-Content-Type-Options: nosniff``.
A run's output follows with a stream ticket (gateway/auth.py), never the token in a URL.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from confluent_kafka import KafkaException
from fastapi import APIRouter, FastAPI
from fastapi.responses import FileResponse, JSONResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles
from sqlalchemy import text
from sqlalchemy.exc import SQLAlchemyError
from starlette.responses import Response
from starlette.types import Scope

from koda_runtime.errors import DatabaseError
from koda_runtime.gateway.dependencies import ADMIN, Gateway, User
from koda_runtime.gateway.errors import NotFound, Unavailable
from koda_runtime.gateway.intake import SESSION_ID
from koda_runtime.lifecycle.states import RunStatus
from koda_runtime.lifecycle.turns import user_messages
from koda_runtime.schemas.turns import MAX_TURNS, SESSION_RUNS

# Resolved: an editable install links each file, and StaticFiles serves no file whose
# link points outside its directory.
STATIC = Path(__file__).resolve().with_name("console_static")
MAX_RUN_ID_CHARS = 128
CSP = "default-src 'self'; frame-ancestors 'none'; object-src 'none'; base-uri 'none'"
SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}

router = APIRouter()

_RUN = text(
    """
    SELECT id, session_id, status, attempt, worker_id, partition, created_at, published_at,
           started_at, first_chunk_at, finished_at, error, failures, cancel_requested_at,
           cancel_reason, schedule_id, scheduled_for
    FROM runs WHERE id = :run_id AND user_id = :user_id
    """
)
_EVENTS = text(
    "SELECT seq, kind, content, attempt, created_at FROM messages"
    " WHERE run_id = :run_id AND kind <> 'chunk' ORDER BY seq"
)
_CHUNKS = text(
    "SELECT attempt, count(*) AS chunks, min(created_at) AS first_at, max(created_at) AS last_at"
    " FROM messages WHERE run_id = :run_id AND kind = 'chunk' GROUP BY attempt ORDER BY attempt"
)
_COST = text(
    "SELECT coalesce(sum(cost_usd), 0) AS cost, count(*) AS calls FROM ledger"
    " WHERE run_id = :run_id"
)


class ConsoleAssets(StaticFiles):
    """The console's static files, each with :data:`SECURITY_HEADERS`."""

    async def get_response(self, path: str, scope: Scope) -> Response:
        response = await super().get_response(path, scope)
        response.headers.update(SECURITY_HEADERS)
        return response


def install_console(app: FastAPI) -> None:
    """Serve the console's page at ``/console`` and its assets under ``/console/assets``."""
    app.mount("/console/assets", ConsoleAssets(directory=STATIC), name="console-assets")
    app.include_router(router)


@router.get("/console", include_in_schema=False)
async def console_page() -> FileResponse:
    return FileResponse(STATIC / "index.html", media_type="text/html", headers=SECURITY_HEADERS)


@router.get("/console/", include_in_schema=False)
async def console_slash() -> RedirectResponse:
    return RedirectResponse("/console", status_code=308)


def _iso(value: Any) -> str | None:
    return None if value is None else value.isoformat()


@router.get(
    "/v1/runs/{run_id}/timeline",
    summary="A run's lifecycle: timestamps, worker, partition, attempts, events and cost",
)
async def run_timeline(run_id: str, gw: Gateway, user_id: User) -> JSONResponse:
    missing = NotFound("run not found: check the run id and the token's user", field="run_id")
    if not run_id or len(run_id) > MAX_RUN_ID_CHARS or "\x00" in run_id:
        raise missing
    try:
        async with gw.engine.connect() as conn:
            run = (await conn.execute(_RUN, {"run_id": run_id, "user_id": user_id})).first()
            if run is None:
                raise missing
            events = (await conn.execute(_EVENTS, {"run_id": run_id})).all()
            chunks = (await conn.execute(_CHUNKS, {"run_id": run_id})).all()
            cost = (await conn.execute(_COST, {"run_id": run_id})).one()
    except SQLAlchemyError as exc:
        raise DatabaseError(f"reading a run's timeline failed: {type(exc).__name__}") from exc
    return JSONResponse(
        {
            "run_id": run.id,
            "session_id": run.session_id,
            "status": run.status,
            "attempt": run.attempt,
            "worker_id": run.worker_id,
            "partition": run.partition,
            "failures": run.failures,
            "error": run.error,
            "cancel_reason": run.cancel_reason,
            "schedule_id": run.schedule_id,
            "scheduled_for": _iso(run.scheduled_for),
            "times": {
                "created_at": _iso(run.created_at),
                "published_at": _iso(run.published_at),
                "started_at": _iso(run.started_at),
                "first_chunk_at": _iso(run.first_chunk_at),
                "cancel_requested_at": _iso(run.cancel_requested_at),
                "finished_at": _iso(run.finished_at),
            },
            "events": [
                {
                    "seq": e.seq,
                    "kind": e.kind,
                    "content": e.content,
                    "attempt": e.attempt,
                    "at": _iso(e.created_at),
                }
                for e in events
            ],
            "attempts": [
                {
                    "attempt": c.attempt,
                    "chunks": c.chunks,
                    "first_chunk_at": _iso(c.first_at),
                    "last_chunk_at": _iso(c.last_at),
                }
                for c in chunks
            ],
            "cost_usd": str(cost.cost),
            "billable_calls": cost.calls,
        }
    )


_SESSION_OWNER = text("SELECT 1 FROM sessions WHERE id = :session_id AND user_id = :user_id")


@router.get(
    "/v1/sessions/{session_id}/turns",
    summary="A session as a conversation: each run's messages and answer, oldest first",
)
async def session_turns(session_id: str, gw: Gateway, user_id: User) -> JSONResponse:
    """The session's latest ``MAX_TURNS`` runs, oldest first: each run's user messages
    (the first and each merged into it), its answer so far (the last attempt's), its
    status and error. Owner only: another user's session answers 404."""
    missing = NotFound(
        "session not found: check the session id and the token's user", field="session_id"
    )
    if not SESSION_ID.fullmatch(session_id):
        raise missing
    params = {"session_id": session_id, "user_id": user_id, "limit": MAX_TURNS}
    try:
        async with gw.engine.connect() as conn:
            if (await conn.execute(_SESSION_OWNER, params)).first() is None:
                raise missing
            rows = (await conn.execute(SESSION_RUNS, params)).all()
    except SQLAlchemyError as exc:
        raise DatabaseError(f"reading a session's turns failed: {type(exc).__name__}") from exc
    return JSONResponse(
        {
            "session_id": session_id,
            "turns": [
                {
                    "run_id": r.id,
                    "status": r.status,
                    "messages": user_messages(r.input if isinstance(r.input, dict) else {}),
                    "answer": r.answer,
                    "cut": r.status == RunStatus.CANCELLED.value,
                    "error": r.error,
                    "created_at": _iso(r.created_at),
                    "finished_at": _iso(r.finished_at),
                }
                for r in rows
            ],
        }
    )


@router.get(
    "/admin/lag",
    tags=["admin"],
    dependencies=[ADMIN],
    summary="Per runs partition: end offset, the worker group's committed offset, and lag",
)
async def consumer_lag(gw: Gateway) -> JSONResponse:
    directory = gw.workers
    try:
        lags = await directory.lag()
    except KafkaException as exc:
        raise Unavailable(f"the broker did not answer for offsets: {exc}") from None
    rows = [
        {"partition": x.partition, "end_offset": x.end, "committed": x.committed, "lag": x.lag}
        for x in lags
    ]
    return JSONResponse(
        {"topic": directory.runs_topic, "group": directory.group, "partitions": rows}
    )
