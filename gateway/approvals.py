"""A person's answer to a tool call that waits for one: approve or reject.

``POST /v1/runs/{run_id}/approve`` and ``/reject`` are owner-only (another user's run
answers the same 404 as an unknown one) and idempotent: the decision already recorded
answers 200 again; the other decision, a run that is not ``waiting`` for an approval,
or a wait past ``KODA_APPROVAL_TIMEOUT_S`` answer 409. The decision is recorded on the
run's ``awaiting`` tool step in Postgres first, then signalled on the run-control
topic (a ``merge`` record with the run's unchanged input version: a wake-up, see
processors/control.py); the worker holding the run's partition resumes it, and a
missed signal is found within a recheck (processors/runner.py).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel
from sqlalchemy import text
from sqlalchemy.exc import SQLAlchemyError

from koda_runtime.errors import DatabaseError
from koda_runtime.gateway.dependencies import Gateway, User
from koda_runtime.gateway.errors import GatewayError, NotFound
from koda_runtime.gateway.models import error_responses
from koda_runtime.lifecycle.control import MERGE, ControlRecord
from koda_runtime.lifecycle.states import RunStatus

log = logging.getLogger(__name__)

router = APIRouter()

MAX_RUN_ID_CHARS = 128
APPROVED = "approved"
REJECTED = "rejected"

# The run (owner's only) and its latest step that waits or was decided, locked.
_READ = text(
    """
    SELECT r.id, r.user_id, r.status, COALESCE(r.input_version, 0) AS input_version,
           s.step, s.tool, s.status AS step_status, s.decision,
           EXTRACT(EPOCH FROM now() - s.created_at) AS age_s
      FROM runs r
      LEFT JOIN LATERAL (
           SELECT step, tool, status, decision, created_at FROM tool_steps
            WHERE run_id = r.id AND superseded_at IS NULL
              AND (status = 'awaiting' OR decision IS NOT NULL)
            ORDER BY step DESC LIMIT 1) s ON true
     WHERE r.id = :run_id AND r.user_id = :user_id
       FOR UPDATE OF r
    """
)
_DECIDE = text(
    """
    UPDATE tool_steps SET decision = :decision, decided_by = :by, decided_at = now()
     WHERE run_id = :run_id AND step = :step AND status = 'awaiting' AND decision IS NULL
    RETURNING step
    """
)


class Conflict(GatewayError):
    status = 409
    code = "conflict"


class Decision(BaseModel):
    """What was decided on the run's waiting tool call."""

    run_id: str
    step: int
    tool: str
    decision: str
    status: str


def _not_found() -> NotFound:
    return NotFound("run not found: check the run id and the token's user", field="run_id")


_RESPONSES: dict[int | str, dict[str, Any]] = error_responses(
    {
        401: "Missing or invalid bearer token",
        404: "Unknown run (or another user's)",
        409: "The run is not waiting for an approval, it was decided otherwise, or it timed out",
        503: "Postgres is unavailable; see Retry-After",
    }
)


@router.post(
    "/v1/runs/{run_id}/approve",
    response_model=Decision,
    responses=_RESPONSES,
    summary="Approve the tool call a run waits for (idempotent)",
)
async def approve(run_id: str, gw: Gateway, user_id: User) -> Decision:
    return await _decide(gw, run_id, user_id, APPROVED)


@router.post(
    "/v1/runs/{run_id}/reject",
    response_model=Decision,
    responses=_RESPONSES,
    summary="Reject the tool call a run waits for (idempotent)",
)
async def reject(run_id: str, gw: Gateway, user_id: User) -> Decision:
    return await _decide(gw, run_id, user_id, REJECTED)


async def _decide(gw: Gateway, run_id: str, user_id: str, decision: str) -> Decision:
    if len(run_id) > MAX_RUN_ID_CHARS or "\x00" in run_id:
        raise _not_found()
    timeout_s = gw.settings.approval_timeout_s
    try:
        async with gw.engine.begin() as conn:
            row = (await conn.execute(_READ, {"run_id": run_id, "user_id": user_id})).first()
            if row is None:
                raise _not_found()
            if row.decision is not None:
                if row.decision != decision:
                    raise Conflict(
                        f"the call of {row.tool!r} (step {row.step}) was already {row.decision}",
                        field="run_id",
                    )
                fresh = False  # the same answer again: nothing changes
            elif row.status != RunStatus.WAITING.value or row.step_status != "awaiting":
                raise Conflict(
                    f"run {run_id} is not waiting for an approval (status {row.status})",
                    field="run_id",
                )
            elif float(row.age_s or 0) >= timeout_s:
                raise Conflict(
                    f"the call of {row.tool!r} waited over {timeout_s:g} s "
                    "(KODA_APPROVAL_TIMEOUT_S): it is rejected",
                    field="run_id",
                )
            else:
                params = {
                    "decision": decision,
                    "by": f"user:{user_id}",
                    "run_id": run_id,
                    "step": row.step,
                }
                fresh = (await conn.execute(_DECIDE, params)).first() is not None
    except SQLAlchemyError as exc:
        raise DatabaseError(f"deciding a tool call failed: {type(exc).__name__}") from exc
    if fresh or row.status == RunStatus.WAITING.value:
        # A wake-up (again, for a repeated answer: the first signal may have been lost).
        await gw.admissions.signal(
            ControlRecord(
                run_id, user_id, MERGE, reason="approval", input_version=int(row.input_version)
            )
        )
    log.info(
        "event=run_decision run_id=%s user_id=%s step=%s decision=%s repeated=%s",
        run_id,
        user_id,
        row.step,
        decision,
        not fresh,
    )
    return Decision(
        run_id=run_id, step=int(row.step), tool=str(row.tool), decision=decision, status=row.status
    )
