"""``GET /admin/workers``: the heartbeat table, for people and alerts (never routing).

Access:

* ``KODA_ADMIN_TOKEN`` set: every ``/admin`` request needs
  ``Authorization: Bearer <that token>`` (compared in constant time), in any
  environment.
* not set: open in ``dev``; in ``prod`` every ``/admin`` request is refused
  with 403 until a token is configured.

The admin token is not a user token: ``dev:<user>`` and ``KODA_API_TOKENS``
never open ``/admin``.
"""

from __future__ import annotations

import hmac

from fastapi import APIRouter, Request, Security
from fastapi.security import HTTPBearer
from pydantic import BaseModel, Field

from gateway.components import components_of
from gateway.errors import Forbidden, Unauthorized
from gateway.models import ErrorBody
from gateway.workers import WorkerDirectory
from koda.naming import AppEnv

router = APIRouter(prefix="/admin", tags=["admin"])
_admin_bearer = HTTPBearer(
    auto_error=False, scheme_name="AdminToken", description="KODA_ADMIN_TOKEN (prod: required)"
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


def require_admin(request: Request) -> None:
    """Raise unless this request may read ``/admin`` (see the module docstring)."""
    settings = components_of(request).settings
    token = settings.admin_token
    if token is None:
        if settings.app_env is AppEnv.PROD:
            raise Forbidden("/admin is closed in prod until KODA_ADMIN_TOKEN is configured")
        return
    scheme, _, presented = (request.headers.get("authorization") or "").strip().partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(
        presented.strip().encode(), token.encode()
    ):
        raise Unauthorized("/admin needs 'Authorization: Bearer <KODA_ADMIN_TOKEN>'")


def directory_of(request: Request) -> WorkerDirectory:
    directory = getattr(request.app.state, "workers", None)
    if not isinstance(directory, WorkerDirectory):
        raise RuntimeError("the gateway is not started: its lifespan did not run")
    return directory


@router.get(
    "/workers",
    response_model=WorkersReport,
    responses={
        401: {"model": ErrorBody, "description": "Missing or wrong admin token"},
        403: {"model": ErrorBody, "description": "prod without KODA_ADMIN_TOKEN"},
    },
    dependencies=[Security(_admin_bearer)],
    summary="Workers' heartbeats: who is alive, stale, and what each holds",
)
async def workers(request: Request) -> WorkersReport:
    require_admin(request)
    return WorkersReport.model_validate(directory_of(request).report())
