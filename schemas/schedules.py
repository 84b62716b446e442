"""Schedules in Postgres: every read and write of the ``schedules`` table.

:class:`ScheduleStore` is shared by the HTTP routes (gateway/schedules.py), ``koda
schedules`` and ``koda scheduler``, and reads what the scheduler plans with (its owners'
scheduled runs per day, a schedule's latest run, spent budgets). A fired minute becomes a
run through admission's one insert (schemas/runs/admission.py) under the idempotency key
:func:`fire_key`; topics/scheduled.py fires and publishes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Connection, func, select, text
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncEngine

from koda_runtime.caps import SCHEDULES, CapReached
from koda_runtime.errors import SessionNotOwned
from koda_runtime.lifecycle.states import TERMINAL
from koda_runtime.scheduling import CronSpec, Overlap, Policy, QuietHours
from koda_runtime.schemas import ledger
from koda_runtime.schemas.db import failing_as
from koda_runtime.schemas.tables import schedules, sessions

_COLUMNS = (
    "id",
    "user_id",
    "session_id",
    "cron",
    "timezone",
    "input",
    "enabled",
    "quiet_start",
    "quiet_end",
    "daily_cap",
    "overlap",
    "catchup_s",
    "next_fire_at",
    "last_fire_at",
    "created_at",
)
_SELECTED = [schedules.c[name] for name in _COLUMNS]


def fire_key(schedule_id: str, minute: datetime) -> str:
    """The idempotency key of a scheduled minute: ``sched:<id>:<YYYY-MM-DDTHH:MMZ>``."""
    return f"sched:{schedule_id}:{minute.astimezone(UTC).strftime('%Y-%m-%dT%H:%MZ')}"


@dataclass(frozen=True)
class ScheduleRow:
    """One ``schedules`` row."""

    id: str
    user_id: str
    session_id: str | None
    cron: str
    timezone: str
    input: dict[str, Any]
    enabled: bool
    quiet_start: int | None
    quiet_end: int | None
    daily_cap: int
    overlap: str
    catchup_s: int
    next_fire_at: datetime | None
    last_fire_at: datetime | None
    created_at: datetime

    @property
    def spec(self) -> CronSpec:
        return CronSpec.parse(self.cron, self.timezone)

    @property
    def quiet_hours(self) -> QuietHours | None:
        if self.quiet_start is None or self.quiet_end is None:
            return None
        return QuietHours(self.quiet_start, self.quiet_end)

    @property
    def policy(self) -> Policy:
        return Policy(
            enabled=self.enabled,
            quiet_hours=self.quiet_hours,
            daily_cap=self.daily_cap,
            overlap=Overlap(self.overlap),
            catchup_s=self.catchup_s,
        )


def _row(r: Any) -> ScheduleRow:
    return ScheduleRow(**{k: getattr(r, k) for k in ScheduleRow.__dataclass_fields__})


_COUNTS = text(
    """
    SELECT q.i, (SELECT count(*) FROM runs r
                  WHERE r.user_id = q.u AND r.schedule_id IS NOT NULL
                    AND r.scheduled_for >= q.s AND r.scheduled_for < q.e) AS n
      FROM unnest(CAST(:users AS text[]), CAST(:starts AS timestamptz[]),
                  CAST(:ends AS timestamptz[])) WITH ORDINALITY AS q(u, s, e, i)
    """
)
_LATEST = text(
    """
    SELECT q.i, (SELECT r.status FROM runs r
                  WHERE r.schedule_id = q.id AND r.scheduled_for < q.b
                  ORDER BY r.scheduled_for DESC LIMIT 1) AS status
      FROM unnest(CAST(:ids AS text[]), CAST(:befores AS timestamptz[]))
           WITH ORDINALITY AS q(id, b, i)
    """
)
# Creations of one user's schedules take turns, so two at once cannot both pass the cap.
_LOCK_OWNER = text(
    "SELECT pg_advisory_xact_lock(hashtextextended(current_schema() || '/schedules/' || :u, 0))"
)
_OWNED_COUNT = text("SELECT count(*) FROM schedules WHERE user_id = :u")
_ADVANCE_MANY = text(
    """
    UPDATE schedules s
       SET next_fire_at = q.n, last_fire_at = COALESCE(q.l, s.last_fire_at), updated_at = now()
      FROM unnest(CAST(:ids AS text[]), CAST(:expected AS timestamptz[]),
                  CAST(:nexts AS timestamptz[]), CAST(:lasts AS timestamptz[])) AS q(id, e, n, l)
     WHERE s.id = q.id AND s.next_fire_at = q.e
    RETURNING s.id
    """
)


@dataclass(frozen=True)
class Advance:
    """Move ``schedule_id``'s next fire from ``expected`` to ``next_fire_at``."""

    schedule_id: str
    expected: datetime
    next_fire_at: datetime | None
    last_fire_at: datetime | None


class ScheduleStore:
    """Every read and write of ``schedules``; owner-scoped where a user asks."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    async def _fetch(self, sql: Any, params: dict[str, Any]) -> list[Any]:
        with failing_as("a schedules query"):
            async with self.engine.begin() as conn:
                return list((await conn.execute(sql, params)).all())

    async def now(self) -> datetime:
        """Postgres's clock: every scheduler replica reads the same one."""
        rows = await self._fetch(select(func.now().label("now")), {})
        now: datetime = rows[0].now
        return now

    async def create(self, values: dict[str, Any], *, max_per_user: int = 0) -> ScheduleRow:
        """Insert a schedule; a fixed session must be the owner's (else SessionNotOwned).

        With ``max_per_user`` (0: no cap) an owner who has that many schedules gets
        CapReached instead; the count is made under a per-owner lock."""
        with failing_as("creating a schedule"):
            async with self.engine.begin() as conn:
                if max_per_user:
                    owner_id = values["user_id"]
                    await conn.execute(_LOCK_OWNER, {"u": owner_id})
                    owned = int((await conn.execute(_OWNED_COUNT, {"u": owner_id})).scalar_one())
                    if owned >= max_per_user:
                        raise CapReached(
                            "schedules",
                            SCHEDULES,
                            max_per_user,
                            owned,
                            f"you have {owned} schedules and {SCHEDULES}={max_per_user} "
                            "allows no more: delete one first",
                        )
                if values.get("session_id") is not None:
                    await conn.execute(
                        pg_insert(sessions)
                        .values(id=values["session_id"], user_id=values["user_id"])
                        .on_conflict_do_nothing(index_elements=[sessions.c.id])
                    )
                    owner = (
                        await conn.execute(
                            select(sessions.c.user_id).where(sessions.c.id == values["session_id"])
                        )
                    ).scalar_one()
                    if owner != values["user_id"]:
                        raise SessionNotOwned(
                            "session not found: omit session_id for a new session per fire"
                        )
                row = (
                    await conn.execute(schedules.insert().values(**values).returning(*_SELECTED))
                ).one()
        return _row(row)

    def _owned(self, schedule_id: str, user_id: str) -> Any:
        return (schedules.c.id == schedule_id) & (schedules.c.user_id == user_id)

    async def get(self, schedule_id: str, user_id: str) -> ScheduleRow | None:
        rows = await self._fetch(select(*_SELECTED).where(self._owned(schedule_id, user_id)), {})
        return _row(rows[0]) if rows else None

    async def owned(self, user_id: str, limit: int) -> list[ScheduleRow]:
        rows = await self._fetch(
            select(*_SELECTED)
            .where(schedules.c.user_id == user_id)
            .order_by(schedules.c.created_at, schedules.c.id)
            .limit(limit),
            {},
        )
        return [_row(r) for r in rows]

    async def update(
        self, schedule_id: str, user_id: str, changes: dict[str, Any]
    ) -> ScheduleRow | None:
        """Set ``changes`` (column -> value) on the owner's schedule; None if not theirs."""
        rows = await self._fetch(
            schedules.update()
            .where(self._owned(schedule_id, user_id))
            .values(**changes, updated_at=func.now())
            .returning(*_SELECTED),
            {},
        )
        return _row(rows[0]) if rows else None

    async def delete(self, schedule_id: str, user_id: str) -> bool:
        rows = await self._fetch(
            schedules.delete().where(self._owned(schedule_id, user_id)).returning(schedules.c.id),
            {},
        )
        return bool(rows)

    async def due(self, limit: int, salt: str) -> tuple[datetime, list[ScheduleRow]]:
        """Postgres's now and up to ``limit`` schedules whose next fire is not after it.

        Each replica walks the due rows in its own order (``salt``), so two schedulers
        mostly work on different schedules; correctness never depends on it."""
        rows = await self._fetch(
            select(func.now().label("db_now"), *_SELECTED)
            .where(schedules.c.next_fire_at <= func.now())
            .order_by(func.md5(schedules.c.id.concat(salt)))
            .limit(limit),
            {},
        )
        if not rows:
            return await self.now(), []
        return rows[0].db_now, [_row(r) for r in rows]

    async def scheduled_counts(self, spans: list[tuple[str, datetime, datetime]]) -> list[int]:
        """For each (user, start, end): the user's scheduled runs with a minute in [start, end)."""
        if not spans:
            return []
        rows = await self._fetch(
            _COUNTS,
            {
                "users": [u for u, _, _ in spans],
                "starts": [a for _, a, _ in spans],
                "ends": [b for _, _, b in spans],
            },
        )
        by_index = {int(r.i): int(r.n) for r in rows}
        return [by_index[i + 1] for i in range(len(spans))]

    async def over_budget(self, users: list[str]) -> set[str]:
        """Those of ``users`` whose cost budget is spent (their fires are skipped)."""
        with failing_as("a schedules query"):
            async with self.engine.connect() as conn:
                return await ledger.spent_users(conn, users)

    async def latest_active(self, items: list[tuple[str, datetime]]) -> list[bool]:
        """For each (schedule, before): its latest run before that minute is not terminal."""
        if not items:
            return []
        rows = await self._fetch(
            _LATEST, {"ids": [i for i, _ in items], "befores": [b for _, b in items]}
        )
        by_index = {int(r.i): r.status for r in rows}
        return [
            (status := by_index[i + 1]) is not None and status not in TERMINAL
            for i in range(len(items))
        ]

    async def advance_many(self, moves: list[Advance]) -> set[str]:
        """Apply every move whose ``expected`` still holds; the ids of those applied."""
        if not moves:
            return set()
        rows = await self._fetch(
            _ADVANCE_MANY,
            {
                "ids": [m.schedule_id for m in moves],
                "expected": [m.expected for m in moves],
                "nexts": [m.next_fire_at for m in moves],
                "lasts": [m.last_fire_at for m in moves],
            },
        )
        return {r.id for r in rows}


# -- the replay's export (topics/replay/export.py) ----------------------------------

_EXPORT = text(
    """
    SELECT id, user_id, session_id, cron, timezone, input::text AS input, enabled,
           quiet_start, quiet_end, daily_cap, overlap, catchup_s, next_fire_at,
           last_fire_at, created_at, updated_at
      FROM schedules
     WHERE id > :after
       AND (CAST(:since AS timestamptz) IS NULL
            OR updated_at >= CAST(:since AS timestamptz))
     ORDER BY id LIMIT :n
    """
)


def export_page(
    conn: Connection, *, after: str, since: datetime | None, limit: int
) -> Sequence[Any]:
    """Schedules by id after ``after``, updated at or after ``since`` (None: all), at
    most ``limit``; the columns in the order of the replay's ``schedules`` table."""
    return conn.execute(_EXPORT, {"after": after, "since": since, "n": limit}).all()
