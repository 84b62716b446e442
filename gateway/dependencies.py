"""FastAPI dependencies: the gateway's components, the calling user, admin access.

A handler declares what it needs and FastAPI hands it over::

    async def get_run(gw: Gateway, user_id: User, run_id: RunId) -> RunView: ...

``User`` authenticates the bearer token (401 otherwise) and declares the scheme in
OpenAPI; ``StreamUser`` also takes ``?ticket=`` (and, in dev, ``?access_token=``) on
the events endpoint only; ``ADMIN`` (in ``dependencies=[...]``) guards ``/admin``
routes, which the app also guards as a whole (gateway/app.py). The checks themselves
are gateway/auth.py's; every 401 counts as a failed login of the client's address.

``RunId`` is the ``{run_id}`` path parameter of every run route: an id no run can have
(longer than :data:`MAX_RUN_ID_CHARS`, or holding NUL) answers :func:`run_not_found`,
the 404 of an unknown run and of another user's. Declared after the user in a
handler's signature, so that a request without a valid token is a 401 first.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Path, Query, Request, Security
from fastapi.security import HTTPAuthorizationCredentials

from koda_runtime.gateway.auth import (
    ADMIN_BEARER,
    BEARER,
    admit_admin,
    authenticate_request,
    authenticate_stream,
)
from koda_runtime.gateway.bootstrap import Components
from koda_runtime.gateway.errors import NotFound

Scheme = HTTPAuthorizationCredentials | None


async def get_components(request: Request) -> Components:
    """The components :func:`koda_runtime.gateway.app.create_app` was built with."""
    components: Components = request.app.state.components
    return components


Gateway = Annotated[Components, Depends(get_components)]


async def current_user(
    request: Request, gw: Gateway, _scheme: Annotated[Scheme, Security(BEARER)]
) -> str:
    """The user id of the request's bearer token (401 without a valid one)."""
    return authenticate_request(request, gw.auth)


async def stream_user(
    run_id: str,
    request: Request,
    gw: Gateway,
    _scheme: Annotated[Scheme, Security(BEARER)],
    ticket: str | None = Query(
        None,
        description="A stream ticket from POST /v1/runs/{run_id}/stream-ticket, for "
        "clients that cannot set headers (EventSource); valid 60 s, for this run only.",
    ),
    access_token: str | None = Query(
        None,
        description="dev only: the dev token (refused in prod, where a browser uses a ticket).",
    ),
) -> str:
    """As :func:`current_user`, or from ``?ticket=`` (or, in dev, ``?access_token=``)."""
    return authenticate_stream(request, gw.auth, run_id, ticket, access_token)


async def admin_access(
    request: Request, gw: Gateway, _scheme: Annotated[Scheme, Security(ADMIN_BEARER)]
) -> None:
    """Refuse (401/403) a request that may not open ``/admin``."""
    admit_admin(request, gw.auth, gw.settings)


User = Annotated[str, Depends(current_user)]
StreamUser = Annotated[str, Depends(stream_user)]
ADMIN = Depends(admin_access)


MAX_RUN_ID_CHARS = 128


def run_not_found() -> NotFound:
    """The answer for a run the caller cannot see: unknown, or another user's (the two
    are indistinguishable)."""
    return NotFound("run not found: check the run id and the token's user", field="run_id")


def possible_run_id(value: str) -> bool:
    """Whether some run could have the id ``value``: 1 to MAX_RUN_ID_CHARS characters,
    none of them NUL (which Postgres text cannot hold)."""
    return 0 < len(value) <= MAX_RUN_ID_CHARS and "\x00" not in value


async def run_id_path(
    run_id: Annotated[str, Path(description="The run's id (`run_id` of POST /v1/runs).")],
) -> str:
    """The ``{run_id}`` path parameter; :func:`run_not_found` for an id no run can have."""
    if not possible_run_id(run_id):
        raise run_not_found()
    return run_id


RunId = Annotated[str, Depends(run_id_path)]
