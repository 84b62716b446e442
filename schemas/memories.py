"""Reading and forgetting a user's memories: shared by the gateway
(``/v1/memories``), the operators' CLI (``koda memories``) and the workers.

Every statement is scoped by the ``user_id`` its caller authenticated or was given.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

LIST_LIMIT = 1000


@dataclass(frozen=True)
class Memory:
    id: str
    text: str
    run_id: str | None
    created_at: datetime


async def list_for(engine: AsyncEngine, user_id: str, limit: int = LIST_LIMIT) -> list[Memory]:
    """The user's memories, newest first."""
    async with engine.connect() as conn:
        rows = (
            await conn.execute(
                text(
                    "SELECT id, text, run_id, created_at FROM memories WHERE user_id = :u"
                    " ORDER BY created_at DESC, id LIMIT :limit"
                ),
                {"u": user_id, "limit": limit},
            )
        ).all()
    return [Memory(r.id, r.text, r.run_id, r.created_at) for r in rows]


async def forget(engine: AsyncEngine, user_id: str, memory_id: str) -> bool:
    """Delete one of the user's memories; False when the user has no such memory."""
    async with engine.begin() as conn:
        result = await conn.execute(
            text("DELETE FROM memories WHERE id = :id AND user_id = :u"),
            {"id": memory_id, "u": user_id},
        )
    return bool(result.rowcount)
