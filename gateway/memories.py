"""``/v1/memories``: the caller's own memories, a page at a time, and forgetting them.

* ``GET /v1/memories?limit=&cursor=``: newest first, ``limit`` (1..1000, default 100) a
  page, superseded memories included (``superseded_by`` set); ``next_cursor`` is the
  opaque cursor of the next page, null on the last one. The cursor is a keyset
  position (created_at, id), so paging while memories are forgotten neither repeats
  nor skips one.
* ``DELETE /v1/memories/{id}``: forget one (204; 404 for an unknown or another user's).
* ``DELETE /v1/memories?all=true`` or ``?run_id=&created_before=``: forget many, the
  caller's only; ``{"forgotten": n}``. Without ``all=true`` at least one filter is
  required, so a bare DELETE never wipes a user's memories by mistake.

A user keeps at most KODA_MAX_MEMORIES_PER_USER memories; the workers store no new
ones beyond it (processors/memory/store.py) until some are forgotten.
"""

from __future__ import annotations

import base64
import binascii
import re
from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Query, Response
from pydantic import BaseModel, Field

from koda_runtime.gateway.dependencies import Gateway, User
from koda_runtime.gateway.errors import BadRequest, NotFound
from koda_runtime.gateway.models import error_responses
from koda_runtime.schemas.memories import forget, forget_many, list_for

router = APIRouter()
# What processors/memory/store.py's memory_id makes; anything else is no memory.
_ID = re.compile(r"mem_[0-9a-f]{24}")
_RUN_ID_CHARS = 128
PAGE_DEFAULT = 100
PAGE_MAX = 1000


class MemoryOut(BaseModel):
    id: str
    text: str
    run_id: str | None
    created_at: datetime
    subject: str | None = Field(None, description="What the statement is about, if known.")
    superseded_by: str | None = Field(
        None,
        description="The newer memory that replaced this one (kept for audit, never "
        "searched); null for a current memory.",
    )


class MemoryList(BaseModel):
    memories: list[MemoryOut]
    next_cursor: str | None = Field(
        None, description="Pass as `cursor` for the next page; null on the last page."
    )


class Forgotten(BaseModel):
    forgotten: int = Field(description="How many memories were deleted.")


_ERRORS = error_responses(
    {
        400: "A bad cursor, or a bulk forget without all=true or a filter",
        401: "Missing or invalid bearer token",
        404: "No such memory of this user",
    }
)


def encode_cursor(position: tuple[datetime, str]) -> str:
    """The opaque cursor of a list position (created_at, id)."""
    at, memory_id = position
    raw = f"{at.isoformat()}|{memory_id}".encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[datetime, str]:
    """The position a cursor of :func:`encode_cursor` names; 400 for anything else."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        at, memory_id = raw.split("|", 1)
        position = datetime.fromisoformat(at), memory_id
    except (ValueError, binascii.Error, UnicodeDecodeError):
        position = None
    if position is None or position[0].tzinfo is None or not _ID.fullmatch(position[1]):
        raise BadRequest(
            "cursor is not one this API gave: pass next_cursor of the previous page, "
            "or omit it for the first page",
            field="cursor",
        )
    return position


@router.get(
    "/v1/memories",
    response_model=MemoryList,
    responses={k: _ERRORS[k] for k in (400, 401)},
    summary="The caller's long-term memories, newest first, a page at a time",
)
async def get_memories(
    gw: Gateway,
    user_id: User,
    limit: int = Query(PAGE_DEFAULT, ge=1, le=PAGE_MAX, description="At most this many."),
    cursor: str | None = Query(
        None, max_length=512, description="next_cursor of the previous page."
    ),
) -> MemoryList:
    after = None if cursor is None else decode_cursor(cursor)
    # One more than asked tells whether a next page exists.
    memories = await list_for(gw.engine, user_id, limit + 1, after)
    page = memories[:limit]
    more = len(memories) > limit
    return MemoryList(
        memories=[
            MemoryOut(
                id=m.id,
                text=m.text,
                run_id=m.run_id,
                created_at=m.created_at,
                subject=m.subject,
                superseded_by=m.superseded_by,
            )
            for m in page
        ],
        next_cursor=encode_cursor(page[-1].position) if more else None,
    )


@router.delete(
    "/v1/memories",
    response_model=Forgotten,
    responses={k: _ERRORS[k] for k in (400, 401)},
    summary="Forget many of the caller's memories: all=true, or by run_id / created_before",
)
async def delete_memories(
    gw: Gateway,
    user_id: User,
    forget_all: bool = Query(
        False, alias="all", description="true: forget every memory of the caller."
    ),
    run_id: str | None = Query(
        None, max_length=_RUN_ID_CHARS, description="Only those remembered from this run."
    ),
    created_before: Annotated[
        datetime | None,
        Query(description="Only those created before this time (ISO 8601 with an offset)."),
    ] = None,
) -> Forgotten:
    filtered = run_id is not None or created_before is not None
    if forget_all == filtered:
        raise BadRequest(
            "a bulk forget takes all=true (every memory) or a filter (run_id, "
            "created_before), not both and not neither",
            field="all",
        )
    if created_before is not None and created_before.tzinfo is None:
        raise BadRequest(
            "created_before needs a time zone offset, e.g. 2026-01-31T00:00:00Z",
            field="created_before",
        )
    if run_id is not None and "\x00" in run_id:
        return Forgotten(forgotten=0)
    n = await forget_many(gw.engine, user_id, run_id=run_id, before=created_before)
    return Forgotten(forgotten=n)


@router.delete(
    "/v1/memories/{memory_id}",
    status_code=204,
    responses={k: _ERRORS[k] for k in (401, 404)},
    summary="Forget one of the caller's memories",
)
async def delete_memory(memory_id: str, gw: Gateway, user_id: User) -> Response:
    found = _ID.fullmatch(memory_id) is not None and await forget(gw.engine, user_id, memory_id)
    if not found:
        # Another user's memory answers exactly like one that does not exist.
        raise NotFound("memory not found: check the id and the token's user", field="memory_id")
    return Response(status_code=204)
