"""``GET /v1/memories`` (the caller's own) and ``DELETE /v1/memories/{id}`` (forget)."""

from __future__ import annotations

import re
from datetime import datetime
from typing import Any

from fastapi import APIRouter, Request, Response, Security
from fastapi.security import HTTPBearer
from pydantic import BaseModel

from gateway.components import components_of
from gateway.errors import NotFound
from gateway.models import ErrorBody
from schemas.memories import forget, list_for

router = APIRouter()
_bearer = HTTPBearer(auto_error=False, description="dev: 'dev:<user_id>'; prod: an API token")
# What processors/memory/store.py's memory_id makes; anything else is no memory.
_ID = re.compile(r"mem_[0-9a-f]{24}")


class MemoryOut(BaseModel):
    id: str
    text: str
    run_id: str | None
    created_at: datetime


class MemoryList(BaseModel):
    memories: list[MemoryOut]


_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorBody, "description": "Missing or invalid bearer token"},
    404: {"model": ErrorBody, "description": "No such memory of this user"},
}


def _user(request: Request) -> str:
    gw = components_of(request)
    user_id = gw.auth.authenticate(request.headers.get("authorization"))
    request.state.user_id = user_id
    return user_id


@router.get(
    "/v1/memories",
    response_model=MemoryList,
    responses={401: _ERRORS[401]},
    dependencies=[Security(_bearer)],
    summary="The caller's long-term memories, newest first",
)
async def get_memories(request: Request) -> MemoryList:
    user_id = _user(request)
    memories = await list_for(components_of(request).store.engine, user_id)
    return MemoryList(
        memories=[
            MemoryOut(id=m.id, text=m.text, run_id=m.run_id, created_at=m.created_at)
            for m in memories
        ]
    )


@router.delete(
    "/v1/memories/{memory_id}",
    status_code=204,
    responses=_ERRORS,
    dependencies=[Security(_bearer)],
    summary="Forget one of the caller's memories",
)
async def delete_memory(memory_id: str, request: Request) -> Response:
    user_id = _user(request)
    found = _ID.fullmatch(memory_id) is not None and await forget(
        components_of(request).store.engine, user_id, memory_id
    )
    if not found:
        # Another user's memory answers exactly like one that does not exist.
        raise NotFound("memory not found: check the id and the token's user", field="memory_id")
    return Response(status_code=204)
