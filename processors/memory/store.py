"""Storing a user's statements as memories by the truth rules
(processors/memory/truth.py), and re-embedding them after the embedder changed.

The statements on ``memories`` are schemas/memories.py's; every one names the user
from the caller's argument (the run's user), never from anything a model wrote.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from koda_runtime import metrics
from koda_runtime.processors.memory import truth
from koda_runtime.processors.memory.chunking import content_hash
from koda_runtime.processors.memory.embedders import Embedder
from koda_runtime.schemas import memories
from koda_runtime.schemas.memories import to_pgvector

log = logging.getLogger(__name__)


def memory_id(user_id: str, digest: str) -> str:
    """Derived from the user and the content, so a retried write names the same row."""
    return "mem_" + hashlib.sha256(f"{user_id}\x00{digest}".encode()).hexdigest()[:24]


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
    await memories.lock_user(conn, user_id)
    room: int | None = None
    if max_per_user:
        room = max_per_user - await memories.held(conn, user_id)
    when = said_at if said_at is not None else await memories.database_now(conn)
    threshold = truth.duplicate_score(embedder)
    out = Stored()
    for chunk_text, vector, subject in zip(texts, vectors, keys, strict=True):
        digest = content_hash(chunk_text)
        q = to_pgvector(vector)
        found = await memories.neighbours(conn, user_id, embedder, digest, q)
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
            await memories.refresh(conn, kept.id, when)
            out.duplicates += 1
            continue
        same = [r for r in current if r is not exact and truth.supersedes(subject, r.subject)]
        later = [r for r in same if r.said_at > when]
        by = max(later, key=lambda r: r.said_at).id if later else None
        statement = memories.Statement(
            user_id, chunk_text, digest, q, embedder, run_id, subject, when, by
        )
        if exact is not None:
            new_id = exact.id
            await memories.revive(conn, new_id, statement)
        else:
            if room is not None and out.new >= room:
                out.not_stored += 1
                continue
            new_id = memory_id(user_id, digest)
            out.new += await memories.insert(conn, new_id, statement)
        if by is not None:
            out.superseded += 1
        elif same:
            ids = [r.id for r in same]
            await memories.supersede(conn, user_id, ids, new_id)
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
    rows = await memories.not_embedded_by(engine, embedder.name, after=after, limit=limit)
    if not rows:
        return None
    embedded = await embedder.embed([r.text for r in rows])
    updated = await memories.store_embeddings(
        engine, embedder.name, [r.id for r in rows], embedded.vectors
    )
    return Batch(len(rows), updated, rows[-1].id, embedded.tokens)
