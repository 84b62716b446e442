"""A session's turns from Postgres: the one query a run's context is loaded with, and
the console's conversation view (rules in koda/lifecycle/turns.py).

A run's answer is its ``chunk`` messages after its last ``reset`` (what a viewer keeps),
as ``GET /v1/runs/{id}`` reads it; its answer tokens are the completion tokens the
ledger holds for the chat calls of its last attempt.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from koda_runtime.lifecycle.states import RunStatus
from koda_runtime.lifecycle.turns import Turn, turn_tokens, user_messages

# The newest earlier runs read for a context, at most: a session longer than this is
# cut at its oldest turns before the token budget is applied.
MAX_TURNS = 200

# A run's answer: its chunk messages after its last reset (the same rule in both).
# The session's runs before :run_id that are turns (done or cancelled: :statuses), the
# newest :limit of them, oldest first. The per-user order makes them all ended by then.
EARLIER_TURNS = text(
    """
    WITH me AS (SELECT id, session_id, user_id, created_at FROM runs WHERE id = :run_id),
    earlier AS (
        SELECT r.id, r.status, r.input, r.attempt, r.created_at
          FROM runs r JOIN me ON r.session_id = me.session_id AND r.user_id = me.user_id
         WHERE (r.created_at, r.id) < (me.created_at, me.id)
           AND r.status = ANY(CAST(:statuses AS text[]))
         ORDER BY r.created_at DESC, r.id DESC
         LIMIT :limit
    )
    SELECT e.id, e.status, e.input,
           COALESCE((SELECT string_agg(m.content, '' ORDER BY m.seq)
                       FROM messages m
                      WHERE m.run_id = e.id AND m.kind = 'chunk'
                        AND m.seq > COALESCE((SELECT max(x.seq) FROM messages x
                                               WHERE x.run_id = e.id AND x.kind = 'reset'),
                                             -1)), '') AS answer,
           COALESCE((SELECT sum(l.completion_tokens) FROM ledger l
                      WHERE l.run_id = e.id AND l.attempt = e.attempt AND l.kind = 'chat'),
                    0) AS answer_tokens
      FROM earlier e
     ORDER BY e.created_at, e.id
    """
)
TURN_STATUSES = [RunStatus.DONE.value, RunStatus.CANCELLED.value]

# Every run of a session (any status), the newest :limit, oldest first: the console.
SESSION_RUNS = text(
    """
    SELECT r.id, r.status, r.input, r.error, r.created_at, r.finished_at,
           COALESCE((SELECT string_agg(m.content, '' ORDER BY m.seq)
                       FROM messages m
                      WHERE m.run_id = r.id AND m.kind = 'chunk'
                        AND m.seq > COALESCE((SELECT max(x.seq) FROM messages x
                                               WHERE x.run_id = r.id AND x.kind = 'reset'),
                                             -1)), '') AS answer
      FROM (SELECT id, status, input, error, created_at, finished_at FROM runs
             WHERE session_id = :session_id AND user_id = :user_id
             ORDER BY created_at DESC, id DESC
             LIMIT :limit) r
     ORDER BY r.created_at, r.id
    """
)


def turn_of(row: Any) -> Turn:
    """A row of :data:`EARLIER_TURNS` as a turn, its tokens counted."""
    inp = row.input if isinstance(row.input, dict) else {}
    messages = tuple(user_messages(inp))
    cut = row.status == RunStatus.CANCELLED.value
    answer = str(row.answer or "")
    tokens = turn_tokens(messages, answer, cut, int(row.answer_tokens or 0))
    return Turn(row.id, messages, answer, cut, tokens)


async def earlier_turns(
    conn: AsyncConnection, run_id: str, limit: int = MAX_TURNS
) -> Sequence[Turn]:
    """The turns before ``run_id`` in its session, oldest first (one statement)."""
    rows = await conn.execute(
        EARLIER_TURNS, {"run_id": run_id, "limit": limit, "statuses": TURN_STATUSES}
    )
    return [turn_of(row) for row in rows]
