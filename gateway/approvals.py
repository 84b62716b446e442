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

from koda_runtime.gateway.dependencies import Gateway, RunId, User, run_not_found
from koda_runtime.gateway.errors import GatewayError
from koda_runtime.gateway.models import error_responses
from koda_runtime.lifecycle.control import MERGE, ControlRecord
from koda_runtime.lifecycle.states import RunStatus
from koda_runtime.schemas.journal import APPROVED, AWAITING, REJECTED, Awaited, decide

log = logging.getLogger(__name__)

router = APIRouter()


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
async def approve(gw: Gateway, user_id: User, run_id: RunId) -> Decision:
    return await _decide(gw, run_id, user_id, APPROVED)


@router.post(
    "/v1/runs/{run_id}/reject",
    response_model=Decision,
    responses=_RESPONSES,
    summary="Reject the tool call a run waits for (idempotent)",
)
async def reject(gw: Gateway, user_id: User, run_id: RunId) -> Decision:
    return await _decide(gw, run_id, user_id, REJECTED)


async def _decide(gw: Gateway, run_id: str, user_id: str, decision: str) -> Decision:
    timeout_s = gw.settings.approval_timeout_s

    def check(row: Awaited) -> bool:
        if row.decision is not None:
            if row.decision != decision:
                raise Conflict(
                    f"the call of {row.tool!r} (step {row.step}) was already {row.decision}",
                    field="run_id",
                )
            return False  # the same answer again: nothing changes
        if row.status != RunStatus.WAITING.value or row.step_status != AWAITING:
            raise Conflict(
                f"run {run_id} is not waiting for an approval (status {row.status})",
                field="run_id",
            )
        if row.age_s >= timeout_s:
            raise Conflict(
                f"the call of {row.tool!r} waited over {timeout_s:g} s "
                "(KODA_APPROVAL_TIMEOUT_S): it is rejected",
                field="run_id",
            )
        return True

    decided = await decide(gw.engine, run_id, user_id, decision, by=f"user:{user_id}", check=check)
    if decided is None:
        raise run_not_found()
    row, fresh = decided
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
        run_id=run_id,
        step=int(row.step or 0),
        tool=str(row.tool),
        decision=decision,
        status=row.status,
    )
