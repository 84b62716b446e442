"""``GET /v1/memories`` (the caller's own) and ``DELETE /v1/memories/{id}`` (forget)."""

from __future__ import annotations

import re
from datetime import datetime

from fastapi import APIRouter, Response
from pydantic import BaseModel

from koda_runtime.gateway.dependencies import Gateway, User
from koda_runtime.gateway.errors import NotFound
from koda_runtime.gateway.models import error_responses
from koda_runtime.schemas.memories import forget, list_for

router = APIRouter()
# What processors/memory/store.py's memory_id makes; anything else is no memory.
_ID = re.compile(r"mem_[0-9a-f]{24}")


class MemoryOut(BaseModel):
    id: str
    text: str
    run_id: str | None
    created_at: datetime


class MemoryList(BaseModel):
    memories: list[MemoryOut]


_ERRORS = error_responses(
    {401: "Missing or invalid bearer token", 404: "No such memory of this user"}
)


@router.get(
    "/v1/memories",
    response_model=MemoryList,
    responses={401: _ERRORS[401]},
    summary="The caller's long-term memories, newest first",
)
async def get_memories(gw: Gateway, user_id: User) -> MemoryList:
    memories = await list_for(gw.engine, user_id)
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
    summary="Forget one of the caller's memories",
)
async def delete_memory(memory_id: str, gw: Gateway, user_id: User) -> Response:
    found = _ID.fullmatch(memory_id) is not None and await forget(gw.engine, user_id, memory_id)
    if not found:
        # Another user's memory answers exactly like one that does not exist.
        raise NotFound("memory not found: check the id and the token's user", field="memory_id")
    return Response(status_code=204)
