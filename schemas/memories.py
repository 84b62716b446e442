"""The ``memories`` and ``memory_distillations`` tables: every statement on them.

Lists and forgetting are shared by the gateway (``/v1/memories``), the operators' CLI
(``koda memories``) and the workers; the workers' writes by the truth rules
(processors/memory/store.py decides, the statements are here), their search, the
re-embedding, the distillation markers (processors/memory/distiller.py) and the
replay's export.

Every statement is scoped by the ``user_id`` its caller authenticated or was given
(never by anything a model wrote).
Lists hold superseded memories too (``superseded_by`` names the newer statement that
replaced one; processors/memory/truth.py): kept for audit, never searched. Lists are
keyset pages, newest first: (created_at, id) descending, each page after the
position of the previous page's last memory, so a page never repeats or skips a
memory, whatever was forgotten meanwhile.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from sqlalchemy import Connection, text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

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


def to_pgvector(vector: list[float]) -> str:
    """The text form pgvector parses: ``[0.1,0.2,...]``."""
    return "[" + ",".join(f"{x:.7g}" for x in vector) + "]"


# -- the workers' writes (the truth rules: processors/memory/store.py) ----------------

_LOCK_USER = text(
    "SELECT pg_advisory_xact_lock(hashtextextended(current_schema() || '/memories/' || :u, 0))"
)
_HELD = text("SELECT count(*) FROM memories WHERE user_id = :u")
_NOW = text("SELECT now()")
# The user's current rows of the embedder, and the row of the same text whatever its
# state or embedder (the unique key): each with its cosine score against the new one.
_NEIGHBOURS = text(
    "SELECT id, text, content_hash, subject, said_at, superseded_by, embedder,"
    " 1 - (embedding OPERATOR(public.<=>) CAST(:q AS public.vector)) AS score"
    " FROM memories WHERE user_id = :u"
    " AND ((embedder = :e AND superseded_by IS NULL) OR content_hash = :h)"
)
_REFRESH = text("UPDATE memories SET said_at = greatest(said_at, :t) WHERE id = :id")
_INSERT = text(
    "INSERT INTO memories (id, user_id, text, content_hash, embedding, embedder, run_id,"
    " subject, said_at, superseded_by, superseded_at) VALUES (:id, :user_id, :text, :hash,"
    " CAST(:embedding AS public.vector), :embedder, :run_id, :subject, :t, :by,"
    " CASE WHEN CAST(:by AS text) IS NULL THEN NULL ELSE now() END)"
    " ON CONFLICT (user_id, content_hash) DO NOTHING"
)
# The same text said again after it was superseded (or under another embedder): the
# row comes back with the new statement's vector, subject, time and run.
_REVIVE = text(
    "UPDATE memories SET text = :text, embedding = CAST(:embedding AS public.vector),"
    " embedder = :embedder, run_id = :run_id, subject = :subject, said_at = :t,"
    " superseded_by = :by,"
    " superseded_at = CASE WHEN CAST(:by AS text) IS NULL THEN NULL ELSE now() END"
    " WHERE id = :id"
)
_SUPERSEDE = text(
    "UPDATE memories SET superseded_by = :by, superseded_at = now()"
    " WHERE id = ANY(:ids) AND user_id = :u"
)


@dataclass(frozen=True)
class Statement:
    """One statement to store for a user: its text, content hash, vector (pgvector
    text), embedder, run, subject, when it was said, and the newer memory that
    supersedes it already (None: current)."""

    user_id: str
    text: str
    content_hash: str
    embedding: str
    embedder: str
    run_id: str | None
    subject: str | None
    said_at: datetime
    superseded_by: str | None

    def params(self, memory_id: str) -> dict[str, Any]:
        return {
            "id": memory_id,
            "user_id": self.user_id,
            "text": self.text,
            "hash": self.content_hash,
            "embedding": self.embedding,
            "embedder": self.embedder,
            "run_id": self.run_id,
            "subject": self.subject,
            "t": self.said_at,
            "by": self.superseded_by,
        }


async def lock_user(conn: AsyncConnection, user_id: str) -> None:
    """Take the user's memory lock, held to the transaction's end."""
    await conn.execute(_LOCK_USER, {"u": user_id})


async def held(conn: AsyncConnection, user_id: str) -> int:
    """How many rows the user has, superseded ones included."""
    return int((await conn.execute(_HELD, {"u": user_id})).scalar_one())


async def database_now(conn: AsyncConnection) -> datetime:
    """The transaction's time."""
    now: datetime = (await conn.execute(_NOW)).scalar_one()
    return now


async def neighbours(
    conn: AsyncConnection, user_id: str, embedder: str, content_hash: str, vector: str
) -> Sequence[Any]:
    """The user's current rows of ``embedder`` and the row of ``content_hash`` whatever
    its state or embedder, each with its cosine score against ``vector``."""
    params = {"u": user_id, "e": embedder, "h": content_hash, "q": vector}
    return (await conn.execute(_NEIGHBOURS, params)).all()


async def refresh(conn: AsyncConnection, memory_id: str, said_at: datetime) -> None:
    """A duplicate was said again: the kept row's ``said_at`` moves to the later time."""
    await conn.execute(_REFRESH, {"t": said_at, "id": memory_id})


async def insert(conn: AsyncConnection, memory_id: str, statement: Statement) -> int:
    """Store ``statement`` as row ``memory_id``; 1 when it was new, 0 when there was one."""
    result = await conn.execute(_INSERT, statement.params(memory_id))
    return int(result.rowcount or 0)


async def revive(conn: AsyncConnection, memory_id: str, statement: Statement) -> None:
    """Row ``memory_id`` (the same text) takes ``statement``'s vector, subject, time and run."""
    await conn.execute(_REVIVE, statement.params(memory_id))


async def supersede(conn: AsyncConnection, user_id: str, ids: list[str], by: str) -> None:
    """The user's rows ``ids`` are superseded by memory ``by``."""
    await conn.execute(_SUPERSEDE, {"by": by, "ids": ids, "u": user_id})


# -- search --------------------------------------------------------------------------

Plan = Literal["exact", "iterative", "hnsw"]
PLANS: tuple[Plan, ...] = ("exact", "iterative", "hnsw")
DEFAULT_PLAN: Plan = "exact"


@dataclass(frozen=True)
class Hit:
    id: str
    text: str
    score: float


_EXACT = (
    "WITH mine AS MATERIALIZED ("
    " SELECT id, text, embedding FROM memories WHERE user_id = :user_id"
    " AND embedder = :embedder AND superseded_by IS NULL)"
    " SELECT id, text, 1 - (embedding OPERATOR(public.<=>) CAST(:q AS public.vector)) AS score"
    " FROM mine ORDER BY embedding OPERATOR(public.<=>) CAST(:q AS public.vector) LIMIT :k"
)
_INDEXED = (
    "SELECT id, text, 1 - (embedding OPERATOR(public.<=>) CAST(:q AS public.vector)) AS score"
    " FROM memories WHERE user_id = :user_id AND embedder = :embedder"
    " AND superseded_by IS NULL"
    " ORDER BY embedding OPERATOR(public.<=>) CAST(:q AS public.vector) LIMIT :k"
)
_PLAN_SETTINGS = text(
    "SELECT set_config('hnsw.iterative_scan', :mode, true),"
    " set_config('hnsw.ef_search', :ef, true),"
    " set_config('hnsw.max_scan_tuples', :max, true),"
    # Else the planner takes the user_id index and sorts: the exact plan.
    " set_config('enable_sort', 'off', true)"
)


def explain_sql(plan: Plan) -> str:
    return "EXPLAIN " + (_EXACT if plan == "exact" else _INDEXED)


async def search(
    engine: AsyncEngine,
    *,
    user_id: str,
    embedder: str,
    vector: list[float],
    limit: int,
    min_score: float = 0.0,
    plan: Plan = DEFAULT_PLAN,
    ef_search: int = 40,
    max_scan_tuples: int = 20000,
) -> list[Hit]:
    """The user's ``limit`` current memories of ``embedder`` (the one that made
    ``vector``: another's vectors are never compared) nearest ``vector`` (cosine), best
    first, each with its score (1 - cosine distance) at least ``min_score``. Superseded
    memories are never returned.

    Plans (figures in docs/decisions/0021-long-term-memory.md), each reading only the
    user's current rows of the embedder:

    * ``exact``: the user's rows through ``ix_memories_current``, distances computed
      for each, top-k. Recall 1 by construction; the chosen plan.
    * ``iterative``: the HNSW index with pgvector 0.8's ``hnsw.iterative_scan`` so the
      user filter is applied while the graph scan goes on until ``limit`` rows pass it
      (or ``hnsw.max_scan_tuples`` are visited).
    * ``hnsw``: the HNSW index then the filter (pgvector before 0.8): ``hnsw.ef_search``
      candidates of everybody's, of which the user's few survive.
    """
    params = {"user_id": user_id, "embedder": embedder, "q": to_pgvector(vector), "k": limit}
    async with engine.begin() as conn:
        if plan == "exact":
            rows = (await conn.execute(text(_EXACT), params)).all()
        else:
            mode = "strict_order" if plan == "iterative" else "off"
            await conn.execute(
                _PLAN_SETTINGS, {"mode": mode, "ef": str(ef_search), "max": str(max_scan_tuples)}
            )
            rows = (await conn.execute(text(_INDEXED), params)).all()
    return [Hit(r.id, r.text, float(r.score)) for r in rows if float(r.score) >= min_score]


# -- re-embedding after KODA_EMBEDDER changed (`koda memories reembed`) ----------------
# The rows of any other embedder, in id order, a batch per transaction.

_TO_REEMBED = text("SELECT count(*) FROM memories WHERE embedder <> :e")
_REEMBED_BATCH = text(
    "SELECT id, text FROM memories WHERE embedder <> :e AND id > :after ORDER BY id LIMIT :n"
)
_REEMBED = text(
    "UPDATE memories m SET embedding = CAST(v.embedding AS public.vector), embedder = :e"
    " FROM unnest(CAST(:ids AS text[]), CAST(:vectors AS text[])) AS v(id, embedding)"
    " WHERE m.id = v.id AND m.embedder <> :e"
)


async def to_reembed(engine: AsyncEngine, embedder: str) -> int:
    """How many memories were embedded by another embedder than ``embedder``."""
    async with engine.connect() as conn:
        return int((await conn.execute(_TO_REEMBED, {"e": embedder})).scalar_one())


async def not_embedded_by(
    engine: AsyncEngine, embedder: str, *, after: str, limit: int
) -> Sequence[Any]:
    """The next ``limit`` rows (``id``, ``text``) by id after ``after`` of another
    embedder than ``embedder``."""
    async with engine.connect() as conn:
        params = {"e": embedder, "after": after, "n": limit}
        return (await conn.execute(_REEMBED_BATCH, params)).all()


async def store_embeddings(
    engine: AsyncEngine, embedder: str, ids: list[str], vectors: list[list[float]]
) -> int:
    """Store ``embedder``'s vectors of rows ``ids``, in one transaction; how many rows
    were updated (a row already of ``embedder`` is not)."""
    async with engine.begin() as conn:
        result = await conn.execute(
            _REEMBED,
            {"e": embedder, "ids": ids, "vectors": [to_pgvector(v) for v in vectors]},
        )
    return int(result.rowcount or 0)


# -- distillation markers (processors/memory/distiller.py) --------------------------

# Sent by the worker's group write (schemas/runs/worker.py) after the finishes'
# transition, in the same transaction: only a run that is now ``done`` gets a marker,
# so a finish the transaction rolls back leaves none.
MARK_DISTIL = text(
    "INSERT INTO memory_distillations (run_id, user_id)"
    " SELECT id, user_id FROM runs WHERE id = ANY(:ids) AND status = 'done'"
    " ON CONFLICT (run_id) DO NOTHING"
)
_CLAIM_DISTIL = text(
    """
    UPDATE memory_distillations d
       SET due_at = now() + make_interval(secs => :lease), tries = d.tries + 1
     WHERE d.run_id IN (SELECT run_id FROM memory_distillations
                         WHERE gave_up_at IS NULL AND due_at <= now()
                         ORDER BY due_at LIMIT :n FOR UPDATE SKIP LOCKED)
    RETURNING d.run_id, d.user_id, d.tries
    """
)
_DISTIL_RUN = text("SELECT user_id, input, attempt, status, created_at FROM runs WHERE id = :r")
_STILL_MINE = text("SELECT 1 FROM memory_distillations WHERE run_id = :r AND tries = :t FOR UPDATE")
_DISTILLED = text("DELETE FROM memory_distillations WHERE run_id = :r AND tries = :t")
_DISTIL_FAILED = text(
    """
    UPDATE memory_distillations
       SET due_at = now() + make_interval(secs => :wait), last_error = :error,
           gave_up_at = CASE WHEN tries >= :max THEN now() END
     WHERE run_id = :r AND tries = :t
    """
)


@dataclass(frozen=True)
class Taken:
    """A distillation marker taken for a try: its run, user and try number."""

    run_id: str
    user_id: str
    tries: int


async def take_due(engine: AsyncEngine, *, lease_s: float, limit: int) -> list[Taken]:
    """Take at most ``limit`` due markers for a try each: their ``due_at`` moves a
    lease ahead, so a worker that dies leaves them to any other after it."""
    async with engine.begin() as conn:
        rows = (await conn.execute(_CLAIM_DISTIL, {"lease": lease_s, "n": limit})).all()
    return [Taken(r.run_id, r.user_id, int(r.tries)) for r in rows]


async def distil_source(engine: AsyncEngine, run_id: str) -> Any | None:
    """The run a marker names (``user_id``, ``input``, ``attempt``, ``status``,
    ``created_at``); None when it is gone."""
    async with engine.connect() as conn:
        return (await conn.execute(_DISTIL_RUN, {"r": run_id})).first()


async def still_taken(conn: AsyncConnection, taken: Taken) -> bool:
    """Whether the marker is still this try's, locking it to the transaction's end."""
    return (
        await conn.execute(_STILL_MINE, {"r": taken.run_id, "t": taken.tries})
    ).first() is not None


async def distilled(conn: AsyncConnection, taken: Taken) -> None:
    """The try is done: its marker goes (unless another try took it since)."""
    await conn.execute(_DISTILLED, {"r": taken.run_id, "t": taken.tries})


async def distil_failed(
    conn: AsyncConnection, taken: Taken, *, wait_s: float, error: str, max_tries: int
) -> None:
    """The try failed: the marker is due again in ``wait_s``, given up after
    ``max_tries`` (``gave_up_at``, ``last_error`` stay for operators)."""
    params = {"r": taken.run_id, "t": taken.tries, "wait": wait_s, "error": error, "max": max_tries}
    await conn.execute(_DISTIL_FAILED, params)


# -- the replay's export (topics/replay/export.py) ----------------------------------

_EXPORT = text(
    """
    SELECT id, user_id, text, embedder, run_id, created_at
      FROM memories
     WHERE id > :after
       AND (CAST(:since AS timestamptz) IS NULL
            OR created_at >= CAST(:since AS timestamptz))
     ORDER BY id LIMIT :n
    """
)


def export_page(
    conn: Connection, *, after: str, since: datetime | None, limit: int
) -> Sequence[Any]:
    """Memories (without their embeddings) by id after ``after``, created at or after
    ``since`` (None: all), at most ``limit``."""
    return conn.execute(_EXPORT, {"after": after, "since": since, "n": limit}).all()
