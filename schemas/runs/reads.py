"""What viewers read of a run: its view, its stream head and events, its timeline, its
session's turns, its Responses state, its trace. Reads only; every statement here is
the one the gateway, the worker's context loader or ``koda traces show`` sends.

Owner-only reads (``user_id`` given) answer None for another user's run or session:
indistinguishable from one that does not exist.

**The visible-output rule** (what a viewer keeps of a run: its ``chunk`` contents after
its last ``reset``, in seq order) has one source, :func:`koda_runtime.lifecycle.chunks.
visible_output`. The SQL form, :func:`visible_output_sql`, is rendered from the same
lifecycle kinds, and tests/integration/test_visible_output_sql.py holds the two to one
another on the same rows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import Engine, text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from koda_runtime.errors import KodaError
from koda_runtime.lifecycle.chunks import TERMINAL_KINDS, ChunkKind
from koda_runtime.lifecycle.states import RunStatus
from koda_runtime.lifecycle.turns import Turn, turn_tokens, user_messages
from koda_runtime.schemas import ledger
from koda_runtime.schemas.db import failing_as

# --- the visible-output rule, as SQL -------------------------------------------------

# The kinds of koda_runtime.lifecycle.chunks.visible_output, the rule's source.
_ANSWER_KIND = ChunkKind.CHUNK.value
_RESET_KIND = ChunkKind.RESET.value
_TERMINAL_KINDS = sorted(k.value for k in TERMINAL_KINDS)
# The ledger's kind of a model call: the calls whose tokens a run's answer cost.
_CHAT_CALL = "chat"


def visible_output_sql(run_id: str) -> str:
    """A SQL expression: the visible output of the run whose id is the SQL expression
    ``run_id`` (a column such as ``r.id``), ``''`` when it has none. The rule is
    :func:`~koda_runtime.lifecycle.chunks.visible_output`'s, rendered from its kinds."""
    return f"""COALESCE((
               SELECT string_agg(m.content, '' ORDER BY m.seq)
                 FROM messages m
                WHERE m.run_id = {run_id} AND m.kind = '{_ANSWER_KIND}'
                  AND m.seq > COALESCE((SELECT max(x.seq) FROM messages x
                                         WHERE x.run_id = {run_id}
                                           AND x.kind = '{_RESET_KIND}'), -1)
           ), '')"""  # noqa: S608 - fixed texts


# --- GET /v1/runs/{id}, the event stream -------------------------------------------


@dataclass(frozen=True)
class RunView:
    """What ``GET /v1/runs/{id}`` shows its owner.

    The gateway answers with this very class (its ``response_model``): the attribute
    docstrings below are the field descriptions of ``/openapi.json``.
    """

    __pydantic_config__ = {"use_attribute_docstrings": True}

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
    """Concatenated chunks emitted after the last reset."""
    schedule_id: str | None
    """The schedule that fired it, if any."""
    scheduled_for: datetime | None
    """The scheduled UTC minute it was fired for, if scheduled."""
    created_by: str
    """Who created it: `user:<id>` (the user's own token) or `service:<name>` (a
    KODA_SERVICE_TOKENS token acting for the user)."""


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


_GET_RUN = text(
    f"""
    SELECT r.id, r.status, r.attempt, r.session_id, r.created_at, r.started_at,
           r.first_chunk_at, r.finished_at, r.error, r.schedule_id, r.scheduled_for,
           -- NULL (runs before 0014, a run-now's single insert): the user's own.
           COALESCE(r.created_by, 'user:' || r.user_id) AS created_by,
           {visible_output_sql("r.id")} AS output
      FROM runs r
     WHERE r.id = :run_id AND r.user_id = :user_id
    """  # noqa: S608 - fixed texts, rendered from constants
)
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
_LAST_RESET = text("SELECT max(seq) AS seq FROM messages WHERE run_id = :run_id AND kind = :kind")

# --- the console's timeline ------------------------------------------------------------

_TIMELINE_RUN = text(
    """
    SELECT id, session_id, status, attempt, worker_id, partition, created_at, published_at,
           started_at, first_chunk_at, finished_at, error, failures, cancel_requested_at,
           cancel_reason, schedule_id, scheduled_for
    FROM runs WHERE id = :run_id AND user_id = :user_id
    """
)
_TIMELINE_EVENTS = text(
    "SELECT seq, kind, content, attempt, created_at FROM messages"
    " WHERE run_id = :run_id AND kind <> :chunk ORDER BY seq"
)
_TIMELINE_CHUNKS = text(
    "SELECT attempt, count(*) AS chunks, min(created_at) AS first_at, max(created_at) AS last_at"
    " FROM messages WHERE run_id = :run_id AND kind = :chunk GROUP BY attempt ORDER BY attempt"
)


@dataclass(frozen=True)
class TimelineEvent:
    """A message of the run other than a text chunk (status, reset, tool, the end)."""

    seq: int
    kind: str
    content: str
    attempt: int
    at: datetime


@dataclass(frozen=True)
class AttemptChunks:
    """The text chunks one attempt wrote: how many, the first's and the last's time."""

    attempt: int
    chunks: int
    first_at: datetime
    last_at: datetime


@dataclass(frozen=True)
class Timeline:
    """A run's lifecycle as Postgres holds it (the console's ``/timeline``)."""

    run: Any  # the runs row (_TIMELINE_RUN's columns)
    events: Sequence[TimelineEvent]
    attempts: Sequence[AttemptChunks]
    cost_usd: Decimal
    billable_calls: int


# --- session turns ---------------------------------------------------------------------

# The newest earlier runs read for a context, at most: a session longer than this is
# cut at its oldest turns before the token budget is applied.
MAX_TURNS = 200
TURN_STATUSES = [RunStatus.DONE.value, RunStatus.CANCELLED.value]

# The session's runs before :run_id that are turns (done or cancelled: :statuses), the
# newest :limit of them, oldest first. The per-user order makes them all ended by then.
# A turn's answer tokens are the completion tokens the ledger holds for the chat calls
# of its last attempt.
_EARLIER_TURNS = text(
    f"""
    WITH me AS (
        SELECT q.ord, q.lim, r.id, r.session_id, r.user_id, r.created_at
          FROM unnest(CAST(:ids AS text[]), CAST(:limits AS int[]))
               WITH ORDINALITY AS q(id, lim, ord)
          JOIN runs r ON r.id = q.id
    ),
    earlier AS (
        SELECT me.ord, x.id, x.status, x.input, x.attempt, x.created_at
          FROM me CROSS JOIN LATERAL (
               SELECT r.id, r.status, r.input, r.attempt, r.created_at
                 FROM runs r
                WHERE r.session_id = me.session_id AND r.user_id = me.user_id
                  AND (r.created_at, r.id) < (me.created_at, me.id)
                  AND r.status = ANY(CAST(:statuses AS text[]))
                ORDER BY r.created_at DESC, r.id DESC
                LIMIT me.lim) x
    )
    SELECT e.ord, e.id, e.status, e.input,
           {visible_output_sql("e.id")} AS answer,
           COALESCE((SELECT sum(l.completion_tokens) FROM ledger l
                      WHERE l.run_id = e.id AND l.attempt = e.attempt
                        AND l.kind = :chat_call),
                    0) AS answer_tokens
      FROM earlier e
     ORDER BY e.ord, e.created_at, e.id
    """  # noqa: S608 - fixed texts, rendered from constants
)
_SESSION_OWNER = text("SELECT 1 FROM sessions WHERE id = :session_id AND user_id = :user_id")
# Every run of a session (any status), the newest :limit, oldest first: the console.
_SESSION_RUNS = text(
    f"""
    SELECT r.id, r.status, r.input, r.error, r.created_at, r.finished_at,
           {visible_output_sql("r.id")} AS answer
      FROM (SELECT id, status, input, error, created_at, finished_at FROM runs
             WHERE session_id = :session_id AND user_id = :user_id
             ORDER BY created_at DESC, id DESC
             LIMIT :limit) r
     ORDER BY r.created_at, r.id
    """  # noqa: S608 - fixed texts, rendered from constants
)


@dataclass(frozen=True)
class SessionRun:
    """One run of a session as the console's conversation shows it."""

    run_id: str
    status: str
    messages: list[str]
    answer: str  # its visible output so far
    error: str | None
    created_at: datetime
    finished_at: datetime | None

    @property
    def cut(self) -> bool:
        """The answer was cut short (the run was cancelled)."""
        return self.status == RunStatus.CANCELLED.value


def turn_of(row: Any) -> Turn:
    """A row of ``_EARLIER_TURNS`` as a turn, its tokens counted."""
    inp = row.input if isinstance(row.input, dict) else {}
    messages = tuple(user_messages(inp))
    cut = row.status == RunStatus.CANCELLED.value
    answer = str(row.answer or "")
    tokens = turn_tokens(messages, answer, cut, int(row.answer_tokens or 0))
    return Turn(row.id, messages, answer, cut, tokens)


async def earlier_turns(
    conn: AsyncConnection, run_id: str, limit: int = MAX_TURNS
) -> Sequence[Turn]:
    """The turns before ``run_id`` in its session, oldest first (one statement): the
    context a run is loaded with (rules in koda/lifecycle/turns.py)."""
    return (await earlier_turns_of(conn, [(run_id, limit)]))[0]


async def earlier_turns_of(
    conn: AsyncConnection, wanted: Sequence[tuple[str, int]]
) -> list[list[Turn]]:
    """:func:`earlier_turns` of several runs in one statement: for each ``(run_id,
    limit)`` of ``wanted``, in order, its turns oldest first (none for a run that is
    not there)."""
    rows = await conn.execute(
        _EARLIER_TURNS,
        {
            "ids": [run_id for run_id, _ in wanted],
            "limits": [limit for _, limit in wanted],
            "statuses": TURN_STATUSES,
            "chat_call": _CHAT_CALL,
        },
    )
    out: list[list[Turn]] = [[] for _ in wanted]
    for row in rows:
        out[int(row.ord) - 1].append(turn_of(row))
    return out


# --- the Responses API -----------------------------------------------------------------

_RESPONSE = text(
    f"""
    SELECT r.id, r.session_id, r.status, r.created_at, r.finished_at, r.error, r.input,
           r.metadata,
           {visible_output_sql("r.id")} AS output,
           (SELECT count(*) FROM messages x
             WHERE x.run_id = r.id AND x.kind = :reset_kind) AS resets,
           u.calls, u.prompt, u.completion, u.cached, u.reasoning, u.model
      FROM runs r
      LEFT JOIN LATERAL (
           SELECT count(*) AS calls, sum(l.prompt_tokens) AS prompt,
                  sum(l.completion_tokens) AS completion, sum(l.cached_tokens) AS cached,
                  sum(l.reasoning_tokens) AS reasoning,
                  (array_agg(l.model ORDER BY l.attempt DESC, l.call_index DESC))[1] AS model
             FROM ledger l WHERE l.run_id = r.id AND l.kind = :chat_call) AS u ON true
     WHERE r.id = :run_id AND r.user_id = :user_id
    """  # noqa: S608 - fixed texts, rendered from constants
)


@dataclass(frozen=True)
class RunState:
    """What the gateway reads of a run for its Responses API object
    (gateway/responses_wire.py)."""

    run_id: str
    session_id: str
    status: str  # koda's run status
    created_at: datetime
    finished_at: datetime | None
    error: str | None
    output: str  # the chunks after the last reset
    resets: int
    input: Mapping[str, Any]
    metadata: Mapping[str, Any] | None
    model: str  # the model of the run's last chat call, else the served one
    usage: tuple[int, int, int, int] | None  # prompt, completion, cached, reasoning


# --- koda traces show ------------------------------------------------------------------

_RUN_TRACE = text("SELECT traceparent FROM runs WHERE id = :run_id")


class RunNotFound(KodaError, LookupError):
    """No run has that id."""


def run_traceparent(engine: Engine, run_id: str) -> str | None:
    """The W3C trace context recorded for a run at admission (``runs.traceparent``;
    None: not traced). Raises RunNotFound when no run has that id."""
    with failing_as("reading a run's trace"), engine.connect() as conn:
        row = conn.execute(_RUN_TRACE, {"run_id": run_id}).first()
    if row is None:
        raise RunNotFound(f"no run {run_id}")
    traceparent: str | None = row.traceparent
    return traceparent


# --- the reader ------------------------------------------------------------------------


class RunReads:
    """The gateway's reads of runs, sessions and their messages (one per request)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    async def get_run(self, run_id: str, user_id: str) -> RunView | None:
        """The run if it exists and belongs to ``user_id``; None otherwise (indistinguishable)."""
        if not _storable(run_id):
            return None
        with failing_as("reading a run"):
            async with self.engine.connect() as conn:
                row = (await conn.execute(_GET_RUN, {"run_id": run_id, "user_id": user_id})).first()
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

    async def stream_head(self, run_id: str, user_id: str) -> StreamHead | None:
        """The run's status if it belongs to ``user_id`` (None otherwise, indistinguishable)."""
        if not _storable(run_id):
            return None
        with failing_as("reading a run"):
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
        return StreamHead(status, None if through is None else int(through), traceparent)

    async def expired_output_seq(self, run_id: str) -> int | None:
        """The seq of the one row holding the whole output of a run whose chunks expired
        (KODA_CHUNK_RETENTION); None while they are kept, or when it has no such row."""
        with failing_as("reading a run"):
            async with self.engine.connect() as conn:
                seq = (await conn.execute(_OUTPUT_SEQ, {"run_id": run_id})).scalar()
        return None if seq is None else int(seq)

    async def terminal_seq(self, run_id: str) -> int | None:
        """The seq of the run's terminal event, or None if it has none (yet)."""
        with failing_as("reading a run"):
            async with self.engine.connect() as conn:
                end = (
                    await conn.execute(_RUN_END, {"run_id": run_id, "terminal": _TERMINAL_KINDS})
                ).one()
        return None if end.terminal_seq is None else int(end.terminal_seq)

    async def events_after(
        self, run_id: str, after: int, limit: int
    ) -> tuple[RunStatus | None, list[StoredEvent]]:
        """The run's status, then up to ``limit`` messages with seq > ``after`` in order.

        The status is read first: when it is terminal, every message of the run was
        committed before it (the terminal transition and the last events share one
        transaction), so the rows that follow are all there will ever be.
        """
        with failing_as("reading run events"):
            async with self.engine.connect() as conn:
                status = (await conn.execute(_RUN_STATUS, {"run_id": run_id})).scalar()
                rows = (
                    await conn.execute(
                        _EVENTS_AFTER, {"run_id": run_id, "after": after, "limit": limit}
                    )
                ).all()
        events = [StoredEvent(int(r.seq), r.kind, r.content, int(r.attempt)) for r in rows]
        return (None if status is None else RunStatus(status)), events

    async def last_reset(self, run_id: str) -> int | None:
        """The seq of the run's last ``reset`` (its current answer starts after it), or
        None when it has none."""
        with failing_as("reading a run's resets"):
            async with self.engine.connect() as conn:
                seq = (
                    await conn.execute(_LAST_RESET, {"run_id": run_id, "kind": _RESET_KIND})
                ).scalar()
        return None if seq is None else int(seq)

    async def timeline(self, run_id: str, user_id: str) -> Timeline | None:
        """The run's lifecycle if it belongs to ``user_id``: its row, its messages other
        than text chunks, its chunks per attempt and its cost; None otherwise."""
        if not _storable(run_id):
            return None
        with failing_as("reading a run's timeline"):
            async with self.engine.connect() as conn:
                run = (
                    await conn.execute(_TIMELINE_RUN, {"run_id": run_id, "user_id": user_id})
                ).first()
                if run is None:
                    return None
                params = {"run_id": run_id, "chunk": _ANSWER_KIND}
                events = (await conn.execute(_TIMELINE_EVENTS, params)).all()
                chunks = (await conn.execute(_TIMELINE_CHUNKS, params)).all()
                cost, calls = await ledger.run_cost(conn, run_id)
        return Timeline(
            run=run,
            events=[
                TimelineEvent(e.seq, e.kind, e.content, e.attempt, e.created_at) for e in events
            ],
            attempts=[AttemptChunks(c.attempt, c.chunks, c.first_at, c.last_at) for c in chunks],
            cost_usd=cost,
            billable_calls=calls,
        )

    async def session_runs(
        self, session_id: str, user_id: str, limit: int = MAX_TURNS
    ) -> list[SessionRun] | None:
        """The session's latest ``limit`` runs (any status), oldest first, if the session
        is ``user_id``'s; None otherwise."""
        params = {"session_id": session_id, "user_id": user_id, "limit": limit}
        with failing_as("reading a session's turns"):
            async with self.engine.connect() as conn:
                if (await conn.execute(_SESSION_OWNER, params)).first() is None:
                    return None
                rows = (await conn.execute(_SESSION_RUNS, params)).all()
        return [
            SessionRun(
                run_id=r.id,
                status=r.status,
                messages=user_messages(r.input if isinstance(r.input, dict) else {}),
                answer=r.answer,
                error=r.error,
                created_at=r.created_at,
                finished_at=r.finished_at,
            )
            for r in rows
        ]

    async def response_state(self, run_id: str, user_id: str, served_model: str) -> RunState | None:
        """The run as its Responses object shows it, if it is ``user_id``'s; None
        otherwise. ``served_model`` names the model of a run without a chat call."""
        if not _storable(run_id):
            return None
        with failing_as("reading a response"):
            async with self.engine.connect() as conn:
                params = {
                    "run_id": run_id,
                    "user_id": user_id,
                    "reset_kind": _RESET_KIND,
                    "chat_call": _CHAT_CALL,
                }
                row = (await conn.execute(_RESPONSE, params)).first()
        if row is None:
            return None
        usage = None
        if row.calls:
            usage = (int(row.prompt), int(row.completion), int(row.cached), int(row.reasoning))
        return RunState(
            run_id=row.id,
            session_id=row.session_id,
            status=row.status,
            created_at=row.created_at,
            finished_at=row.finished_at,
            error=row.error,
            output=row.output,
            resets=int(row.resets),
            input=row.input if isinstance(row.input, dict) else {},
            metadata=row.metadata if isinstance(row.metadata, dict) else None,
            model=row.model or served_model,
            usage=usage,
        )


def _storable(run_id: str) -> bool:
    """False for an id Postgres text cannot hold (NUL): no run has it, and sending it
    would fail as a database error, a 503 for what is a client's unknown id."""
    return "\x00" not in run_id
