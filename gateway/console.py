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
from starlette.responses import Response
from starlette.types import Scope

from koda_runtime.gateway.dependencies import ADMIN, Gateway, RunId, User, run_not_found
from koda_runtime.gateway.errors import NotFound, Unavailable
from koda_runtime.gateway.intake import SESSION_ID
from koda_runtime.schemas.runs.reads import MAX_TURNS

# Resolved: an editable install links each file, and StaticFiles serves no file whose
# link points outside its directory.
STATIC = Path(__file__).resolve().with_name("console_static")
CSP = "default-src 'self'; frame-ancestors 'none'; object-src 'none'; base-uri 'none'"
SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}

router = APIRouter()


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
async def run_timeline(gw: Gateway, user_id: User, run_id: RunId) -> JSONResponse:
    timeline = await gw.reads.timeline(run_id, user_id)
    if timeline is None:
        raise run_not_found()
    run = timeline.run
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
                    "at": _iso(e.at),
                }
                for e in timeline.events
            ],
            "attempts": [
                {
                    "attempt": c.attempt,
                    "chunks": c.chunks,
                    "first_chunk_at": _iso(c.first_at),
                    "last_chunk_at": _iso(c.last_at),
                }
                for c in timeline.attempts
            ],
            "cost_usd": str(timeline.cost_usd),
            "billable_calls": timeline.billable_calls,
        }
    )


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
    runs = await gw.reads.session_runs(session_id, user_id, MAX_TURNS)
    if runs is None:
        raise missing
    return JSONResponse(
        {
            "session_id": session_id,
            "turns": [
                {
                    "run_id": r.run_id,
                    "status": r.status,
                    "messages": r.messages,
                    "answer": r.answer,
                    "cut": r.cut,
                    "error": r.error,
                    "created_at": _iso(r.created_at),
                    "finished_at": _iso(r.finished_at),
                }
                for r in runs
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
