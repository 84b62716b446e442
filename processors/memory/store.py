"""The ``memories`` table: idempotent writes, per-user search, list and forget.

Every statement names the user in its WHERE clause from the caller's argument (the
run's user, or the authenticated caller), never from anything a model wrote.

Search plans (figures in ARCHITECTURE.md, "Long-term memory"):

* ``exact``: the user's rows through ``ix_memories_user_created``, distances computed
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
from dataclasses import dataclass
from typing import Literal

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from koda_runtime import metrics
from koda_runtime.processors.memory.chunking import content_hash
from koda_runtime.schemas.memories import Memory, forget, list_for

__all__ = ["Hit", "Memory", "forget", "insert", "list_for", "memory_id", "search"]
from koda_runtime.processors.memory.embedders import to_pgvector

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


async def insert(
    conn: AsyncConnection,
    *,
    user_id: str,
    run_id: str | None,
    texts: list[str],
    vectors: list[list[float]],
    embedder: str,
    max_per_user: int = 0,
) -> int:
    """Insert the chunks not yet remembered for the user; return how many were new.

    ``ON CONFLICT (user_id, content_hash) DO NOTHING``: a redelivered run, a retried
    attempt or the same fact said twice never makes a second row.

    With ``max_per_user`` (0: no cap, KODA_MAX_MEMORIES_PER_USER) a user keeps at most
    that many: counted under a per-user lock held to the caller's commit, and the
    chunks beyond the room left are not stored (logged, and counted in
    ``koda_quota_refusals_total{quota="memories"}``); the run goes on. Forgetting
    memories makes room again."""
    if len(texts) != len(vectors):
        raise ValueError(f"{len(texts)} texts but {len(vectors)} vectors")
    room: int | None = None
    if max_per_user:
        await conn.execute(_LOCK_USER, {"u": user_id})
        room = max_per_user - int((await conn.execute(_HELD, {"u": user_id})).scalar_one())
    new = 0
    not_stored = 0
    for chunk_text, vector in zip(texts, vectors, strict=True):
        if room is not None and new >= room:
            not_stored += 1
            continue
        digest = content_hash(chunk_text)
        result = await conn.execute(
            text(
                "INSERT INTO memories (id, user_id, text, content_hash, embedding, embedder, "
                "run_id) VALUES (:id, :user_id, :text, :hash, CAST(:embedding AS public.vector), "
                ":embedder, :run_id) ON CONFLICT (user_id, content_hash) DO NOTHING"
            ),
            {
                "id": memory_id(user_id, digest),
                "user_id": user_id,
                "text": chunk_text,
                "hash": digest,
                "embedding": to_pgvector(vector),
                "embedder": embedder,
                "run_id": run_id,
            },
        )
        new += result.rowcount or 0
    if not_stored:
        metrics.QUOTA_REFUSALS.labels(quota="memories").inc(not_stored)
        log.warning(
            "event=memory_cap_reached user_id=%s run_id=%s cap=%d not_stored=%d",
            user_id,
            run_id or "-",
            max_per_user,
            not_stored,
        )
    return new


_EXACT = (
    "WITH mine AS MATERIALIZED ("
    " SELECT id, text, embedding FROM memories WHERE user_id = :user_id)"
    " SELECT id, text, 1 - (embedding OPERATOR(public.<=>) CAST(:q AS public.vector)) AS score"
    " FROM mine ORDER BY embedding OPERATOR(public.<=>) CAST(:q AS public.vector) LIMIT :k"
)
_INDEXED = (
    "SELECT id, text, 1 - (embedding OPERATOR(public.<=>) CAST(:q AS public.vector)) AS score"
    " FROM memories WHERE user_id = :user_id"
    " ORDER BY embedding OPERATOR(public.<=>) CAST(:q AS public.vector) LIMIT :k"
)


def explain_sql(plan: Plan) -> str:
    return "EXPLAIN " + (_EXACT if plan == "exact" else _INDEXED)


async def search(
    engine: AsyncEngine,
    *,
    user_id: str,
    vector: list[float],
    limit: int,
    min_score: float = 0.0,
    plan: Plan = DEFAULT_PLAN,
    ef_search: int = 40,
    max_scan_tuples: int = 20000,
) -> list[Hit]:
    """The user's ``limit`` memories nearest ``vector`` (cosine), best first, each with
    its score (1 - cosine distance) at least ``min_score``."""
    params = {"user_id": user_id, "q": to_pgvector(vector), "k": limit}
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
