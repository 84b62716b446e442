"""The ``memories`` table: writes by the truth rules, per-user search, re-embedding,
list and forget.

Every statement names the user in its WHERE clause from the caller's argument (the
run's user, or the authenticated caller), never from anything a model wrote.

Search plans (figures in ARCHITECTURE.md, "Long-term memory"):

Every search reads only the user's current rows (not superseded) of the embedder that
made the query's vector.

* ``exact``: the user's rows through ``ix_memories_current``, distances computed
  for each, top-k. Recall 1 by construction; the chosen plan.
* ``iterative``: the HNSW index with pgvector 0.8's ``hnsw.iterative_scan`` so the
  user filter is applied while the graph scan goes on until ``limit`` rows pass it
  (or ``hnsw.max_scan_tuples`` are visited).
* ``hnsw``: the HNSW index then the filter (pgvector before 0.8): ``hnsw.ef_search``
  candidates of everybody's, of which the user's few survive.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Literal

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from koda_runtime import metrics
from koda_runtime.processors.memory import truth
from koda_runtime.processors.memory.chunking import content_hash
from koda_runtime.processors.memory.embedders import Embedder, to_pgvector
from koda_runtime.schemas.memories import Memory, forget, list_for

__all__ = [
    "Hit",
    "Memory",
    "Stored",
    "forget",
    "insert",
    "list_for",
    "memory_id",
    "reembed_batch",
    "search",
    "store_statements",
    "to_reembed",
]

log = logging.getLogger(__name__)

Plan = Literal["exact", "iterative", "hnsw"]
PLANS: tuple[Plan, ...] = ("exact", "iterative", "hnsw")
DEFAULT_PLAN: Plan = "exact"


@dataclass(frozen=True)
class Hit:
    id: str
    text: str
    score: float


def memory_id(user_id: str, digest: str) -> str:
    """Derived from the user and the content, so a retried write names the same row."""
    return "mem_" + hashlib.sha256(f"{user_id}\x00{digest}".encode()).hexdigest()[:24]


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


@dataclass
class Stored:
    """What one :func:`insert` did: rows added, duplicates refreshed, rows superseded
    (by the new statements, or a new statement found older than a kept one)."""

    new: int = 0
    duplicates: int = 0
    superseded: int = 0
    not_stored: int = 0


@dataclass
class _Row:
    id: str
    text: str
    content_hash: str
    subject: str | None
    said_at: datetime
    superseded_by: str | None
    embedder: str
    score: float | None


async def insert(
    conn: AsyncConnection,
    *,
    user_id: str,
    run_id: str | None,
    texts: list[str],
    vectors: list[list[float]],
    embedder: str,
    max_per_user: int = 0,
    subjects: Sequence[str | None] | None = None,
    said_at: datetime | None = None,
) -> int:
    """Store the chunks for the user by the truth rules (processors/memory/truth.py);
    return how many rows were new. See :func:`store_statements`."""
    stored = await store_statements(
        conn,
        user_id=user_id,
        run_id=run_id,
        texts=texts,
        vectors=vectors,
        embedder=embedder,
        max_per_user=max_per_user,
        subjects=subjects,
        said_at=said_at,
    )
    return stored.new


async def store_statements(
    conn: AsyncConnection,
    *,
    user_id: str,
    run_id: str | None,
    texts: list[str],
    vectors: list[list[float]],
    embedder: str,
    max_per_user: int = 0,
    subjects: Sequence[str | None] | None = None,
    said_at: datetime | None = None,
) -> Stored:
    """Store statements (``texts``, each with its vector and subject, said at
    ``said_at``: the run's creation time; now when None) for the user, in order, under a
    per-user lock held to the caller's commit.

    Each one, against the user's current memories of ``embedder``: the same text, or a
    duplicate by the embedder's calibrated score, adds nothing (the kept row's
    ``said_at`` moves to the later time); else it is stored, and the current rows of its
    subject are marked ``superseded_by`` it, unless one of them was said later: then it
    is the one stored as superseded. A retried write of the same statements changes
    nothing more (the id is derived from the user and the text).

    With ``max_per_user`` (0: no cap, KODA_MAX_MEMORIES_PER_USER) a user keeps at most
    that many rows, superseded ones included: the statements beyond the room left are
    not stored (logged, and counted in ``koda_quota_refusals_total{quota="memories"}``);
    the run goes on. Forgetting memories makes room again."""
    if len(texts) != len(vectors):
        raise ValueError(f"{len(texts)} texts but {len(vectors)} vectors")
    keys = list(subjects) if subjects is not None else [truth.subject_of(t) for t in texts]
    if len(keys) != len(texts):
        raise ValueError(f"{len(texts)} texts but {len(keys)} subjects")
    await conn.execute(_LOCK_USER, {"u": user_id})
    room: int | None = None
    if max_per_user:
        room = max_per_user - int((await conn.execute(_HELD, {"u": user_id})).scalar_one())
    when = said_at if said_at is not None else (await conn.execute(_NOW)).scalar_one()
    threshold = truth.duplicate_score(embedder)
    out = Stored()
    for chunk_text, vector, subject in zip(texts, vectors, keys, strict=True):
        digest = content_hash(chunk_text)
        q = to_pgvector(vector)
        found = await conn.execute(_NEIGHBOURS, {"u": user_id, "e": embedder, "h": digest, "q": q})
        rows = [
            _Row(
                r.id,
                r.text,
                r.content_hash,
                r.subject,
                r.said_at,
                r.superseded_by,
                r.embedder,
                float(r.score) if r.embedder == embedder else None,
            )
            for r in found
        ]
        exact = next((r for r in rows if r.content_hash == digest), None)
        current = [r for r in rows if r.superseded_by is None and r.embedder == embedder]
        marks = truth.numbers(chunk_text)
        dups = [
            r
            for r in current
            if truth.is_duplicate(
                r.score,
                r is exact,
                subject,
                r.subject,
                threshold,
                same_numbers=truth.numbers(r.text) == marks,
            )
        ]
        if dups:
            kept = max(dups, key=lambda r: (r is exact, r.score or 0.0))
            await conn.execute(_REFRESH, {"t": when, "id": kept.id})
            out.duplicates += 1
            continue
        same = [r for r in current if r is not exact and truth.supersedes(subject, r.subject)]
        later = [r for r in same if r.said_at > when]
        by = max(later, key=lambda r: r.said_at).id if later else None
        params = {
            "user_id": user_id,
            "text": chunk_text,
            "hash": digest,
            "embedding": q,
            "embedder": embedder,
            "run_id": run_id,
            "subject": subject,
            "t": when,
            "by": by,
        }
        if exact is not None:
            new_id = exact.id
            await conn.execute(_REVIVE, {**params, "id": new_id})
        else:
            if room is not None and out.new >= room:
                out.not_stored += 1
                continue
            new_id = memory_id(user_id, digest)
            result = await conn.execute(_INSERT, {**params, "id": new_id})
            out.new += result.rowcount or 0
        if by is not None:
            out.superseded += 1
        elif same:
            ids = [r.id for r in same]
            await conn.execute(_SUPERSEDE, {"by": new_id, "ids": ids, "u": user_id})
            out.superseded += len(ids)
    if out.not_stored:
        metrics.QUOTA_REFUSALS.labels(quota="memories").inc(out.not_stored)
        log.warning(
            "event=memory_cap_reached user_id=%s run_id=%s cap=%d not_stored=%d",
            user_id,
            run_id or "-",
            max_per_user,
            out.not_stored,
        )
    return out


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
    memories are never returned."""
    params = {"user_id": user_id, "embedder": embedder, "q": to_pgvector(vector), "k": limit}
    async with engine.begin() as conn:
        if plan == "exact":
            rows = (await conn.execute(text(_EXACT), params)).all()
        else:
            mode = "strict_order" if plan == "iterative" else "off"
            await conn.execute(
                text(
                    "SELECT set_config('hnsw.iterative_scan', :mode, true),"
                    " set_config('hnsw.ef_search', :ef, true),"
                    " set_config('hnsw.max_scan_tuples', :max, true),"
                    # Else the planner takes the user_id index and sorts: the exact plan.
                    " set_config('enable_sort', 'off', true)"
                ),
                {"mode": mode, "ef": str(ef_search), "max": str(max_scan_tuples)},
            )
            rows = (await conn.execute(text(_INDEXED), params)).all()
    return [Hit(r.id, r.text, float(r.score)) for r in rows if float(r.score) >= min_score]


# Re-embedding after KODA_EMBEDDER changed (`koda memories reembed`): the rows of any
# other embedder, in id order, a batch per transaction.
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


@dataclass(frozen=True)
class Batch:
    """One re-embedded batch: the rows read, those updated (a row another writer
    changed meanwhile is not), the id to continue after, and the embedding's tokens."""

    read: int
    updated: int
    last_id: str
    tokens: int


async def reembed_batch(
    engine: AsyncEngine, embedder: Embedder, *, after: str = "", limit: int = 100
) -> Batch | None:
    """Embed the next ``limit`` rows (by id, after ``after``) of another embedder with
    ``embedder`` and store the vectors, in one transaction; None when none are left.
    A row already of ``embedder`` is never read nor written again, so a run cut off
    anywhere and started again continues where the last commit left it."""
    async with engine.connect() as conn:
        rows = (
            await conn.execute(_REEMBED_BATCH, {"e": embedder.name, "after": after, "n": limit})
        ).all()
    if not rows:
        return None
    embedded = await embedder.embed([r.text for r in rows])
    async with engine.begin() as conn:
        result = await conn.execute(
            _REEMBED,
            {
                "e": embedder.name,
                "ids": [r.id for r in rows],
                "vectors": [to_pgvector(v) for v in embedded.vectors],
            },
        )
    return Batch(len(rows), int(result.rowcount or 0), rows[-1].id, embedded.tokens)
