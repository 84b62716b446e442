"""Who was erased, without keeping who: the digests and pseudonyms of per-user erasure,
and every statement of an erasure.

An erasure (gateway/erasure.py, ``koda users erase``) deletes a user's rows and records
a receipt in ``erasures`` (migration 0013) that names the user only by
:func:`user_digest`, the SHA-256 of the user id. Whoever still holds the id (a record on
a topic, a warehouse replayed from the topics) can recompute the digest and tell that
its user was erased; the receipt alone does not give the id back.

:func:`pseudonym` is what the ledger keeps in place of an erased user's id: stable (the
same user always gets the same one, so finance can still sum an erased user's spend,
and a second erasure of the same user changes nothing), and never a valid user id (it
holds a ``:``). It is a pseudonym, not anonymity: anyone who knows a user id can
recompute it.

The erasure's statements (its steps and their order are gateway/erasure.py's) each run
in a short transaction of their own; a failure is a DatabaseError naming the step.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, TextClause, text
from sqlalchemy.engine import RowMapping
from sqlalchemy.ext.asyncio import AsyncEngine

from koda_runtime.lifecycle.states import TERMINAL
from koda_runtime.schemas.db import failing_as

PSEUDONYM_PREFIX = "erased:"
# Keeps the pseudonym apart from the digest: a ledger export does not hand out the
# digest a replay filters on.
_PSEUDONYM_DOMAIN = b"koda.erasure.pseudonym\x00"
_DIGESTS = text("SELECT DISTINCT user_digest FROM erasures")
# The runs of the ledger rows kept under an erasure's pseudonym.
_LEDGER_RUNS = text(
    "SELECT DISTINCT l.run_id FROM ledger l JOIN erasures e ON e.pseudonym = l.user_id"
)


def user_digest(user_id: str) -> str:
    """The SHA-256 of ``user_id`` (UTF-8), 64 lowercase hex digits. Never raises: a lone
    surrogate (only a forged record's id can hold one) is encoded as it stands."""
    return hashlib.sha256(_utf8(user_id)).hexdigest()


def pseudonym(user_id: str) -> str:
    """The id the ledger keeps for the erased ``user_id``: ``erased:`` + 16 hex digits."""
    digest = hashlib.sha256(_PSEUDONYM_DOMAIN + _utf8(user_id)).hexdigest()
    return PSEUDONYM_PREFIX + digest[:16]


def erased_digests(conn: Connection) -> set[str]:
    """The :func:`user_digest` of every user an erasure was recorded for (receipts of
    erasures still under way included: their deletions have begun)."""
    return {str(row[0]) for row in conn.execute(_DIGESTS)}


def erased_ledger_runs(conn: Connection) -> set[str]:
    """The runs of the ledger rows kept under an erasure's pseudonym."""
    return {str(r) for (r,) in conn.execute(_LEDGER_RUNS)}


def _utf8(user_id: str) -> bytes:
    return user_id.encode("utf-8", "surrogatepass")


# -- an erasure's statements (gateway/erasure.py) ---------------------------------------

_TERMINAL = sorted(s.value for s in TERMINAL)

_UNSETTLED = text(
    """
    SELECT id, status, cancel_requested_at FROM runs
     WHERE user_id = :u
       AND NOT (status = ANY(:terminal)
                AND (published_seq IS NOT NULL OR compacted_at IS NOT NULL))
     ORDER BY created_at, id
    """
)
# A run ended over ``grace`` seconds ago whose mark is still missing (the worker's mark
# skips a row another transaction holds; the completeness pass sets it much later):
# its finishing worker's records are on the topic or lost by now, so the erasure marks
# it itself and no republish path produces it after the tombstones.
_ADOPT = text(
    """
    UPDATE runs r SET published_seq = COALESCE(
               (SELECT max(m.seq) FROM messages m WHERE m.run_id = r.id), -1)
     WHERE r.user_id = :u AND r.status = ANY(:terminal)
       AND r.published_seq IS NULL AND r.compacted_at IS NULL
       AND r.finished_at <= now() - make_interval(secs => :grace)
    """
)
_SETTLED_BATCH = text(
    """
    SELECT id, partition, compacted_at FROM runs
     WHERE user_id = :u AND status = ANY(:terminal)
       AND (published_seq IS NOT NULL OR compacted_at IS NOT NULL)
     ORDER BY id
     LIMIT :batch
       FOR UPDATE
    """
)
_LAST_SEQS = text(
    "SELECT run_id, max(seq) AS last FROM messages WHERE run_id = ANY(:ids) GROUP BY run_id"
)
_DELETE_BY_RUN = {
    "messages": text("DELETE FROM messages WHERE run_id = ANY(:ids)"),
    "usage": text("DELETE FROM usage WHERE run_id = ANY(:ids)"),
    "run_merges": text("DELETE FROM run_merges WHERE run_id = ANY(:ids)"),
    "runs": text("DELETE FROM runs WHERE id = ANY(:ids)"),
}
_RUNS_LEFT = text("SELECT count(*) FROM runs WHERE user_id = :u")
_DELETE_SCHEDULES = text("DELETE FROM schedules WHERE user_id = :u")
# A session still named by a run or a schedule (admitted meanwhile) is left for the
# next round.
_DELETE_SESSIONS = text(
    """
    DELETE FROM sessions s WHERE s.user_id = :u
       AND NOT EXISTS (SELECT 1 FROM runs r WHERE r.session_id = s.id)
       AND NOT EXISTS (SELECT 1 FROM schedules c WHERE c.session_id = s.id)
    """
)
_SESSIONS_LEFT = text("SELECT count(*) FROM sessions WHERE user_id = :u")
_DELETE_BY_USER = {
    # A delivery's attempts go with it (ON DELETE CASCADE); deliveries of the user's
    # runs went with the runs already.
    "webhook_deliveries": text("DELETE FROM webhook_deliveries WHERE user_id = :u"),
    "webhooks": text("DELETE FROM webhooks WHERE user_id = :u"),
    "memories": text("DELETE FROM memories WHERE user_id = :u"),
    "budgets": text("DELETE FROM budgets WHERE user_id = :u"),
    "spend_periods": text("DELETE FROM spend_periods WHERE user_id = :u"),
}
_PSEUDONYMIZE = text(
    """
    UPDATE ledger SET user_id = :p
     WHERE id IN (SELECT id FROM ledger WHERE user_id = :u LIMIT :batch)
    """
)
_RECEIPT = text(
    """
    INSERT INTO erasures (id, user_digest, pseudonym, requested_at, requested_by)
    VALUES (:id, :digest, :pseudonym, :requested_at, :by)
    RETURNING requested_at
    """
)
_COMPLETE = text(
    """
    UPDATE erasures SET completed_at = now(), counts = CAST(:counts AS jsonb)
     WHERE id = :id
    RETURNING completed_at
    """
)

# ``(runs, last)``: the locked batch of runs (``id``, ``partition``, ``compacted_at``)
# and the last message seq of each run that has one; produces their tombstones.
Tombstone = Callable[[Sequence[Any], dict[str, int]], Awaitable[None]]


async def _execute(engine: AsyncEngine, statement: TextClause, params: dict[str, Any]) -> int:
    """One statement in a transaction of its own; the rows it changed."""
    with failing_as("erasing a user's rows"):
        async with engine.begin() as conn:
            return int((await conn.execute(statement, params)).rowcount)


async def unsettled_runs(engine: AsyncEngine, user_id: str) -> list[RowMapping]:
    """The user's runs (``id``, ``status``, ``cancel_requested_at``) not settled yet:
    not terminal, or terminal with an output not known to be whole on the chunk topic
    (neither ``published_seq`` nor ``compacted_at``), oldest first."""
    with failing_as("reading a user's runs"):
        async with engine.connect() as conn:
            params = {"u": user_id, "terminal": _TERMINAL}
            return list((await conn.execute(_UNSETTLED, params)).mappings().all())


async def mark_ended_runs_whole(engine: AsyncEngine, user_id: str, *, grace_s: float) -> int:
    """Mark whole the user's runs that ended over ``grace_s`` ago and are still
    unmarked; how many."""
    params = {"u": user_id, "terminal": _TERMINAL, "grace": grace_s}
    return await _execute(engine, _ADOPT, params)


async def delete_schedules(engine: AsyncEngine, user_id: str) -> int:
    return await _execute(engine, _DELETE_SCHEDULES, {"u": user_id})


async def delete_sessions(engine: AsyncEngine, user_id: str) -> int:
    """The user's sessions no run or schedule names; how many were deleted."""
    return await _execute(engine, _DELETE_SESSIONS, {"u": user_id})


async def open_receipt(
    engine: AsyncEngine,
    receipt_id: str,
    user_id: str,
    *,
    requested_at: datetime,
    requested_by: str,
) -> None:
    """Record an erasure of ``user_id`` under way (the user only as its digest)."""
    params = {
        "id": receipt_id,
        "digest": user_digest(user_id),
        "pseudonym": pseudonym(user_id),
        "requested_at": requested_at,
        "by": requested_by,
    }
    with failing_as("recording an erasure receipt"):
        async with engine.begin() as conn:
            await conn.execute(_RECEIPT, params)


async def complete_receipt(
    engine: AsyncEngine, receipt_id: str, counts: dict[str, int]
) -> datetime:
    """The erasure is done: its counts per store and ``completed_at`` (returned)."""
    with failing_as("completing an erasure receipt"):
        async with engine.begin() as conn:
            params = {"id": receipt_id, "counts": json.dumps(counts)}
            row = (await conn.execute(_COMPLETE, params)).one()
    completed: datetime = row.completed_at
    return completed


async def delete_settled_runs(
    engine: AsyncEngine, user_id: str, *, batch: int, tombstone: Tombstone
) -> dict[str, int] | None:
    """Lock at most ``batch`` of the user's settled runs, await ``tombstone`` for them,
    then delete their messages, usage, merges and rows in the same transaction: the
    rows deleted per table; None when no settled run was left. A ``tombstone`` that
    raises deletes nothing."""
    with failing_as("deleting a user's runs"):
        async with engine.begin() as conn:
            params = {"u": user_id, "terminal": _TERMINAL, "batch": batch}
            runs = (await conn.execute(_SETTLED_BATCH, params)).all()
            if not runs:
                return None
            ids = [r.id for r in runs]
            last = {
                r.run_id: int(r.last) for r in (await conn.execute(_LAST_SEQS, {"ids": ids})).all()
            }
            await tombstone(runs, last)
            return {
                store: int((await conn.execute(statement, {"ids": ids})).rowcount)
                for store, statement in _DELETE_BY_RUN.items()
            }


async def rows_left(engine: AsyncEngine, user_id: str) -> bool:
    """Whether runs or sessions of the user are there (admitted while it was erased)."""
    with failing_as("reading a user's rows"):
        async with engine.connect() as conn:
            runs = (await conn.execute(_RUNS_LEFT, {"u": user_id})).scalar_one()
            sessions = (await conn.execute(_SESSIONS_LEFT, {"u": user_id})).scalar_one()
    return bool(runs or sessions)


async def delete_user_rows(engine: AsyncEngine, user_id: str) -> dict[str, int]:
    """The user's webhooks and deliveries, memories, budgets and period spend, each
    table in a transaction of its own; the rows deleted per table."""
    return {
        store: await _execute(engine, statement, {"u": user_id})
        for store, statement in _DELETE_BY_USER.items()
    }


async def pseudonymize_ledger(engine: AsyncEngine, user_id: str, *, batch: int) -> int:
    """At most ``batch`` of the user's ledger rows take the user's pseudonym; how many."""
    params = {"u": user_id, "p": pseudonym(user_id), "batch": batch}
    return await _execute(engine, _PSEUDONYMIZE, params)
