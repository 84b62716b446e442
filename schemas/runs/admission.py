"""Admission: the one way a run enters ``runs``, and its publish bookkeeping.

Every run is inserted by :meth:`RunAdmission.admit_batch` (``_ADMIT_RUNS``, the one
statement that inserts runs): the gateway's admission queue sends the requests that
arrive together, a single request (a schedule's run-now) is a batch of one
(:meth:`RunAdmission.admit`), and the scheduler's fires are a batch without budgets or
cap. A batch is one transaction:

* sessions are upserted (``RETURNING`` the ones created) and the sessions the requests
  named are read for their owner (another user's: SessionNotOwned);
* the users' budgets are read with the current periods' spend, unlocked (the overshoot is
  at most the runs admitted meanwhile; a spent budget: OverBudget);
* the cap on a user's active runs (``max_active``, KODA_MAX_ACTIVE_RUNS_PER_USER) is the
  one count admission makes, under a lock: the transaction first takes a per-user
  advisory transaction lock (``_LOCK_USERS``), then counts the user's runs not yet ended
  in a statement of its own, so the count sees every run the previous holder committed
  (past it: TooManyActiveRuns);
* the runs are inserted ``ON CONFLICT (idempotency_key) DO NOTHING``; Postgres's unique
  index serialises concurrent requests with one key (the losers wait for the winner's
  commit, then see its row). There is no check-then-insert anywhere;
* the runs of keys that conflicted or were refused are read back: a replay answers its
  key's run, never a refusal; and the sessions created for requests that made no run are
  deleted again, so a replay or a refusal writes nothing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
from sqlalchemy import func, select, text
from sqlalchemy.ext.asyncio import AsyncEngine

from koda_runtime.errors import (
    DatabaseError,
    Refused,
    SessionNotOwned,
    TooManyActiveRuns,
)
from koda_runtime.lifecycle.ledger import OverBudget, Period, exceeded, soft_crossed
from koda_runtime.lifecycle.states import RunStatus
from koda_runtime.schemas import ledger
from koda_runtime.schemas.db import driver_connection, failing_as, for_driver, send
from koda_runtime.schemas.tables import runs

# A conflicting row vanished between the conflict and the read (deleted by hand):
# try again a bounded number of times rather than loop.
ADMIT_ATTEMPTS = 3

# A pending run published this many sweep thresholds ago is republished: its record
# may be gone (unclean broker loss) or its claiming gateway died before delivery.
STALE_FACTOR = 10


@dataclass(frozen=True)
class NewRun:
    """Everything the gateway decides about a run before writing it."""

    run_id: str
    user_id: str
    session_id: str
    create_session: bool
    idempotency_key: str
    input: dict[str, Any]
    metadata: dict[str, Any] | None
    partition: int
    # A scheduled run: the schedule and the UTC minute it fired for.
    schedule_id: str | None = None
    scheduled_for: datetime | None = None
    # The W3C trace context its records carry (koda/tracing.py); None: not traced.
    traceparent: str | None = None
    # runs.created_by (0014): ``user:<id>`` or ``service:<name>``; None: ``user:<user_id>``.
    created_by: str | None = None


@dataclass(frozen=True)
class AdmittedRun:
    """The run a request maps to; ``created`` is False for a replay of an earlier key."""

    run_id: str
    user_id: str
    session_id: str
    status: str
    created_at: datetime
    created: bool
    merged: bool = False  # the request was merged into this (running) run
    # Budget periods past their soft threshold whose alert nobody has recorded yet.
    soft_alerts: tuple[Period, ...] = ()
    traceparent: str | None = None  # a created run's (NewRun.traceparent)


@dataclass(frozen=True)
class PendingRun:
    """A run claimed by the sweeper for publishing again."""

    run_id: str
    user_id: str
    session_id: str
    created_at: datetime
    schedule_id: str | None = None
    scheduled_for: datetime | None = None
    traceparent: str | None = None


_CLAIM_UNPUBLISHED = text(
    """
    UPDATE runs SET published_at = now()
     WHERE id IN (
           SELECT id FROM runs
            WHERE status = :pending
              AND created_at < now() - make_interval(secs => :after_s)
              -- Never published, or published so long ago that the record (or the
              -- gateway that claimed it before dying) must be presumed lost.
              AND (published_at IS NULL
                   OR published_at < now() - make_interval(secs => :after_s * :stale_factor))
            ORDER BY created_at
            LIMIT :batch
              FOR UPDATE SKIP LOCKED)
    RETURNING id, user_id, session_id, created_at, schedule_id, scheduled_for, traceparent
    """
)
_RELEASE = text(
    """
    UPDATE runs SET published_at = NULL
     WHERE id = ANY(CAST(:ids AS text[])) AND status = :pending
    """
)
_BATCH_SESSIONS = text(
    """
    INSERT INTO sessions (id, user_id)
    SELECT * FROM unnest(CAST(:sids AS text[]), CAST(:uids AS text[]))
    ON CONFLICT (id) DO NOTHING
    RETURNING id
    """
)
_SESSION_OWNERS = text("SELECT id, user_id FROM sessions WHERE id = ANY(CAST(:sids AS text[]))")
# The one statement that inserts runs.
_ADMIT_RUNS = text(
    """
    INSERT INTO runs (id, session_id, user_id, idempotency_key, input, metadata, partition,
                      schedule_id, scheduled_for, traceparent, created_by)
    SELECT q.id, q.sid, q.uid, q.key, CAST(q.input AS jsonb), CAST(q.meta AS jsonb), q.part,
           q.sched, q.at, q.tp, q.cb
      FROM unnest(CAST(:ids AS text[]), CAST(:sids AS text[]), CAST(:uids AS text[]),
                  CAST(:keys AS text[]), CAST(:inputs AS text[]), CAST(:metas AS text[]),
                  CAST(:parts AS int[]), CAST(:scheds AS text[]), CAST(:ats AS timestamptz[]),
                  CAST(:tps AS text[]), CAST(:bys AS text[]))
           AS q(id, sid, uid, key, input, meta, part, sched, at, tp, cb)
    ON CONFLICT (idempotency_key) DO NOTHING
    RETURNING id, status, created_at
    """
)
_RUNS_BY_KEY = text(
    """
    SELECT id, user_id, session_id, status, created_at, idempotency_key FROM runs
     WHERE idempotency_key = ANY(CAST(:keys AS text[]))
    """
)
# The cap on active runs. The lock comes first in its transaction, users in the order of
# their lock keys, so two transactions locking overlapping users never wait in a cycle;
# the key is the schema's and the user's (namespaces of one database do not share it).
# Postgres evaluates the volatile lock after the ORDER BY.
_LOCK_USERS = text(
    """
    SELECT pg_advisory_xact_lock(k.key)
      FROM (SELECT DISTINCT hashtextextended(current_schema() || '/active-runs/' || u, 0) AS key
              FROM unnest(CAST(:users AS text[])) AS u) AS k
     ORDER BY k.key
    """
)
# A statement of its own, after the lock: under READ COMMITTED its snapshot is taken
# once the lock is held. The statuses are those of OPEN (koda/lifecycle/states.py), and
# ``ix_runs_open_user_id`` (migration 0010) holds only those runs, with this very
# predicate (tests/unit/test_gateway_active_cap.py holds the three to one another).
_ACTIVE_RUNS = text(
    """
    SELECT user_id, count(*) AS n FROM runs
     WHERE user_id = ANY(CAST(:users AS text[]))
       AND status IN ('pending', 'running', 'streaming', 'waiting')
     GROUP BY user_id
    """
)
# One array parameter: an IN list of hundreds of bound values costs more to build and
# bind than the update itself.
_MARK_PUBLISHED = text("UPDATE runs SET published_at = now() WHERE id = ANY(CAST(:ids AS text[]))")
_DROP_SESSIONS = text("DELETE FROM sessions WHERE id = ANY(CAST(:sids AS text[]))")
# The batch's statements as psycopg takes them (sent on the driver connection).
_BATCH_SESSIONS_SQL = for_driver(_BATCH_SESSIONS)
_SESSION_OWNERS_SQL = for_driver(_SESSION_OWNERS)
_ADMIT_RUNS_SQL = for_driver(_ADMIT_RUNS)
_RUNS_BY_KEY_SQL = for_driver(_RUNS_BY_KEY)
_DROP_SESSIONS_SQL = for_driver(_DROP_SESSIONS)
_LOCK_USERS_SQL = for_driver(_LOCK_USERS)
_ACTIVE_RUNS_SQL = for_driver(_ACTIVE_RUNS)

_PENDING = RunStatus.PENDING.value


class RunAdmission:
    """Admission's reads and writes of ``runs`` and ``sessions``, and the ledger reads it
    makes (budgets, their soft alerts)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    async def ping(self) -> None:
        """``SELECT 1``; raises DatabaseError when Postgres cannot answer."""
        try:
            with failing_as("reaching postgres"):
                async with self.engine.connect() as conn:
                    await conn.execute(text("SELECT 1"))
        except OSError as exc:  # before the driver: the address cannot be reached at all
            raise DatabaseError(f"reaching postgres failed: {type(exc).__name__}") from exc

    async def admit(self, run: NewRun, *, budgets: bool = True, max_active: int = 0) -> AdmittedRun:
        """Insert ``run`` unless its idempotency key exists; either way return the key's run.

        A batch of one through :meth:`admit_batch`. Raises SessionNotOwned when
        ``run.session_id`` belongs to another user, OverBudget (nothing written) when the
        user has spent a budget and the key is new, and TooManyActiveRuns (nothing
        written) when the key is new and the user already has ``max_active`` runs not yet
        ended (0: no cap): a replay of an admitted run still answers with that run.
        ``budgets=False`` skips the budget read.
        """
        for _ in range(ADMIT_ATTEMPTS):
            (answer,) = await self.admit_batch([run], budgets=budgets, max_active=max_active)
            if isinstance(answer, Refused):
                raise answer
            if answer is not None:
                return answer
        raise DatabaseError(
            f"idempotency key conflicted but no run was found after {ADMIT_ATTEMPTS} tries"
        )

    async def admit_batch(
        self, batch: list[NewRun], *, budgets: bool = True, max_active: int = 0
    ) -> list[AdmittedRun | Refused | None]:
        """Admit many requests at once, in one transaction of three round trips.

        The i-th answer is ``batch[i]``'s: its run (created, or the run its key already
        had), SessionNotOwned, OverBudget or TooManyActiveRuns (nothing of it written), or
        None when its key conflicted with a run that has vanished since (deleted by hand:
        try it again).
        One request's refusal or replay never fails another's. Raises DatabaseError when
        the transaction fails: then nothing of any request is written.

        With ``max_active`` (0: no cap) the batch's users are locked first and their runs
        not yet ended counted under the locks; a user's new keys take the room left in
        arrival order, and the rest are refused. When a user asks for more than the room,
        the keys of that user's requests are read first (one more round trip), so that a
        replay neither takes room nor is refused. ``budgets=False`` skips the budget read.

        Statement by statement: sessions upserted, the sessions named by the requests
        read for their owner, the users' budgets read (unlocked, so the overshoot is at
        most the runs admitted meanwhile), the runs inserted ``ON CONFLICT
        (idempotency_key) DO NOTHING``, the runs of conflicting or refused keys read back,
        and the sessions created for requests that made no run deleted again. Rows are
        written in key order, so that two gateways' overlapping batches wait on each
        other in one order, never in a cycle.

        The statements go to psycopg itself, on the connection (and in the transaction)
        of the SQLAlchemy one, and those that need nothing of each other's answers share
        a round trip in pipeline mode: the sessions, their owners and the budgets; then
        the runs; then COMMIT. A batch with a replay or a refusal takes one more.
        """
        if not batch:
            return []
        answers: list[AdmittedRun | Refused | None] = [None] * len(batch)
        with failing_as("admitting runs"):
            async with self.engine.begin() as conn:
                raw = await driver_connection(conn)
                await _admit_batch(raw, batch, budgets, max_active, answers)
        return answers

    async def mark_soft_alert(self, user_id: str, period: Period) -> bool:
        """Record the period's soft-threshold alert; True only for the first to record it."""
        with failing_as("recording a budget alert"):
            async with self.engine.begin() as conn:
                return await ledger.mark_soft_alert(conn, user_id, period)

    async def spent_user_count(self) -> int:
        """Users with a budget spent now (``koda_budget_exhausted_users``)."""
        with failing_as("counting spent budgets"):
            async with self.engine.connect() as conn:
                return await ledger.spent_user_count(conn)

    async def recent_by_key(self, idempotency_key: str, within_s: float) -> AdmittedRun | None:
        """The run stored under ``idempotency_key`` if Postgres created it less than
        ``within_s`` seconds ago (a derived key's dedup window), else None."""
        with failing_as("reading a run by key"):
            async with self.engine.connect() as conn:
                row = (
                    await conn.execute(
                        select(
                            runs.c.id,
                            runs.c.user_id,
                            runs.c.session_id,
                            runs.c.status,
                            runs.c.created_at,
                        ).where(
                            runs.c.idempotency_key == idempotency_key,
                            runs.c.created_at > func.now() - timedelta(seconds=within_s),
                        )
                    )
                ).first()
        if row is None:
            return None
        return AdmittedRun(row.id, row.user_id, row.session_id, row.status, row.created_at, False)

    async def mark_published(self, run_ids: list[str]) -> None:
        """Record that the broker acknowledged the runs' records."""
        if not run_ids:
            return
        with failing_as("marking runs published"):
            async with self.engine.begin() as conn:
                await conn.execute(_MARK_PUBLISHED, {"ids": run_ids})

    async def claim_unpublished(self, after_s: float, batch: int) -> list[PendingRun]:
        """Claim up to ``batch`` pending runs never published and older than ``after_s``.

        The claim sets ``published_at`` so a concurrent sweeper (another gateway)
        skips them; :meth:`release` undoes it for the ones that failed.
        """
        params = {
            "after_s": after_s,
            "batch": batch,
            "stale_factor": STALE_FACTOR,
            "pending": _PENDING,
        }
        with failing_as("claiming unpublished runs"):
            async with self.engine.begin() as conn:
                rows = (await conn.execute(_CLAIM_UNPUBLISHED, params)).all()
        return [
            PendingRun(
                r.id,
                r.user_id,
                r.session_id,
                r.created_at,
                r.schedule_id,
                r.scheduled_for,
                r.traceparent,
            )
            for r in rows
        ]

    async def release(self, run_ids: list[str]) -> None:
        """Make claimed runs eligible for the next sweep again."""
        if not run_ids:
            return
        with failing_as("releasing claimed runs"):
            async with self.engine.begin() as conn:
                await conn.execute(_RELEASE, {"ids": run_ids, "pending": _PENDING})


async def _admit_batch(
    raw: psycopg.AsyncConnection[Any],
    batch: list[NewRun],
    budgets: bool,
    max_active: int,
    answers: list[AdmittedRun | Refused | None],
) -> None:
    """:meth:`RunAdmission.admit_batch`'s statements, on the driver connection ``raw``."""
    owners = {r.session_id: r.user_id for r in sorted(batch, key=lambda r: r.session_id)}
    named = sorted({r.session_id for r in batch if not r.create_session})
    users = sorted({r.user_id for r in batch}) if budgets else []
    capped = sorted({r.user_id for r in batch}) if max_active else []
    async with raw.pipeline():
        if capped:
            # First in the transaction: the count below is read under the users' locks.
            await send(raw, _LOCK_USERS_SQL, {"users": capped})
        making = await send(
            raw, _BATCH_SESSIONS_SQL, {"sids": list(owners), "uids": list(owners.values())}
        )
        naming = await send(raw, _SESSION_OWNERS_SQL, {"sids": named}) if named else None
        reading = await send(raw, ledger.BUDGETS_OF_DRIVER, {"users": users}) if users else None
        counting = await send(raw, _ACTIVE_RUNS_SQL, {"users": capped}) if capped else None
    made = {row.id for row in await making.fetchall()}
    if naming is not None:
        owners.update({row.id: row.user_id for row in await naming.fetchall()})
    reads = ledger.budget_reads(await reading.fetchall()) if reading is not None else {}
    active = {row.user_id: int(row.n) for row in await counting.fetchall()} if counting else {}
    now = datetime.now(UTC)
    over = {user: e for user, b in reads.items() if (e := exceeded(b.state, now)) is not None}
    eligible: list[int] = []
    for i, run in enumerate(batch):
        if owners[run.session_id] != run.user_id:
            answers[i] = SessionNotOwned(
                "session not found: omit session_id to start a new session"
            )
        elif run.user_id not in over:
            eligible.append(i)
    insert = await _within_cap(raw, batch, eligible, active, max_active, answers)
    insert.sort(key=lambda i: batch[i].idempotency_key)
    created: dict[str, Any] = {}
    if insert:
        rows = await send(raw, _ADMIT_RUNS_SQL, _run_params([batch[i] for i in insert]))
        created = {row.id: row for row in await rows.fetchall()}
    for i in insert:
        run = batch[i]
        if (row := created.get(run.run_id)) is not None:
            read = reads.get(run.user_id)
            soft = () if read is None else _unalerted(read)
            answers[i] = AdmittedRun(
                run.run_id,
                run.user_id,
                run.session_id,
                row.status,
                row.created_at,
                True,
                soft_alerts=soft,
                traceparent=run.traceparent,
            )
    # A replay answers with its key's run, over budget or not.
    again = sorted({r.idempotency_key for i, r in enumerate(batch) if answers[i] is None})
    if again:
        rows = await send(raw, _RUNS_BY_KEY_SQL, {"keys": again})
        found = {row.idempotency_key: row for row in await rows.fetchall()}
        for i, run in enumerate(batch):
            if answers[i] is not None:
                continue
            if (row := found.get(run.idempotency_key)) is not None:
                answers[i] = _replayed(row)
            elif run.user_id in over:
                answers[i] = OverBudget(run.user_id, over[run.user_id])
    kept = {a.session_id for a in answers if isinstance(a, AdmittedRun) and a.created}
    if lost := sorted(made - kept):
        await send(raw, _DROP_SESSIONS_SQL, {"sids": lost})


async def _within_cap(
    raw: psycopg.AsyncConnection[Any],
    batch: list[NewRun],
    eligible: list[int],
    active: dict[str, int],
    max_active: int,
    answers: list[AdmittedRun | Refused | None],
) -> list[int]:
    """The requests of ``eligible`` to insert, given each user's ``active`` runs (read
    under the users' locks) and the cap ``max_active`` (0: none).

    A user's new keys take the room left in arrival order; two requests with one key take
    one place. The requests past the room are answered TooManyActiveRuns. When a user
    asks for more keys than the room, those keys are read first: a key that has a run is
    a replay, answered with that run, and takes no room. Under the user's lock no other
    admission can insert one of that user's keys meanwhile.
    """
    if not max_active:
        return eligible
    room = {u: max_active - active.get(u, 0) for u in {batch[i].user_id for i in eligible}}
    asked: dict[str, set[str]] = {}
    for i in eligible:
        asked.setdefault(batch[i].user_id, set()).add(batch[i].idempotency_key)
    short = sorted(k for u, keys in asked.items() if len(keys) > room[u] for k in keys)
    existing: dict[str, Any] = {}
    if short:
        rows = await send(raw, _RUNS_BY_KEY_SQL, {"keys": short})
        existing = {row.idempotency_key: row for row in await rows.fetchall()}
    insert: list[int] = []
    placed: set[str] = set()
    refused: list[int] = []
    for i in eligible:
        run = batch[i]
        key = run.idempotency_key
        if (row := existing.get(key)) is not None:
            answers[i] = _replayed(row)
        elif key in placed:
            insert.append(i)
        elif room[run.user_id] > 0:
            room[run.user_id] -= 1
            placed.add(key)
            insert.append(i)
        else:
            refused.append(i)
    for i in refused:
        # The user's room is spent: the runs active once this batch commits.
        user = batch[i].user_id
        answers[i] = TooManyActiveRuns(user, max_active, max(max_active, active.get(user, 0)))
    return insert


def _replayed(row: Any) -> AdmittedRun:
    """The answer to a request whose key already had a run (``_RUNS_BY_KEY``'s row)."""
    return AdmittedRun(row.id, row.user_id, row.session_id, row.status, row.created_at, False)


def _run_params(ordered: list[NewRun]) -> dict[str, list[Any]]:
    """The array parameters of ``_ADMIT_RUNS``, one entry per run."""
    return {
        "ids": [r.run_id for r in ordered],
        "sids": [r.session_id for r in ordered],
        "uids": [r.user_id for r in ordered],
        "keys": [r.idempotency_key for r in ordered],
        "inputs": [json.dumps(r.input) for r in ordered],
        "metas": [None if r.metadata is None else json.dumps(r.metadata) for r in ordered],
        "parts": [r.partition for r in ordered],
        "scheds": [r.schedule_id for r in ordered],
        "ats": [r.scheduled_for for r in ordered],
        "tps": [r.traceparent for r in ordered],
        "bys": [r.created_by or f"user:{r.user_id}" for r in ordered],
    }


def _unalerted(read: ledger.BudgetRead) -> tuple[Period, ...]:
    """The periods past their soft threshold whose alert nobody has recorded yet."""
    return tuple(p for p in soft_crossed(read.state) if p not in read.alerted)
