"""What a handler uses for memory: search, auto-inject; what the distiller uses to
remember a finished run's statements (processors/memory/distiller.py).

Built once per worker on the worker's own engine (no extra pool). Every method takes
the run's user from the worker's RunContext, never from model output.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from koda_runtime.lifecycle.handler import RunContext, Usage
from koda_runtime.processors.memory import store, tool
from koda_runtime.processors.memory.distil import Statement, statements_to_chunks
from koda_runtime.processors.memory.embedders import Embedded, Embedder, OpenAIEmbedder, wordllama
from koda_runtime.schemas import memories
from koda_runtime.settings import Settings

EMBEDDING_PREFIX = "embedding:"


def embedding_usage(embedded: Embedded) -> Usage:
    """An embedding call as a ledger row of kind ``embedding``: its input tokens, no
    completion. The model keeps its ``embedding:`` prefix, so the usage table (which has
    no kind) still tells the two kinds apart."""
    return Usage(EMBEDDING_PREFIX + embedded.model, embedded.tokens, 0, kind="embedding")


def build_embedder(settings: Settings) -> Embedder:
    if settings.embedder == "openai":
        return OpenAIEmbedder(
            settings.openai_base_url, settings.openai_api_key, settings.embeddings_model
        )
    return wordllama()


@dataclass
class MemoryService:
    engine: AsyncEngine
    embedder: Embedder
    auto_inject: int = 0
    min_score: float = tool.MIN_SCORE
    plan: memories.Plan = memories.DEFAULT_PLAN
    max_per_user: int = 0  # KODA_MAX_MEMORIES_PER_USER; 0: no cap

    async def embed(self, statements: list[Statement]) -> tuple[list[Statement], Embedded]:
        """The statements as memories (one each; a long one chunked) and their vectors."""
        chunks = statements_to_chunks(statements)
        return chunks, await self.embedder.embed([c.text for c in chunks])

    async def store(
        self,
        conn: AsyncConnection,
        *,
        user_id: str,
        run_id: str | None,
        chunks: list[Statement],
        embedded: Embedded,
        said_at: datetime | None = None,
    ) -> store.Stored:
        """Store embedded memories in ``conn``'s transaction by the truth rules
        (processors/memory/store.py: store_statements)."""
        return await store.store_statements(
            conn,
            user_id=user_id,
            run_id=run_id,
            texts=[c.text for c in chunks],
            vectors=embedded.vectors,
            embedder=self.embedder.name,
            max_per_user=self.max_per_user,
            subjects=[c.subject for c in chunks],
            said_at=said_at,
        )

    async def remember(
        self,
        user_id: str,
        run_id: str | None,
        statements: list[Statement],
        said_at: datetime | None = None,
    ) -> list[Usage]:
        """Chunk, embed and store ``statements`` for the user in a transaction of their
        own; the embedding call's usage. Writing the same again adds nothing."""
        if not statements:
            return []
        chunks, embedded = await self.embed(statements)
        if not chunks:
            return []
        async with self.engine.begin() as conn:
            await self.store(
                conn,
                user_id=user_id,
                run_id=run_id,
                chunks=chunks,
                embedded=embedded,
                said_at=said_at,
            )
        return [embedding_usage(embedded)]

    async def search_tool(self, ctx: RunContext, raw_args: str) -> tuple[str, list[Usage]]:
        """The ``memory_search`` tool for the run's user: the text for the model."""
        result = await tool.memory_search(
            raw_args,
            user_id=ctx.user_id,
            engine=self.engine,
            embedder=self.embedder,
            min_score=self.min_score,
            plan=self.plan,
        )
        usage = [embedding_usage(result.embedded)] if result.embedded else []
        return result.content, usage

    async def for_prompt(self, ctx: RunContext, query: str) -> tuple[list[str], list[Usage]]:
        """The ``auto_inject`` memories most relevant to ``query`` (none when off)."""
        if not self.auto_inject or not query.strip():
            return [], []
        embedded = await self.embedder.embed([query[:1000]])
        hits = await memories.search(
            self.engine,
            user_id=ctx.user_id,
            embedder=self.embedder.name,
            vector=embedded.vectors[0],
            limit=self.auto_inject,
            min_score=self.min_score,
            plan=self.plan,
        )
        return [h.text for h in hits], [embedding_usage(embedded)]


def build_memory(settings: Settings, engine: AsyncEngine | None) -> MemoryService | None:
    if engine is None or not settings.memory_enabled:
        return None
    return MemoryService(
        engine,
        build_embedder(settings),
        auto_inject=settings.memory_auto_inject,
        max_per_user=settings.max_memories_per_user,
    )
