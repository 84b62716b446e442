"""``GET /admin/workers``: the heartbeat table, for people and alerts (never routing).

Access as every ``/admin`` route (gateway/auth.py ``check_admin``): with
``KODA_ADMIN_TOKEN`` set, ``Authorization: Bearer <that token>``; without it, open
in ``dev`` and refused (403) in ``prod``. The app checks it for the whole ``/admin``
prefix (gateway/app.py ``AdminGuard``); ``ADMIN`` on each route declares it in OpenAPI.
"""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel, Field

from koda_runtime.gateway.dependencies import ADMIN, Gateway
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
