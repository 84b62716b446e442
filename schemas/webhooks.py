"""Every SQL statement of webhooks (migration 0015): the gateway's ``/v1/webhooks`` and
the dispatcher (processors/webhooks.py) share them.

* A user's webhook receives every run of the user that ends after the webhook was
  created (``all_runs``), except the runs of a schedule that names a webhook: those go
  to that webhook alone. A webhook with ``all_runs`` false receives only the runs of
  the schedules that name it.
* :func:`create_deliveries` makes, in one statement, the deliveries of a set of ended
  runs: ``ON CONFLICT (webhook_id, run_id) DO NOTHING``, so a terminal record read
  again (a dispatcher restarted before its commit, a rebalance) adds nothing. The
  delivery id is derived from the webhook and the run, so it is the same whoever
  creates it.
* :func:`claim_due` takes due rows ``FOR UPDATE SKIP LOCKED`` and pushes their
  ``next_attempt_at`` past the request's timeout (a lease) under a fresh ``claim``
  token, in one short transaction: no other dispatcher takes them while the POST is
  in flight, and one killed mid-POST leaves them due again when the lease ends. The
  outcome is written only by the holder of the claim (:func:`finish_attempt`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from koda_runtime.errors import KodaError
from koda_runtime.lifecycle.chunks import visible_output
from koda_runtime.lifecycle.states import TERMINAL

MAX_WEBHOOKS_PER_USER = 20
DELIVERY_STATUSES = ("pending", "delivered", "failed")
_TERMINAL = sorted(s.value for s in TERMINAL)


@dataclass(frozen=True)
class Webhook:
    id: str
    user_id: str
    url: str
    description: str | None
    all_runs: bool
    created_at: datetime


@dataclass(frozen=True)
class Attempt:
    attempt: int
    started_at: datetime
    duration_ms: int
    status_code: int | None
    error: str | None


@dataclass(frozen=True)
class Delivery:
    id: str
    webhook_id: str
    run_id: str
    status: str
    attempts: int
    next_attempt_at: datetime | None
    last_status_code: int | None
    last_error: str | None
    created_at: datetime
    delivered_at: datetime | None
    tries: list[Attempt]


class TooManyWebhooks(KodaError):
    def __init__(self, count: int) -> None:
        super().__init__(count)
        self.count = count


_LIST = text(
    "SELECT id, user_id, url, description, all_runs, created_at FROM webhooks"
    " WHERE user_id = :u ORDER BY created_at, id"
)
_GET = text(
    "SELECT id, user_id, url, description, all_runs, created_at FROM webhooks"
    " WHERE id = :id AND user_id = :u"
)
_LOCK_USER = text(
    "SELECT pg_advisory_xact_lock(hashtextextended(current_schema() || '/webhooks/' || :u, 0))"
)


def _webhook(r: Any) -> Webhook:
    return Webhook(r.id, r.user_id, r.url, r.description, r.all_runs, r.created_at)


async def create_webhook(
    engine: AsyncEngine, values: dict[str, Any], *, max_per_user: int = MAX_WEBHOOKS_PER_USER
) -> Webhook:
    """Insert a webhook (``id, user_id, url, secret, description, all_runs``);
    TooManyWebhooks when the user has ``max_per_user`` already (counted under a per-user
    lock, so two creations at once cannot both pass the cap)."""
    async with engine.begin() as conn:
        await conn.execute(_LOCK_USER, {"u": values["user_id"]})
        count = (
            await conn.execute(
                text("SELECT count(*) FROM webhooks WHERE user_id = :u"), {"u": values["user_id"]}
            )
        ).scalar_one()
        if count >= max_per_user:
            raise TooManyWebhooks(count)
        row = (
            await conn.execute(
                text(
                    "INSERT INTO webhooks (id, user_id, url, secret, description, all_runs)"
                    " VALUES (:id, :user_id, :url, :secret, :description, :all_runs)"
                    " RETURNING id, user_id, url, description, all_runs, created_at"
                ),
                values,
            )
        ).one()
    return _webhook(row)


async def list_webhooks(engine: AsyncEngine, user_id: str) -> list[Webhook]:
    async with engine.connect() as conn:
        rows = await conn.execute(
            _LIST,
            {"u": user_id},
        )
        return [_webhook(r) for r in rows]


async def get_webhook(engine: AsyncEngine, webhook_id: str, user_id: str) -> Webhook | None:
    async with engine.connect() as conn:
        row = (
            await conn.execute(
                _GET,
                {"id": webhook_id, "u": user_id},
            )
        ).first()
    return None if row is None else _webhook(row)


async def delete_webhook(engine: AsyncEngine, webhook_id: str, user_id: str) -> bool:
    """Delete the user's webhook with its deliveries; schedules naming it fall back to
    the owner's other webhooks. False when the user has no such webhook."""
    async with engine.begin() as conn:
        result = await conn.execute(
            text("DELETE FROM webhooks WHERE id = :id AND user_id = :u"),
            {"id": webhook_id, "u": user_id},
        )
    return bool(result.rowcount)


async def schedule_webhooks(engine: AsyncEngine, schedule_ids: Sequence[str]) -> dict[str, str]:
    """``schedule id -> webhook id`` of those of ``schedule_ids`` that name one."""
    async with engine.connect() as conn:
        rows = await conn.execute(
            text(
                "SELECT id, webhook_id FROM schedules"
                " WHERE id = ANY(:ids) AND webhook_id IS NOT NULL"
            ),
            {"ids": list(schedule_ids)},
        )
        return {r.id: r.webhook_id for r in rows}


async def set_schedule_webhook(
    engine: AsyncEngine, schedule_id: str, user_id: str, webhook_id: str | None
) -> bool:
    """Point the user's schedule at the user's webhook (None: the owner's); False when
    the webhook is not the user's (nothing changes then)."""
    async with engine.begin() as conn:
        result = await conn.execute(
            text(
                "UPDATE schedules SET webhook_id = CAST(:w AS text), updated_at = now()"
                " WHERE id = :s AND user_id = :u AND (CAST(:w AS text) IS NULL OR EXISTS"
                " (SELECT 1 FROM webhooks WHERE id = CAST(:w AS text) AND user_id = :u))"
            ),
            {"s": schedule_id, "u": user_id, "w": webhook_id},
        )
    return bool(result.rowcount)


_DELIVERIES = text(
    """
    SELECT id, webhook_id, run_id, status, attempts, next_attempt_at, last_status_code,
           last_error, created_at, delivered_at
      FROM webhook_deliveries
     WHERE webhook_id = :w AND user_id = :u
       AND (CAST(:status AS text) IS NULL OR status = CAST(:status AS text))
     ORDER BY created_at DESC, id DESC
     LIMIT :limit
    """
)
_ATTEMPTS = text(
    """
    SELECT delivery_id, attempt, started_at, duration_ms, status_code, error
      FROM webhook_attempts WHERE delivery_id = ANY(:ids) ORDER BY delivery_id, attempt, id
    """
)


async def list_deliveries(
    engine: AsyncEngine, webhook_id: str, user_id: str, *, limit: int, status: str | None
) -> list[Delivery]:
    """The webhook's newest ``limit`` deliveries (the user's only), each with its attempts."""
    async with engine.connect() as conn:
        rows = (
            await conn.execute(
                _DELIVERIES, {"w": webhook_id, "u": user_id, "limit": limit, "status": status}
            )
        ).all()
        ids = [r.id for r in rows]
        tries: dict[str, list[Attempt]] = {i: [] for i in ids}
        if ids:
            for a in await conn.execute(_ATTEMPTS, {"ids": ids}):
                tries[a.delivery_id].append(
                    Attempt(a.attempt, a.started_at, a.duration_ms, a.status_code, a.error)
                )
    return [
        Delivery(
            r.id,
            r.webhook_id,
            r.run_id,
            r.status,
            r.attempts,
            r.next_attempt_at,
            r.last_status_code,
            r.last_error,
            r.created_at,
            r.delivered_at,
            tries[r.id],
        )
        for r in rows
    ]


# --- the dispatcher -------------------------------------------------------------------

_CREATE = text(
    """
    INSERT INTO webhook_deliveries (id, webhook_id, run_id, user_id, next_attempt_at)
    SELECT 'msg_' || substr(md5(w.id || ':' || r.id), 1, 26), w.id, r.id, r.user_id, now()
      FROM runs r
      LEFT JOIN schedules s ON s.id = r.schedule_id
      JOIN webhooks w ON w.user_id = r.user_id
       AND CASE WHEN s.webhook_id IS NOT NULL THEN w.id = s.webhook_id ELSE w.all_runs END
     WHERE r.id = ANY(:ids) AND r.status = ANY(:terminal)
       AND r.finished_at >= w.created_at
    ON CONFLICT (webhook_id, run_id) DO NOTHING
    """
)


async def create_deliveries(conn: AsyncConnection, run_ids: Sequence[str]) -> int:
    """The deliveries of these ended runs that do not exist yet; how many were made."""
    if not run_ids:
        return 0
    result = await conn.execute(_CREATE, {"ids": list(run_ids), "terminal": _TERMINAL})
    return int(result.rowcount or 0)


@dataclass(frozen=True)
class Claimed:
    id: str
    webhook_id: str
    run_id: str
    attempt: int
    created_at: datetime


_CLAIM = text(
    """
    WITH due AS (
        SELECT id FROM webhook_deliveries
         WHERE status = 'pending' AND next_attempt_at <= now()
           AND NOT (webhook_id = ANY(:busy))
         ORDER BY next_attempt_at
         LIMIT :limit
           FOR UPDATE SKIP LOCKED
    )
    UPDATE webhook_deliveries d
       SET next_attempt_at = now() + make_interval(secs => :lease),
           attempts = d.attempts + 1, claim = :claim
      FROM due WHERE d.id = due.id
    RETURNING d.id, d.webhook_id, d.run_id, d.attempts, d.created_at
    """
)


async def claim_due(
    engine: AsyncEngine, limit: int, busy: Sequence[str], lease_s: float, claim: str
) -> list[Claimed]:
    """Up to ``limit`` due deliveries of webhooks not in ``busy``, leased for ``lease_s``."""
    async with engine.begin() as conn:
        rows = await conn.execute(
            _CLAIM, {"limit": limit, "busy": list(busy), "lease": lease_s, "claim": claim}
        )
        return [Claimed(r.id, r.webhook_id, r.run_id, r.attempts, r.created_at) for r in rows]


_RELEASE = text(
    """
    UPDATE webhook_deliveries SET next_attempt_at = now(), claim = NULL,
           attempts = attempts - 1
     WHERE id = ANY(:ids) AND claim = :claim
    """
)


async def release_claims(engine: AsyncEngine, ids: Sequence[str], claim: str) -> None:
    """Give claimed rows back unsent: due at once, their attempt not counted."""
    async with engine.begin() as conn:
        await conn.execute(_RELEASE, {"ids": list(ids), "claim": claim})


@dataclass(frozen=True)
class Outgoing:
    """What one attempt sends: where, signed with what, and the run's facts."""

    url: str
    secret: str
    run: dict[str, Any]


_OUTGOING = text(
    """
    SELECT w.url, w.secret, r.id AS run_id, r.user_id, r.session_id, r.status, r.error,
           r.schedule_id, r.scheduled_for, r.finished_at,
           (SELECT sum(l.cost_usd) FROM ledger l WHERE l.run_id = r.id) AS cost_usd
      FROM webhooks w, runs r
     WHERE w.id = :w AND r.id = :r
    """
)
_MESSAGES = text("SELECT seq, kind, content FROM messages WHERE run_id = :r")


async def outgoing(engine: AsyncEngine, webhook_id: str, run_id: str) -> Outgoing | None:
    """The webhook's URL and secret and the run's facts and output; None when either
    is gone (deleted since the delivery was made: the rows cascade anyway)."""
    async with engine.connect() as conn:
        row = (await conn.execute(_OUTGOING, {"w": webhook_id, "r": run_id})).first()
        if row is None:
            return None
        messages = (await conn.execute(_MESSAGES, {"r": run_id})).all()
    cost: Decimal | None = row.cost_usd
    run = {
        "run_id": row.run_id,
        "user_id": row.user_id,
        "session_id": row.session_id,
        "status": row.status,
        "output": visible_output((m.seq, m.kind, m.content) for m in messages),
        "error": row.error,
        "cost_usd": None if cost is None else str(cost),
        "schedule_id": row.schedule_id,
        "scheduled_for": None if row.scheduled_for is None else row.scheduled_for.isoformat(),
        "finished_at": None if row.finished_at is None else row.finished_at.isoformat(),
    }
    return Outgoing(row.url, row.secret, run)


_ATTEMPT = text(
    """
    INSERT INTO webhook_attempts (delivery_id, attempt, started_at, duration_ms, status_code,
                                  error)
    SELECT :id, :attempt, :started_at, :duration_ms, :status_code, :error
     WHERE EXISTS (SELECT 1 FROM webhook_deliveries WHERE id = :id AND claim = :claim)
    """
)
_FINISH = text(
    """
    UPDATE webhook_deliveries
       SET status = :status, next_attempt_at = CASE WHEN :status = 'pending'
               THEN now() + make_interval(secs => :retry_in) END,
           claim = NULL, last_status_code = :status_code, last_error = :error,
           delivered_at = CASE WHEN :status = 'delivered' THEN now() END
     WHERE id = :id AND claim = :claim
    """
)


async def finish_attempt(
    engine: AsyncEngine,
    claimed: Claimed,
    claim: str,
    *,
    started_at: datetime,
    duration_ms: int,
    status_code: int | None,
    error: str | None,
    status: str,
    retry_in_s: float,
) -> bool:
    """Record the attempt and the delivery's new state, if ``claim`` still holds it
    (False: the lease ran out and another dispatcher took it; nothing written)."""
    params = {
        "id": claimed.id,
        "claim": claim,
        "attempt": claimed.attempt,
        "started_at": started_at,
        "duration_ms": duration_ms,
        "status_code": status_code,
        "error": error,
        "status": status,
        "retry_in": retry_in_s,
    }
    async with engine.begin() as conn:
        await conn.execute(_ATTEMPT, params)
        result = await conn.execute(_FINISH, params)
    return bool(result.rowcount)


async def oldest_pending_age_s(engine: AsyncEngine) -> float:
    """Seconds since the oldest pending delivery was made (0 without any)."""
    async with engine.connect() as conn:
        value = (
            await conn.execute(
                text(
                    "SELECT EXTRACT(EPOCH FROM now() - min(created_at)) FROM webhook_deliveries"
                    " WHERE status = 'pending'"
                )
            )
        ).scalar_one()
    return 0.0 if value is None else float(value)
