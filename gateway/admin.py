"""``GET /admin/workers``: the heartbeat table, for people and alerts (never routing).

Access as every ``/admin`` route (gateway/auth.py ``check_admin``): with
``KODA_ADMIN_TOKEN`` set, ``Authorization: Bearer <that token>``; without it, open
in ``dev`` and refused (403) in ``prod``. The app checks it for the whole ``/admin``
prefix (gateway/app.py ``AdminGuard``); ``ADMIN`` on each route declares it in OpenAPI.

``POST /admin/users/{user_id}/erase``: per-user erasure (gateway/erasure.py), answered
with the receipt.
"""

from __future__ import annotations

from datetime import datetime

from fastapi import APIRouter, Query
from pydantic import BaseModel, Field

from koda_runtime.errors import PublishError
from koda_runtime.gateway.auth import valid_user_id
from koda_runtime.gateway.dependencies import ADMIN, Gateway
from koda_runtime.gateway.erasure import Eraser, RunsStillOpen
from koda_runtime.gateway.errors import BadRequest, GatewayError, Unavailable
from koda_runtime.gateway.models import error_responses

router = APIRouter(prefix="/admin", tags=["admin"])
_ERRORS = error_responses(
    {401: "Missing or wrong admin token", 403: "prod without KODA_ADMIN_TOKEN"}
)


class WorkerRow(BaseModel):
    worker_id: str
    lastBeatMs: int = Field(description="Milliseconds since the worker's last beat.")  # noqa: N815
    in_flight: int
    version: str
    partitions: list[int] = Field(description="Runs partitions the worker holds.")
    host: str
    pid: int | None = Field(description="Its process id on that host (null: an older worker).")
    instance: str = Field(description="The random id its process drew at start ('' if older).")
    stale: bool = Field(description="No beat for more than KODA_BEAT_STALE_AFTER seconds.")
    conflict: bool = Field(description="More than one live process beats under this worker_id.")


class ConflictingProcess(BaseModel):
    host: str
    pid: int | None
    instance: str
    lastBeatMs: int  # noqa: N815
    stale: bool


class WorkerIdConflict(BaseModel):
    worker_id: str
    processes: list[ConflictingProcess] = Field(
        description="Every process whose beats under this worker_id interleave with another's."
    )


class WorkersReport(BaseModel):
    status: str = Field(
        description="ok, or degraded: fewer alive than expected, any stale, or any conflict."
    )
    expected: int = Field(description="KODA_EXPECTED_WORKERS.")
    alive: int
    stale: int
    conflicts: list[WorkerIdConflict] = Field(
        description="Worker ids that two or more live processes claim (each should have its own)."
    )
    workers: list[WorkerRow]


@router.get(
    "/workers",
    response_model=WorkersReport,
    responses=_ERRORS,
    dependencies=[ADMIN],
    summary="Workers' heartbeats: who is alive, stale, and what each holds",
)
async def workers(gw: Gateway) -> WorkersReport:
    return WorkersReport.model_validate(gw.workers.report())


class ErasureReceipt(BaseModel):
    erasure_id: str
    user_digest: str = Field(description="SHA-256 hex of the user id: the receipt keeps no id.")
    pseudonym: str = Field(description="The user id the ledger keeps for this user's rows.")
    requested_at: datetime
    completed_at: datetime
    counts: dict[str, int] = Field(description="Rows and records removed, per store.")
    requested_by: str


class ErasureBlocked(GatewayError):
    status = 409
    code = "runs_still_open"


MAX_REQUESTED_BY_CHARS = 200


@router.post(
    "/users/{user_id}/erase",
    response_model=ErasureReceipt,
    responses={
        **_ERRORS,
        **error_responses(
            {
                400: "A bad user id or requested_by",
                409: "Runs of the user did not end within KODA_ERASURE_WAIT_S (named)",
                503: "Postgres or the broker is unavailable; erase again",
            }
        ),
    },
    dependencies=[ADMIN],
    summary="Erase a user: their runs, output, sessions, memories, schedules and budgets",
)
async def erase_user(
    user_id: str,
    gw: Gateway,
    requested_by: str = Query(
        "admin-api", description="Who asked (an operator, a ticket), kept in the receipt."
    ),
) -> ErasureReceipt:
    if not valid_user_id(user_id):
        raise BadRequest("user_id must be 1-128 chars of A-Z a-z 0-9 . _ @ -", field="user_id")
    if not 0 < len(requested_by) <= MAX_REQUESTED_BY_CHARS or not requested_by.isprintable():
        raise BadRequest(
            f"requested_by must be 1-{MAX_REQUESTED_BY_CHARS} printable chars",
            field="requested_by",
        )
    eraser = Eraser(gw.engine, gw.settings, gw.publisher.send)
    try:
        receipt = await eraser.erase(user_id, requested_by)
    except RunsStillOpen as exc:
        raise ErasureBlocked(str(exc), field="user_id") from exc
    except (PublishError, TimeoutError) as exc:
        raise Unavailable(
            f"the broker did not acknowledge the erasure's tombstones ({exc}); the runs "
            "not yet tombstoned were kept: erase again"
        ) from exc
    return ErasureReceipt(
        erasure_id=receipt.id,
        user_digest=receipt.user_digest,
        pseudonym=receipt.pseudonym,
        requested_at=receipt.requested_at,
        completed_at=receipt.completed_at,
        counts=receipt.counts,
        requested_by=receipt.requested_by,
    )
