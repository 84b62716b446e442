"""What a handler uses for memory: remember a run's statements, search, auto-inject.

Built once per worker on the worker's own engine (no extra pool). Every method takes
the run's user from the worker's RunContext, never from model output.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncEngine

from koda_runtime.lifecycle.handler import RunContext, Usage
from koda_runtime.processors.memory import store, tool
from koda_runtime.processors.memory.distil import statements_to_chunks
from koda_runtime.processors.memory.embedders import Embedded, Embedder, OpenAIEmbedder, wordllama
from koda_runtime.settings import Settings

EMBEDDING_PREFIX = "embedding:"
Hook = Callable[[], Awaitable[None]]


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
    plan: store.Plan = store.DEFAULT_PLAN
    max_per_user: int = 0  # KODA_MAX_MEMORIES_PER_USER; 0: no cap

    async def remember(
        self,
        ctx: RunContext,
        statements: list[str],
        *,
        before_insert: Hook | None = None,
        after_insert: Hook | None = None,
    ) -> list[Usage]:
        """Chunk, embed and insert ``statements`` for the run's user; idempotent, so an
        attempt cut off anywhere in here and run again adds nothing twice. The hooks
        are the demo handler's test points."""
        chunks = statements_to_chunks(statements)
        if not chunks:
            return []
        embedded = await self.embedder.embed(chunks)
        if before_insert is not None:
            await before_insert()
        async with self.engine.begin() as conn:
            await store.insert(
                conn,
                user_id=ctx.user_id,
                run_id=ctx.run_id,
                texts=chunks,
                vectors=embedded.vectors,
                embedder=embedded.model,
                max_per_user=self.max_per_user,
            )
        if after_insert is not None:
            await after_insert()
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
        hits = await store.search(
            self.engine,
            user_id=ctx.user_id,
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
