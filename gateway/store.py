"""The gateway's Postgres adapter: idempotent admission, reads, publish bookkeeping.

Admission is one transaction: upsert the session, then ``INSERT ... ON CONFLICT
(idempotency_key) DO NOTHING RETURNING``. When the key already exists the
transaction is rolled back (so a replay writes nothing, not even a session) and
the existing run is read back. Postgres's unique index serialises concurrent
requests with one key: the losers wait for the winner's commit, then see its row.
There is no check-then-insert anywhere.

The cap on a user's active runs (``max_active``, KODA_MAX_ACTIVE_RUNS_PER_USER) is the
one count admission makes, and it is made under a lock: the transaction first takes a
per-user advisory transaction lock (``_LOCK_USERS``), then counts the user's runs not
yet ended in a statement of its own, so that the count sees every run committed by the
previous holder. Two gateways, or two requests, admitting runs of one user take turns
from the lock to their commit, and none can pass the cap. Replays are answered before
the cap is applied: a request whose key has a run gets that run, never a refusal.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
from sqlalchemy import func, select, text
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine

from koda_runtime.errors import DatabaseError
from koda_runtime.gateway.exceptions import (
    OverBudget,
    Refused,
    SessionNotOwned,
    TooManyActiveRuns,
)
from koda_runtime.lifecycle.chunks import TERMINAL_KINDS
from koda_runtime.lifecycle.ledger import Period, exceeded, soft_crossed
from koda_runtime.lifecycle.states import RunStatus
from koda_runtime.schemas import ledger
from koda_runtime.schemas.db import driver_connection, for_driver, send
from koda_runtime.schemas.tables import runs, sessions

# A conflicting row vanished between the conflict and the read (deleted by hand):
# try again a bounded number of times rather than loop.
_ADMIT_ATTEMPTS = 3


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
class RunView:
    """What ``GET /v1/runs/{id}`` shows its owner."""

    run_id: str
    status: str
    attempt: int
    session_id: str
    created_at: datetime
    started_at: datetime | None
    first_chunk_at: datetime | None
    finished_at: datetime | None
    error: str | None
    output: str
    schedule_id: str | None = None
    scheduled_for: datetime | None = None
    created_by: str | None = None


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


@dataclass(frozen=True)
class StreamHead:
    """What an SSE stream needs to know before it answers.

    ``complete_through`` is set for a terminal run: the seq of its terminal event (or
    of its last event when it ended without one); nothing will ever follow it.
    """

    status: RunStatus
    complete_through: int | None
    traceparent: str | None = None  # the run's trace, which a viewer's span links to


@dataclass(frozen=True)
class StoredEvent:
    """One ``messages`` row, as an SSE stream replays it."""

    seq: int
    kind: str
    content: str
    attempt: int


_TERMINAL_KINDS = sorted(k.value for k in TERMINAL_KINDS)

_STREAM_HEAD = text(
    "SELECT status, traceparent FROM runs WHERE id = :run_id AND user_id = :user_id"
)
_RUN_END = text(
    """
    SELECT max(seq) FILTER (WHERE kind = ANY(:terminal)) AS terminal_seq, max(seq) AS last_seq
      FROM messages WHERE run_id = :run_id
    """
)
_RUN_STATUS = text("SELECT status FROM runs WHERE id = :run_id")
# Set once the sweep collapsed the run's chunks (processors/retention.py).
_OUTPUT_SEQ = text(
    "SELECT output_seq FROM runs WHERE id = :run_id AND chunks_expired_at IS NOT NULL"
)
_EVENTS_AFTER = text(
    """
    SELECT seq, kind, content, attempt FROM messages
     WHERE run_id = :run_id AND seq > :after
     ORDER BY seq LIMIT :limit
    """
)


_GET_RUN = text(
    """
    SELECT r.id, r.status, r.attempt, r.session_id, r.created_at, r.started_at,
           r.first_chunk_at, r.finished_at, r.error, r.schedule_id, r.scheduled_for,
           -- NULL (runs before 0014, a run-now's single insert): the user's own.
           COALESCE(r.created_by, 'user:' || r.user_id) AS created_by,
           COALESCE((
               SELECT string_agg(m.content, '' ORDER BY m.seq)
                 FROM messages m
                WHERE m.run_id = r.id AND m.kind = 'chunk'
                  AND m.seq > COALESCE((SELECT max(x.seq) FROM messages x
                                         WHERE x.run_id = r.id AND x.kind = 'reset'), -1)
           ), '') AS output
      FROM runs r
     WHERE r.id = :run_id AND r.user_id = :user_id
    """
)

# A pending run published this many sweep thresholds ago is republished: its record
# may be gone (unclean broker loss) or its claiming gateway died before delivery.
STALE_FACTOR = 10

_CLAIM_UNPUBLISHED = text(
    """
    UPDATE runs SET published_at = now()
     WHERE id IN (
           SELECT id FROM runs
            WHERE status = 'pending'
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


# admit_many: the batch form of admit's insert, for runs whose sessions need no owner
# check (a new session each, or a fixed session the owner's since the schedule began).
_ADMIT_SESSIONS = text(
    """
    INSERT INTO sessions (id, user_id)
    SELECT * FROM unnest(CAST(:sids AS text[]), CAST(:uids AS text[]))
    ON CONFLICT (id) DO NOTHING
    """
)
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
# admit_batch: many requests' admissions in one transaction (see RunStore.admit_batch).
_BATCH_SESSIONS = text(
    """
    INSERT INTO sessions (id, user_id)
    SELECT * FROM unnest(CAST(:sids AS text[]), CAST(:uids AS text[]))
    ON CONFLICT (id) DO NOTHING
    RETURNING id
    """
)
_SESSION_OWNERS = text("SELECT id, user_id FROM sessions WHERE id = ANY(CAST(:sids AS text[]))")
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
# admit_batch's statements as psycopg takes them (sent on the driver connection).
_BATCH_SESSIONS_SQL = for_driver(_BATCH_SESSIONS)
_SESSION_OWNERS_SQL = for_driver(_SESSION_OWNERS)
_ADMIT_RUNS_SQL = for_driver(_ADMIT_RUNS)
_RUNS_BY_KEY_SQL = for_driver(_RUNS_BY_KEY)
_DROP_SESSIONS_SQL = for_driver(_DROP_SESSIONS)
_LOCK_USERS_SQL = for_driver(_LOCK_USERS)
_ACTIVE_RUNS_SQL = for_driver(_ACTIVE_RUNS)


class RunStore:
    """Every read and write the gateway makes; no other gateway module speaks SQL."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    async def ping(self) -> None:
        """``SELECT 1``; raises DatabaseError when Postgres cannot answer."""
        try:
            async with self.engine.connect() as conn:
                await conn.execute(text("SELECT 1"))
        except (SQLAlchemyError, OSError) as exc:
            raise DatabaseError(f"postgres is unreachable: {type(exc).__name__}") from exc

    async def admit(self, run: NewRun, *, budgets: bool = True, max_active: int = 0) -> AdmittedRun:
        """Insert ``run`` unless its idempotency key exists; either way return the key's run.

        Raises SessionNotOwned when ``run.session_id`` belongs to another user, OverBudget
        (nothing written) when the user has spent a budget and the key is new, and
        TooManyActiveRuns (nothing written) when the key is new and the user already has
        ``max_active`` runs not yet ended (0: no cap): a replay of an admitted run still
        answers with that run. ``budgets=False`` skips the budget read.
        """
        for _ in range(_ADMIT_ATTEMPTS):
            try:
                try:
                    inserted = await self._insert(run, budgets, max_active)
                except (OverBudget, TooManyActiveRuns):
                    existing = await self._by_key(run.idempotency_key)
                    if existing is None:
                        raise
                    return existing
                if inserted is not None:
                    return inserted
                existing = await self._by_key(run.idempotency_key)
            except SQLAlchemyError as exc:
                raise DatabaseError(f"admitting a run failed: {type(exc).__name__}") from exc
            if existing is not None:
                return existing
        raise DatabaseError(
            f"idempotency key conflicted but no run was found after {_ADMIT_ATTEMPTS} tries"
        )

    async def admit_batch(
        self, batch: list[NewRun], *, budgets: bool = True, max_active: int = 0
    ) -> list[AdmittedRun | Refused | None]:
        """:meth:`admit` for many requests at once, in one transaction of three round trips.

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
        replay neither takes room nor is refused.

        The rules are :meth:`admit`'s, statement by statement: sessions upserted, the
        sessions named by the requests read for their owner, the users' budgets read
        (unlocked, so the overshoot is at most the runs admitted meanwhile), the runs
        inserted ``ON CONFLICT (idempotency_key) DO NOTHING``, the runs of conflicting
        or refused keys read back, and the sessions created for requests that made no run
        deleted again. Rows are written in key order, so that two gateways' overlapping
        batches wait on each other in one order, never in a cycle.

        The statements go to psycopg itself, on the connection (and in the transaction)
        of the SQLAlchemy one, and those that need nothing of each other's answers share
        a round trip in pipeline mode: the sessions, their owners and the budgets; then
        the runs; then COMMIT. A batch with a replay or a refusal takes one more.
        """
        if not batch:
            return []
        answers: list[AdmittedRun | Refused | None] = [None] * len(batch)
        try:
            async with self.engine.begin() as conn:
                raw = await driver_connection(conn)
                await _admit_batch(raw, batch, budgets, max_active, answers)
        except (SQLAlchemyError, psycopg.Error) as exc:
            raise DatabaseError(f"admitting runs failed: {type(exc).__name__}") from exc
        return answers

    async def admit_many(self, batch: list[NewRun]) -> list[AdmittedRun | None]:
        """Insert each run of ``batch`` unless its idempotency key exists, in one transaction.

        The same insert as :meth:`admit` (``ON CONFLICT (idempotency_key) DO NOTHING``),
        for many runs at once: the i-th answer is the created run, or None when its key
        already had one (nothing of it is kept, not even its new session). Sessions are
        not owner-checked here: each run's is either new (``create_session``) or one the
        caller verified belongs to the user.

        No cap on active runs applies: this is the scheduler's insert, and the scheduler
        moves past a minute once it has fired it, so a refusal here would lose that
        minute. Its runs count toward the owner's cap for every other admission.
        """
        if not batch:
            return []
        # In key order: two callers inserting overlapping batches then wait on each
        # other's keys in one order, never in a cycle (a deadlock would abort one).
        params = _run_params(sorted(batch, key=lambda r: r.idempotency_key))
        try:
            async with self.engine.begin() as conn:
                await conn.execute(
                    _ADMIT_SESSIONS, {"sids": params["sids"], "uids": params["uids"]}
                )
                rows = {r.id: r for r in (await conn.execute(_ADMIT_RUNS, params)).all()}
                lost = [r.session_id for r in batch if r.create_session and r.run_id not in rows]
                if lost:
                    await conn.execute(_DROP_SESSIONS, {"sids": lost})
        except SQLAlchemyError as exc:
            raise DatabaseError(f"admitting runs failed: {type(exc).__name__}") from exc
        return [
            None
            if (row := rows.get(r.run_id)) is None
            else AdmittedRun(
                r.run_id,
                r.user_id,
                r.session_id,
                row.status,
                row.created_at,
                True,
                traceparent=r.traceparent,
            )
            for r in batch
        ]

    async def _insert(self, run: NewRun, budgets: bool, max_active: int) -> AdmittedRun | None:
        async with self.engine.connect() as conn:
            trans = await conn.begin()
            soft: tuple[Period, ...] = ()
            try:
                if max_active:
                    # The lock first, then the count in a statement of its own.
                    await conn.execute(_LOCK_USERS, {"users": [run.user_id]})
                    row = (await conn.execute(_ACTIVE_RUNS, {"users": [run.user_id]})).first()
                    active = 0 if row is None else int(row.n)
                    if active >= max_active:
                        raise TooManyActiveRuns(run.user_id, max_active, active)
                if run.create_session:
                    await conn.execute(
                        sessions.insert().values(id=run.session_id, user_id=run.user_id)
                    )
                else:
                    await conn.execute(
                        pg_insert(sessions)
                        .values(id=run.session_id, user_id=run.user_id)
                        .on_conflict_do_nothing(index_elements=[sessions.c.id])
                    )
                    owner = (
                        await conn.execute(
                            select(sessions.c.user_id).where(sessions.c.id == run.session_id)
                        )
                    ).scalar_one()
                    if owner != run.user_id:
                        raise SessionNotOwned(
                            "session not found: omit session_id to start a new session"
                        )
                # The same statement reads the user's budgets and the current periods'
                # spend (kept by the workers' ledger writes) and inserts only if none is
                # spent. Not locked: runs admitted concurrently all see the same spend, so
                # the overshoot is at most what they then spend.
                done = await ledger.insert_run(
                    conn,
                    {
                        "id": run.run_id,
                        "session_id": run.session_id,
                        "user_id": run.user_id,
                        "key": run.idempotency_key,
                        "input": run.input,
                        "metadata": run.metadata,
                        "partition": run.partition,
                        "schedule_id": run.schedule_id,
                        "scheduled_for": run.scheduled_for,
                    },
                    budgets=budgets,
                )
                if done.budget is not None:
                    over = exceeded(done.budget.state, datetime.now(UTC))
                    if done.status is None and over is not None:
                        raise OverBudget(run.user_id, over)
                    soft = _unalerted(done.budget)
                if done.status is None or done.created_at is None:
                    await trans.rollback()
                    return None
                await trans.commit()
            except BaseException:
                if trans.is_active:
                    await trans.rollback()
                raise
        return AdmittedRun(
            run_id=run.run_id,
            user_id=run.user_id,
            session_id=run.session_id,
            status=done.status,
            created_at=done.created_at,
            created=True,
            soft_alerts=soft,
        )

    async def mark_soft_alert(self, user_id: str, period: Period) -> bool:
        """Record the period's soft-threshold alert; True only for the first to record it."""
        try:
            async with self.engine.begin() as conn:
                return await ledger.mark_soft_alert(conn, user_id, period)
        except SQLAlchemyError as exc:
            raise DatabaseError(f"recording a budget alert failed: {type(exc).__name__}") from exc

    async def spent_user_count(self) -> int:
        """Users with a budget spent now (``koda_budget_exhausted_users``)."""
        try:
            async with self.engine.connect() as conn:
                return await ledger.spent_user_count(conn)
        except SQLAlchemyError as exc:
            raise DatabaseError(f"counting spent budgets failed: {type(exc).__name__}") from exc

    async def recent_by_key(self, idempotency_key: str, within_s: float) -> AdmittedRun | None:
        """The run stored under ``idempotency_key`` if Postgres created it less than
        ``within_s`` seconds ago (a derived key's dedup window), else None."""
        try:
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
        except SQLAlchemyError as exc:
            raise DatabaseError(f"reading a run by key failed: {type(exc).__name__}") from exc
        if row is None:
            return None
        return AdmittedRun(row.id, row.user_id, row.session_id, row.status, row.created_at, False)

    async def _by_key(self, idempotency_key: str) -> AdmittedRun | None:
        async with self.engine.connect() as conn:
            row = (
                await conn.execute(
                    select(
                        runs.c.id,
                        runs.c.user_id,
                        runs.c.session_id,
                        runs.c.status,
                        runs.c.created_at,
                    ).where(runs.c.idempotency_key == idempotency_key)
                )
            ).first()
        if row is None:
            return None
        return AdmittedRun(
            run_id=row.id,
            user_id=row.user_id,
            session_id=row.session_id,
            status=row.status,
            created_at=row.created_at,
            created=False,
        )

    async def get_run(self, run_id: str, user_id: str) -> RunView | None:
        """The run if it exists and belongs to ``user_id``; None otherwise (indistinguishable)."""
        if not _storable(run_id):
            return None
        try:
            async with self.engine.connect() as conn:
                row = (await conn.execute(_GET_RUN, {"run_id": run_id, "user_id": user_id})).first()
        except SQLAlchemyError as exc:
            raise DatabaseError(f"reading a run failed: {type(exc).__name__}") from exc
        if row is None:
            return None
        return RunView(
            run_id=row.id,
            status=row.status,
            attempt=row.attempt,
            session_id=row.session_id,
            created_at=row.created_at,
            started_at=row.started_at,
            first_chunk_at=row.first_chunk_at,
            finished_at=row.finished_at,
            error=row.error,
            output=row.output,
            schedule_id=row.schedule_id,
            scheduled_for=row.scheduled_for,
            created_by=row.created_by,
        )

    async def mark_published(self, run_ids: list[str]) -> None:
        """Record that the broker acknowledged the runs' records."""
        if not run_ids:
            return
        try:
            async with self.engine.begin() as conn:
                await conn.execute(_MARK_PUBLISHED, {"ids": run_ids})
        except SQLAlchemyError as exc:
            raise DatabaseError(f"marking runs published failed: {type(exc).__name__}") from exc

    async def claim_unpublished(self, after_s: float, batch: int) -> list[PendingRun]:
        """Claim up to ``batch`` pending runs never published and older than ``after_s``.

        The claim sets ``published_at`` so a concurrent sweeper (another gateway)
        skips them; :meth:`release` undoes it for the ones that failed.
        """
        try:
            async with self.engine.begin() as conn:
                rows = (
                    await conn.execute(
                        _CLAIM_UNPUBLISHED,
                        {"after_s": after_s, "batch": batch, "stale_factor": STALE_FACTOR},
                    )
                ).all()
        except SQLAlchemyError as exc:
            raise DatabaseError(f"claiming unpublished runs failed: {type(exc).__name__}") from exc
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
        try:
            async with self.engine.begin() as conn:
                await conn.execute(
                    runs.update()
                    .where(runs.c.id.in_(run_ids), runs.c.status == RunStatus.PENDING.value)
                    .values(published_at=None)
                )
        except SQLAlchemyError as exc:
            raise DatabaseError(f"releasing claimed runs failed: {type(exc).__name__}") from exc

    async def stream_head(self, run_id: str, user_id: str) -> StreamHead | None:
        """The run's status if it belongs to ``user_id`` (None otherwise, indistinguishable)."""
        if not _storable(run_id):
            return None
        try:
            async with self.engine.connect() as conn:
                row = (
                    await conn.execute(_STREAM_HEAD, {"run_id": run_id, "user_id": user_id})
                ).first()
                if row is None:
                    return None
                status, traceparent = RunStatus(row.status), row.traceparent
                through = None
                if status.terminal:
                    end = (
                        await conn.execute(
                            _RUN_END, {"run_id": run_id, "terminal": _TERMINAL_KINDS}
                        )
                    ).one()
                    through = end.terminal_seq if end.terminal_seq is not None else end.last_seq
        except SQLAlchemyError as exc:
            raise DatabaseError(f"reading a run failed: {type(exc).__name__}") from exc
        return StreamHead(status, None if through is None else int(through), traceparent)

    async def expired_output_seq(self, run_id: str) -> int | None:
        """The seq of the one row holding the whole output of a run whose chunks expired
        (KODA_CHUNK_RETENTION); None while they are kept, or when it has no such row."""
        try:
            async with self.engine.connect() as conn:
                seq = (await conn.execute(_OUTPUT_SEQ, {"run_id": run_id})).scalar()
        except SQLAlchemyError as exc:
            raise DatabaseError(f"reading a run failed: {type(exc).__name__}") from exc
        return None if seq is None else int(seq)

    async def terminal_seq(self, run_id: str) -> int | None:
        """The seq of the run's terminal event, or None if it has none (yet)."""
        try:
            async with self.engine.connect() as conn:
                end = (
                    await conn.execute(_RUN_END, {"run_id": run_id, "terminal": _TERMINAL_KINDS})
                ).one()
        except SQLAlchemyError as exc:
            raise DatabaseError(f"reading a run failed: {type(exc).__name__}") from exc
        return None if end.terminal_seq is None else int(end.terminal_seq)

    async def events_after(
        self, run_id: str, after: int, limit: int
    ) -> tuple[RunStatus | None, list[StoredEvent]]:
        """The run's status, then up to ``limit`` messages with seq > ``after`` in order.

        The status is read first: when it is terminal, every message of the run was
        committed before it (the terminal transition and the last events share one
        transaction), so the rows that follow are all there will ever be.
        """
        try:
            async with self.engine.connect() as conn:
                status = (await conn.execute(_RUN_STATUS, {"run_id": run_id})).scalar()
                rows = (
                    await conn.execute(
                        _EVENTS_AFTER, {"run_id": run_id, "after": after, "limit": limit}
                    )
                ).all()
        except SQLAlchemyError as exc:
            raise DatabaseError(f"reading run events failed: {type(exc).__name__}") from exc
        events = [StoredEvent(int(r.seq), r.kind, r.content, int(r.attempt)) for r in rows]
        return (None if status is None else RunStatus(status)), events


async def _admit_batch(
    raw: psycopg.AsyncConnection[Any],
    batch: list[NewRun],
    budgets: bool,
    max_active: int,
    answers: list[AdmittedRun | Refused | None],
) -> None:
    """:meth:`RunStore.admit_batch`'s statements, on the driver connection ``raw``."""
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
    """The array parameters of ``_ADMIT_RUNS`` (and its sessions), one entry per run."""
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


def _storable(run_id: str) -> bool:
    """False for an id Postgres text cannot hold (NUL): no run has it, and sending it
    would fail as a database error, a 503 for what is a client's unknown id."""
    return "\x00" not in run_id
