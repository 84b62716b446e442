"""Run control in Postgres: cancel, merge, and a user's run history.

A status write takes its source and target statuses from the state machine's edges
(:func:`koda_runtime.lifecycle.states.edge`), bound as parameters: no statement here
spells a status. Every write is one conditional UPDATE on the run's row (expected
status in the WHERE clause), so it cannot race the worker: the worker's fenced writes
lock the row ``FOR SHARE``, and its finish checks ``cancel_requested_at`` and ``input_version`` in
the same transaction that ends the run. Whichever commits first wins; the other
sees it.

A merge is held to what a new run is: a spent budget refuses it (OverBudget, answered
402 like a submission over budget), and so do the caps on merges per run and on the
merged input's bytes (CapReached, answered 409 naming the cap). Each is checked on the
locked row, so two merges racing cannot both pass a cap.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from koda_runtime.caps import MERGED_BYTES, MERGES, CapReached
from koda_runtime.lifecycle.chunks import ChunkKind
from koda_runtime.lifecycle.control import merge_inputs
from koda_runtime.lifecycle.ledger import OverBudget, exceeded
from koda_runtime.lifecycle.states import ACTIVE, RunStatus, edge, sources_of
from koda_runtime.schemas import ledger
from koda_runtime.schemas.db import failing_as
from koda_runtime.settings import Settings

CANCELLED = "cancelled"  # pending → cancelled, here and now
REQUESTED = "requested"  # running: the request is durable, the worker ends the run
UNCHANGED = "unchanged"  # terminal already: nothing changes


@dataclass(frozen=True)
class CancelOutcome:
    run_id: str
    user_id: str
    status: str
    outcome: str
    partition: int | None
    cancel_reason: str | None
    cancel_requested_at: datetime | None
    # pending → cancelled: the terminal event the gateway wrote (seq, content).
    event_seq: int | None = None
    event_content: str | None = None


@dataclass(frozen=True)
class MergeCaps:
    """How far merges may grow one run: ``max_merges`` messages merged into it and
    ``max_bytes`` of input (its JSON, UTF-8) after the merge; 0 is no cap."""

    max_merges: int = 0
    max_bytes: int = 0

    @classmethod
    def of(cls, settings: Settings) -> MergeCaps:
        return cls(settings.max_merges_per_run, settings.max_merged_input_bytes)

    def check(self, merges: int, merged: str) -> None:
        """Raise CapReached when one more merge (the run has ``merges``) or the merged
        input ``merged`` (JSON) would pass a cap."""
        if self.max_merges and merges >= self.max_merges:
            raise CapReached(
                "merges",
                MERGES,
                self.max_merges,
                merges,
                f"{merges} messages are merged into the running run already and "
                f"{MERGES}={self.max_merges} allows no more: send it once the run has ended",
            )
        size = len(merged.encode())
        if self.max_bytes and size > self.max_bytes:
            raise CapReached(
                "merged_bytes",
                MERGED_BYTES,
                self.max_bytes,
                size,
                f"merged into the running run, the input would be {size} bytes and "
                f"{MERGED_BYTES}={self.max_bytes} allows no more: send it once the run "
                "has ended",
            )


@dataclass(frozen=True)
class MergeOutcome:
    run_id: str
    user_id: str
    session_id: str
    status: str
    created_at: datetime
    input_version: int
    replayed: bool


@dataclass(frozen=True)
class ListedRun:
    """One run of a history listing, as read (the API's shape is gateway/models.py's)."""

    run_id: str
    user_id: str
    session_id: str
    status: str
    attempt: int
    created_at: datetime
    finished_at: datetime | None
    cancel_reason: str | None
    merged: int  # messages merged into the run
    schedule_id: str | None
    scheduled_for: datetime | None


# A pending run is cancelled here and now, along the state machine's edge.
_CANCEL_NOW = edge(RunStatus.PENDING, RunStatus.CANCELLED)
_CANCEL_PENDING = text(
    """
    UPDATE runs SET status = :target, finished_at = now(),
           cancel_requested_at = now(), cancel_reason = :reason
     WHERE id = :run_id AND user_id = :user_id AND status = :source
    RETURNING id, user_id, status, partition, attempt, cancel_reason, cancel_requested_at
    """
)
_CANCEL_EVENT = text(
    """
    INSERT INTO messages (run_id, seq, kind, content, attempt)
    SELECT :run_id, COALESCE(MAX(seq) + 1, 0), :kind, :content, :attempt
      FROM messages WHERE run_id = :run_id
    RETURNING seq
    """
)
# A cancel request the worker acts on: every other status with an edge into cancelled,
# a claimed run's, or a waiting one's (the worker holding its partition resumes it and
# ends it cancelled; processors/tools/).
_CANCELLABLE = sources_of(RunStatus.CANCELLED) - {_CANCEL_NOW[0]}
_REQUEST_CANCEL = text(
    """
    UPDATE runs SET cancel_requested_at = now(), cancel_reason = :reason
     WHERE id = :run_id AND user_id = :user_id AND status = ANY(:active)
       AND cancel_requested_at IS NULL
    RETURNING id, user_id, status, partition, cancel_reason, cancel_requested_at
    """
)
_READ = text(
    """
    SELECT id, user_id, status, partition, cancel_reason, cancel_requested_at
      FROM runs WHERE id = :run_id AND user_id = :user_id
    """
)
_LATEST_IN_SESSION = text(
    """
    SELECT id, user_id, session_id, status, input, COALESCE(input_version, 0) AS input_version,
           created_at, cancel_requested_at, attempt,
           created_at > now() - make_interval(secs => :window_s) AS in_window
      FROM runs WHERE session_id = :session_id AND user_id = :user_id
     ORDER BY created_at DESC, id DESC LIMIT 1
       FOR UPDATE
    """
)
_MERGE = text(
    """
    UPDATE runs SET input = CAST(:input AS jsonb),
           input_version = COALESCE(input_version, 0) + 1
     WHERE id = :run_id AND status = ANY(:active) AND cancel_requested_at IS NULL
       AND COALESCE(input_version, 0) = :version AND attempt < :max_claims
    RETURNING status, input_version
    """
)
_RECORD_MERGE = text(
    """
    INSERT INTO run_merges (idempotency_key, run_id, user_id, input_version, input)
    VALUES (:key, :run_id, :user_id, :version, CAST(:input AS jsonb))
    ON CONFLICT (idempotency_key) DO NOTHING
    RETURNING run_id
    """
)
_MERGE_BY_KEY = text(
    """
    SELECT m.run_id, m.user_id, m.input_version, r.session_id, r.status, r.created_at
      FROM run_merges m JOIN runs r ON r.id = m.run_id
     WHERE m.idempotency_key = :key
    """
)
_LIST_RUNS_SQL = """
    SELECT r.id, r.user_id, r.session_id, r.status, r.attempt, r.created_at, r.finished_at,
           r.cancel_reason, COALESCE(r.input_version, 0) AS merged, r.schedule_id,
           r.scheduled_for
      FROM runs r
     WHERE {who}
       AND (CAST(:session_id AS text) IS NULL OR r.session_id = CAST(:session_id AS text))
       AND (CAST(:status AS text) IS NULL OR r.status = CAST(:status AS text))
       AND (CAST(:before_id AS text) IS NULL
            OR (r.created_at, r.id)
               < (CAST(:before_at AS timestamptz), CAST(:before_id AS text)))
     ORDER BY r.created_at DESC, r.id DESC
     LIMIT :limit
    """
# One user's history; and every user's, optionally one user's, for operators (a
# separate statement, so the users' query keeps its plan on (user_id, created_at)).
_LIST_RUNS = text(_LIST_RUNS_SQL.format(who="r.user_id = :user_id"))
_LIST_ALL_RUNS = text(
    _LIST_RUNS_SQL.format(
        who="(CAST(:user_id AS text) IS NULL OR r.user_id = CAST(:user_id AS text))"
    )
)
_RUN_BY_KEY = text("SELECT 1 FROM runs WHERE idempotency_key = :key")
# The run is whole on the chunk topic (see the worker's mark, schemas/runs/worker.py). The
# row is waited for, briefly: right after a submission the gateway's own
# ``published_at`` flush (gateway/admission.py, ``PublishedMarks``) holds it for a few
# milliseconds, and skipping it then left the mark unset and the cancelled event to be
# produced again. A holder slower than ``MARK_LOCK_WAIT_MS`` (a frozen process) makes
# the mark fail instead: the completeness pass sets it later.
MARK_LOCK_WAIT_MS = 1000
_MARK_LOCK_WAIT = text("SELECT set_config('lock_timeout', :wait, true)")
_MARK_PUBLISHED = text(
    """
    UPDATE runs SET published_seq = :seq
     WHERE id = :run_id AND finished_at IS NOT NULL AND published_seq IS NULL
    """
)


class ControlStore:
    """Cancel and merge writes, and history reads; owner-only throughout."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    async def cancel(self, run_id: str, user_id: str, reason: str | None) -> CancelOutcome | None:
        """Cancel the user's run; None when it is unknown or another user's."""
        if "\x00" in run_id:
            return None
        params = {"run_id": run_id, "user_id": user_id, "reason": reason}
        with failing_as("cancelling a run"):
            async with self.engine.begin() as conn:
                row = (
                    await conn.execute(
                        _CANCEL_PENDING,
                        {**params, "source": _CANCEL_NOW[0].value, "target": _CANCEL_NOW[1].value},
                    )
                ).first()
                if row is not None:
                    content = json.dumps({"status": RunStatus.CANCELLED.value, "reason": reason})
                    seq = (
                        await conn.execute(
                            _CANCEL_EVENT,
                            {
                                "run_id": run_id,
                                "kind": ChunkKind.CANCELLED.value,
                                "content": content,
                                "attempt": int(row.attempt),
                            },
                        )
                    ).scalar_one()
                    return CancelOutcome(
                        row.id,
                        row.user_id,
                        row.status,
                        CANCELLED,
                        row.partition,
                        row.cancel_reason,
                        row.cancel_requested_at,
                        int(seq),
                        content,
                    )
                row = (
                    await conn.execute(
                        _REQUEST_CANCEL, {**params, "active": [s.value for s in _CANCELLABLE]}
                    )
                ).first()
                outcome = REQUESTED
                if row is None:
                    row = (await conn.execute(_READ, params)).first()
                    if row is None:
                        return None
                    # Already requested (signal again: harmless) or already terminal.
                    active = RunStatus(row.status) in _CANCELLABLE
                    outcome = REQUESTED if active else UNCHANGED
        return CancelOutcome(
            row.id,
            row.user_id,
            row.status,
            outcome,
            row.partition,
            row.cancel_reason,
            row.cancel_requested_at,
        )

    async def merge(
        self,
        user_id: str,
        session_id: str,
        idempotency_key: str,
        extra: dict[str, Any],
        window_s: float,
        max_claims: int,
        *,
        budgets: bool = False,
        caps: MergeCaps | None = None,
    ) -> MergeOutcome | None:
        """Merge ``extra`` into the session's latest run if it is running or streaming,
        not being cancelled, younger than ``window_s`` and claimed fewer than
        ``max_claims`` times; None: admit a new run.

        Such a merge is refused, nothing written, with OverBudget when ``budgets`` and
        the user has spent a budget, and with CapReached at a cap of ``caps``.

        The rerun a merge causes is one more claim. A run claimed ``max_claims`` times
        would be given up at the next one, ``failed`` with the merged message
        unanswered; the message is a run of its own instead.

        The latest run's row is locked ``FOR UPDATE`` while the rule is checked, and
        the UPDATE is conditional on status and version again: a finish committed
        first makes this a new run; a merge committed first makes the finish refuse.
        A key seen before answers the earlier outcome and appends nothing.
        """
        with failing_as("merging into a run"):
            async with self.engine.begin() as conn:
                if (await conn.execute(_RUN_BY_KEY, {"key": idempotency_key})).first():
                    return None  # a replay of a run: the admission path answers it
                earlier = (await conn.execute(_MERGE_BY_KEY, {"key": idempotency_key})).first()
                if earlier is not None:
                    return _replayed(earlier)
                latest = (
                    await conn.execute(
                        _LATEST_IN_SESSION,
                        {"session_id": session_id, "user_id": user_id, "window_s": window_s},
                    )
                ).first()
                if (
                    latest is None
                    or RunStatus(latest.status) not in ACTIVE
                    or latest.cancel_requested_at is not None
                    or not latest.in_window
                    or latest.attempt >= max_claims
                ):
                    return None
                if budgets:
                    read = (await ledger.budgets_of(conn, [user_id])).get(user_id)
                    over = None if read is None else exceeded(read.state, datetime.now(UTC))
                    if over is not None:
                        raise OverBudget(user_id, over)
                merged = json.dumps(merge_inputs(latest.input, extra))
                (caps or MergeCaps()).check(int(latest.input_version), merged)
                row = (
                    await conn.execute(
                        _MERGE,
                        {
                            "run_id": latest.id,
                            "input": merged,
                            "active": [s.value for s in ACTIVE],
                            "version": int(latest.input_version),
                            "max_claims": max_claims,
                        },
                    )
                ).first()
                if row is None:
                    return None
                recorded = (
                    await conn.execute(
                        _RECORD_MERGE,
                        {
                            "key": idempotency_key,
                            "run_id": latest.id,
                            "user_id": user_id,
                            "version": int(row.input_version),
                            "input": json.dumps(extra),
                        },
                    )
                ).first()
                if recorded is None:
                    # The same key merged concurrently: undo ours, answer theirs.
                    await conn.rollback()
                    async with self.engine.connect() as again:
                        earlier = (
                            await again.execute(_MERGE_BY_KEY, {"key": idempotency_key})
                        ).first()
                    return None if earlier is None else _replayed(earlier)
        return MergeOutcome(
            latest.id,
            user_id,
            latest.session_id,
            row.status,
            latest.created_at,
            int(row.input_version),
            replayed=False,
        )

    async def mark_published(self, run_id: str, seq: int) -> None:
        """Record that messages 0..``seq`` of the terminal run ``run_id`` are on the chunk
        topic, so neither the worker that skips its trigger nor the completeness pass
        produces them again."""
        with failing_as("marking a run published"):
            async with self.engine.begin() as conn:
                await conn.execute(_MARK_LOCK_WAIT, {"wait": f"{MARK_LOCK_WAIT_MS}ms"})
                await conn.execute(_MARK_PUBLISHED, {"run_id": run_id, "seq": seq})

    async def session_owned(self, session_id: str, user_id: str) -> bool:
        with failing_as("reading a session"):
            async with self.engine.connect() as conn:
                row = (
                    await conn.execute(
                        text("SELECT 1 FROM sessions WHERE id = :id AND user_id = :user_id"),
                        {"id": session_id, "user_id": user_id},
                    )
                ).first()
        return row is not None

    async def cursor_position(
        self, run_id: str, user_id: str | None
    ) -> tuple[datetime, str] | None:
        """Where the user's run ``run_id`` sits in the history; None if not theirs.
        ``user_id`` None (operators): any user's run."""
        sql = "SELECT created_at, id FROM runs WHERE id = :id"
        if user_id is not None:
            sql += " AND user_id = :u"
        with failing_as("reading a cursor"):
            async with self.engine.connect() as conn:
                row = (await conn.execute(text(sql), {"id": run_id, "u": user_id})).first()
        return None if row is None else (row.created_at, row.id)

    async def list_runs(
        self,
        user_id: str | None,
        *,
        every_user: bool = False,
        session_id: str | None,
        status: RunStatus | None,
        limit: int,
        before: tuple[datetime, str] | None,
    ) -> list[ListedRun]:
        """The user's runs, newest first, (created_at, id) below ``before``. With
        ``every_user`` (operators) all users' runs, or ``user_id``'s when it is given."""
        params: dict[str, Any] = {
            "user_id": user_id,
            "limit": limit,
            "session_id": session_id,
            "status": None if status is None else status.value,
            "before_at": None if before is None else before[0],
            "before_id": None if before is None else before[1],
        }
        if user_id is None and not every_user:
            raise ValueError("list_runs needs a user_id unless every_user is set")
        sql = _LIST_ALL_RUNS if every_user else _LIST_RUNS
        with failing_as("listing runs"):
            async with self.engine.connect() as conn:
                rows = (await conn.execute(sql, params)).all()
        return [
            ListedRun(
                r.id,
                r.user_id,
                r.session_id,
                r.status,
                int(r.attempt),
                r.created_at,
                r.finished_at,
                r.cancel_reason,
                int(r.merged),
                r.schedule_id,
                r.scheduled_for,
            )
            for r in rows
        ]


def _replayed(row: Any) -> MergeOutcome:
    return MergeOutcome(
        row.run_id,
        row.user_id,
        row.session_id,
        row.status,
        row.created_at,
        int(row.input_version),
        replayed=True,
    )
