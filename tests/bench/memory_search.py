"""memory_search: 100,000 memories over 1,000 users, three plans measured.

For each plan (schemas/memories.py: exact per-user scan, pgvector 0.8 iterative
HNSW scan, plain HNSW then filter) it runs the same queries through the tool's search
path (embed the query with WordLlama, then ``memories.search``) and prints p50/p99 latency
and recall@5 against the exact plan's answers. Goals: p99 <= 20 ms, recall >= 0.95.

    make bench-memory-search BENCH_ARGS="--memories 100000 --users 1000 --queries 1000"
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

import psycopg
from sqlalchemy import text

from koda_runtime.processors.memory import store
from koda_runtime.processors.memory.chunking import content_hash
from koda_runtime.processors.memory.embedders import wordllama
from koda_runtime.processors.memory.tool import MIN_SCORE
from koda_runtime.schemas import memories
from koda_runtime.schemas.db import async_engine
from koda_runtime.schemas.memories import to_pgvector
from tests.bench.common import Table, namespace, services
from tests.memory_corpus import PAIRS

SUBJECTS = "sister brother friend manager dog cat neighbour teacher son daughter".split()
PLACES = "Lisbon Porto Berlin Madrid Tokyo Paris Rome Oslo Lima Cairo Austin Dublin".split()
THINGS = "tea chess cello Rust tomatoes climbing sardines Volvo pens Radiohead bread".split()


def texts_for(rng: random.Random, n: int) -> list[str]:
    out = []
    for i in range(n):
        fact = PAIRS[rng.randrange(len(PAIRS))][0].rstrip(".")
        out.append(
            f"{fact}; my {rng.choice(SUBJECTS)} likes {rng.choice(THINGS)} "
            f"in {rng.choice(PLACES)} (note {i})."
        )
    return out


def fill(url: str, schema: str, memories: int, users: int, seed: int) -> float:
    rng = random.Random(seed)
    per_user = memories // users
    embedder = wordllama()
    started = time.perf_counter()
    with psycopg.connect(url) as conn:
        conn.execute(f'SET search_path = "{schema}"')
        conn.execute("DROP INDEX ix_memories_embedding_hnsw")
        with conn.cursor().copy(
            "COPY memories (id, user_id, text, content_hash, embedding, embedder) FROM STDIN"
        ) as copy:
            for u in range(users):
                texts = texts_for(rng, per_user)
                vectors = embedder.embed_sync(texts).vectors
                for t, v in zip(texts, vectors, strict=True):
                    digest = content_hash(t)
                    uid = f"user{u:04d}"
                    copy.write_row(
                        (store.memory_id(uid, digest), uid, t, digest, to_pgvector(v), "bench")
                    )
        conn.execute("SET maintenance_work_mem = '512MB'")
        conn.execute(
            "CREATE INDEX ix_memories_embedding_hnsw ON memories "
            "USING hnsw (embedding public.vector_cosine_ops)"
        )
        conn.execute("ANALYZE memories")
        conn.commit()
    return time.perf_counter() - started


async def measure(settings, users: int, queries: int, seed: int) -> Table:
    rng = random.Random(seed + 1)
    embedder = wordllama()
    asks = [
        (f"user{rng.randrange(users):04d}", PAIRS[rng.randrange(len(PAIRS))][1])
        for _ in range(queries)
    ]
    engine = async_engine(settings, pool_size=2)
    table = Table(
        f"memory_search: {queries} queries, limit 5, min score {MIN_SCORE}",
        ["plan", "p50 ms", "p99 ms", "mean ms", "recall@5 vs exact", "empty answers"],
    )
    truth: list[list[str]] = []
    try:
        for plan in memories.PLANS:
            # Warm the caches and the pool once per plan.
            for user, query in asks[:50]:
                vector = (await embedder.embed([query])).vectors[0]
                await memories.search(
                    engine, user_id=user, embedder=embedder.name, vector=vector, limit=5, plan=plan
                )
            took: list[float] = []
            answers: list[list[str]] = []
            for user, query in asks:
                t0 = time.perf_counter()
                vector = (await embedder.embed([query])).vectors[0]
                hits = await memories.search(
                    engine,
                    user_id=user,
                    embedder=embedder.name,
                    vector=vector,
                    limit=5,
                    min_score=MIN_SCORE,
                    plan=plan,
                )
                took.append((time.perf_counter() - t0) * 1000)
                answers.append([h.id for h in hits])
            if plan == "exact":
                truth = answers
            async with engine.begin() as conn:
                if plan != "exact":
                    await conn.execute(text("SET LOCAL enable_sort = off"))
                user, query = asks[0]
                vector = (await embedder.embed([query])).vectors[0]
                lines = (
                    await conn.execute(
                        text(memories.explain_sql(plan)),
                        {"user_id": user, "q": to_pgvector(vector), "k": 5},
                    )
                ).scalars()
                scan = next(line for line in lines if "Scan" in line)
                table.notes.append(f"{plan}: {scan.strip()}")
            relevant = sum(len(t) for t in truth)
            found = sum(len(set(a) & set(t)) for a, t in zip(answers, truth, strict=True))
            took.sort()
            table.add(
                plan,
                f"{statistics.median(took):.2f}",
                f"{took[int(len(took) * 0.99) - 1]:.2f}",
                f"{statistics.fmean(took):.2f}",
                f"{found / relevant:.3f}" if relevant else "n/a",
                str(sum(1 for a in answers if not a)),
            )
    finally:
        await engine.dispose()
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--memories", type=int, default=100_000)
    parser.add_argument("--users", type=int, default=1_000)
    parser.add_argument("--queries", type=int, default=1_000)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    with services() as stack, namespace(stack) as settings:
        loaded = fill(
            stack.database_url, settings.names.pg_schema(), args.memories, args.users, args.seed
        )
        table = asyncio.run(measure(settings, args.users, args.queries, args.seed))
        table.notes.append(
            f"{args.memories} memories over {args.users} users loaded and HNSW-indexed "
            f"(m=16, ef_construction=64) in {loaded:.0f} s; latency includes embedding the "
            "query with WordLlama; hnsw plans at ef_search=40, max_scan_tuples=20000"
        )
        print(table.render())


if __name__ == "__main__":
    main()
