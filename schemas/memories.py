"""Reading and forgetting a user's memories: shared by the gateway
(``/v1/memories``), the operators' CLI (``koda memories``) and the workers.

Every statement is scoped by the ``user_id`` its caller authenticated or was given.
Lists hold superseded memories too (``superseded_by`` names the newer statement that
replaced one; processors/memory/truth.py): kept for audit, never searched. Lists are
keyset pages, newest first: (created_at, id) descending, each page after the
position of the previous page's last memory, so a page never repeats or skips a
memory, whatever was forgotten meanwhile.
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
    subject: str | None = None
    superseded_by: str | None = None

    @property
    def position(self) -> tuple[datetime, str]:
        """Where the memory sits in a list: the key the next page starts after."""
        return self.created_at, self.id


_PAGE = text(
    """
    SELECT id, text, run_id, created_at, subject, superseded_by FROM memories
     WHERE user_id = :u
       AND (CAST(:after_id AS text) IS NULL
            OR (created_at, id) < (CAST(:after_at AS timestamptz), CAST(:after_id AS text)))
     ORDER BY created_at DESC, id DESC
     LIMIT :limit
    """
)
_FORGET_MANY = text(
    """
    DELETE FROM memories
     WHERE user_id = :u
       AND (CAST(:run_id AS text) IS NULL OR run_id = CAST(:run_id AS text))
       AND (CAST(:before AS timestamptz) IS NULL OR created_at < CAST(:before AS timestamptz))
    """
)


async def list_for(
    engine: AsyncEngine,
    user_id: str,
    limit: int = LIST_LIMIT,
    after: tuple[datetime, str] | None = None,
) -> list[Memory]:
    """Up to ``limit`` of the user's memories, newest first, after position ``after``."""
    params = {
        "u": user_id,
        "limit": limit,
        "after_at": None if after is None else after[0],
        "after_id": None if after is None else after[1],
    }
    async with engine.connect() as conn:
        rows = (await conn.execute(_PAGE, params)).all()
    return [Memory(r.id, r.text, r.run_id, r.created_at, r.subject, r.superseded_by) for r in rows]


async def forget(engine: AsyncEngine, user_id: str, memory_id: str) -> bool:
    """Delete one of the user's memories; False when the user has no such memory."""
    async with engine.begin() as conn:
        result = await conn.execute(
            text("DELETE FROM memories WHERE id = :id AND user_id = :u"),
            {"id": memory_id, "u": user_id},
        )
    return bool(result.rowcount)


async def forget_many(
    engine: AsyncEngine,
    user_id: str,
    *,
    run_id: str | None = None,
    before: datetime | None = None,
) -> int:
    """Delete the user's memories that match every filter given (none: all of them):
    those remembered from run ``run_id``, those created before ``before``. Returns how
    many were deleted."""
    async with engine.begin() as conn:
        result = await conn.execute(
            _FORGET_MANY, {"u": user_id, "run_id": run_id, "before": before}
        )
    return int(result.rowcount or 0)
