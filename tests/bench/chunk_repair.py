"""What it costs to know which finished runs the chunk topic lacks, and to fill them.

Writes N finished runs of M messages each into Postgres and onto the chunk topic (as
workers would), a fraction of them with the end missing on the topic and
``published_seq`` null (a worker died between its commit and its produce), the rest
marked whole. Then prints:

* the completeness pass's scan (the partial index on unmarked finished runs) with
  every run marked but the gapped ones: what a pass costs each round;
* ``koda chunks verify``'s way, reading the whole topic and Postgres's messages:
  what a pass would cost each round without a marker in Postgres;
* the pass itself, filling the gapped runs (produce, wait for delivery, mark);
* the worker's marks: a group transaction of 200 finishes, alone and carrying the
  marks of 200 earlier runs (what a mark adds to a commit the worker makes anyway).

Not a test: it asserts nothing about speed.

    make bench-chunk-repair
    python -m tests.bench.chunk_repair --runs 2000 --messages 40 --gapped 0.01
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from confluent_kafka import Producer
from sqlalchemy import text

from koda_runtime.kafka import producer_config
from koda_runtime.lifecycle.chunks import Chunk, ChunkKind, chunk_key
from koda_runtime.lifecycle.ids import uuid7
from koda_runtime.lifecycle.states import RunStatus
from koda_runtime.localstack import StackInfo, down, up
from koda_runtime.processors.chunkverify import verify_chunks
from koda_runtime.processors.compactor import ChunkCompactor
from koda_runtime.schemas.db import async_engine, sync_engine
from koda_runtime.schemas.epochs import Fence
from koda_runtime.schemas.migrate import upgrade
from koda_runtime.schemas.runs import upkeep
from koda_runtime.schemas.runs.worker import ClaimWrite, FinishWrite, PublishedWrite, RunStore
from koda_runtime.settings import Settings
from koda_runtime.topics.admin import apply_topics
from koda_runtime.topics.catalogue import RUN_CHUNKS, partition_for_key
from koda_runtime.topics.records.codec import RUN_CHUNK, chunk_value, headers_for
from tests.fixtures.namespaces import delete_topics, drop_schema, make_settings


def populate(settings: Settings, runs: int, messages: int, gapped: float) -> list[str]:
    """``runs`` finished runs; every ``1/gapped``-th lacks its last 3 messages on the topic."""
    engine = sync_engine(settings)
    producer = Producer(producer_config(settings, "bench") | {"linger.ms": 20})
    topic = settings.names.topic(RUN_CHUNKS)
    every = max(1, round(1 / gapped)) if gapped > 0 else 0
    gaps: list[str] = []
    try:
        for start in range(0, runs, 500):
            ids = [uuid7() for _ in range(min(500, runs - start))]
            users = [f"u{(start + i) % 100}" for i in range(len(ids))]
            holed = {r for i, r in enumerate(ids) if every and (start + i) % every == 0}
            with engine.begin() as conn:
                conn.execute(
                    text(
                        "INSERT INTO sessions (id, user_id) SELECT 's-' || u, u"
                        " FROM unnest(CAST(:users AS text[])) AS u ON CONFLICT DO NOTHING"
                    ),
                    {"users": sorted(set(users))},
                )
                conn.execute(
                    text(
                        "INSERT INTO runs (id, session_id, user_id, idempotency_key, input,"
                        " status, attempt, started_at, finished_at, published_seq)"
                        " SELECT r, 's-' || u, u, r, '{}', 'done', 1, now(), now(),"
                        " CASE WHEN h THEN NULL ELSE :last END"
                        " FROM unnest(CAST(:ids AS text[]), CAST(:users AS text[]),"
                        " CAST(:holed AS bool[])) AS q(r, u, h)"
                    ),
                    {
                        "ids": ids,
                        "users": users,
                        "holed": [r in holed for r in ids],
                        "last": messages - 1,
                    },
                )
                conn.execute(
                    text(
                        "INSERT INTO messages (run_id, seq, kind, content, attempt)"
                        " SELECT r, s, CASE WHEN s = :last THEN 'done' ELSE 'chunk' END,"
                        " CASE WHEN s = :last THEN '{}' ELSE 'token ' END, 1"
                        " FROM unnest(CAST(:ids AS text[])) AS r, generate_series(0, :last) AS s"
                    ),
                    {"ids": ids, "last": messages - 1},
                )
            for run_id, user in zip(ids, users, strict=True):
                part = partition_for_key(user.encode(), settings.partitions)
                shown = messages - 3 if run_id in holed else messages
                for seq in range(shown):
                    kind, content = ("done", "{}") if seq == messages - 1 else ("chunk", "token ")
                    while True:
                        try:
                            producer.produce(
                                topic,
                                key=chunk_key(run_id, seq).encode(),
                                value=chunk_value(run_id, seq, kind, content, 1),
                                partition=part,
                                headers=list(headers_for(RUN_CHUNK)),
                            )
                            break
                        except BufferError:
                            producer.poll(0.1)
            assert producer.flush(120) == 0
            gaps += sorted(holed)
    finally:
        engine.dispose()
    return gaps


def scan_ms(settings: Settings, repeat: int = 20) -> list[float]:
    engine = sync_engine(settings)
    out = []
    try:
        for _ in range(repeat):
            t0 = time.perf_counter()
            with engine.connect() as conn:
                upkeep.unpublished(conn, 0, None, 200)
            out.append((time.perf_counter() - t0) * 1000)
    finally:
        engine.dispose()
    return out


async def marks_riding_along(
    settings: Settings, runs: int, rounds: int = 15
) -> tuple[list[float], list[float]]:
    """Milliseconds per round of a group of ``runs`` finishes alone, and of the next group
    of ``runs`` finishes carrying the marks of the runs the first one finished."""
    engine = async_engine(settings, pool_size=2)
    store = RunStore(engine)
    topic = "bench-runs"
    epochs = await store.bump_epochs(topic, [0], "bench")
    fence = Fence(topic, 0, epochs[0])

    async def finish_new(marks: list[str]) -> tuple[float, list[str]]:
        ids = [uuid7() for _ in range(runs)]
        async with engine.begin() as conn:
            await conn.execute(
                text(
                    "INSERT INTO runs (id, session_id, user_id, idempotency_key, input)"
                    " SELECT r, 's-m', 'm', r, '{}' FROM unnest(CAST(:ids AS text[])) AS r"
                ),
                {"ids": ids},
            )
        await store.write_group([ClaimWrite(fence, r, "bench") for r in ids])
        last = [Chunk(r, 1, ChunkKind.DONE, "{}", 1) for r in ids]
        writes: list[FinishWrite | PublishedWrite] = [
            FinishWrite(
                fence, c.run_id, RunStatus.DONE, [Chunk(c.run_id, 0, ChunkKind.CHUNK, "t", 1), c]
            )
            for c in last
        ]
        writes += [PublishedWrite(r, 1) for r in marks]
        t0 = time.perf_counter()
        await store.write_group(writes)
        return (time.perf_counter() - t0) * 1000, ids

    alone: list[float] = []
    carrying: list[float] = []
    try:
        async with engine.begin() as conn:
            await conn.execute(
                text(
                    "INSERT INTO sessions (id, user_id) VALUES ('s-m', 'm') ON CONFLICT DO NOTHING"
                )
            )
        await finish_new([])  # warm-up
        for _ in range(rounds):
            took, ids = await finish_new([])
            alone.append(took)
            took, _ = await finish_new(ids)
            carrying.append(took)
        return alone, carrying
    finally:
        await engine.dispose()


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m tests.bench.chunk_repair")
    ap.add_argument("--runs", type=int, default=2000)
    ap.add_argument("--messages", type=int, default=40)
    ap.add_argument("--gapped", type=float, default=0.01, help="fraction of runs with a gap")
    args = ap.parse_args()
    state: Path | None = None
    if os.environ.get("KODA_KAFKA_BOOTSTRAP") and os.environ.get("KODA_DATABASE_URL"):
        info = StackInfo(os.environ["KODA_KAFKA_BOOTSTRAP"], os.environ["KODA_DATABASE_URL"], 1)
    else:
        state = Path(tempfile.mkdtemp(prefix="koda-bench-", dir="/tmp"))
        info = up(state)
    settings = make_settings(info)
    upgrade(settings)
    apply_topics(settings)
    try:
        t0 = time.monotonic()
        gaps = populate(settings, args.runs, args.messages, args.gapped)
        records = args.runs * args.messages - 3 * len(gaps)
        print(
            f"chunk repair: {args.runs} finished runs x {args.messages} messages, "
            f"{len(gaps)} with a gap, {records} chunk records "
            f"(written in {time.monotonic() - t0:.1f} s), cores={os.cpu_count()}"
        )
        scans = scan_ms(settings)
        print(
            f"  pass scan (marker, partial index)   median {statistics.median(scans):8.2f} ms"
            f"  max {max(scans):8.2f} ms"
        )
        t0 = time.monotonic()
        report = verify_chunks(settings, datetime.fromtimestamp(0, UTC), timeout_s=600)
        verify_s = time.monotonic() - t0
        print(
            f"  verify (read topic + Postgres)      {verify_s * 1000:8.0f} ms"
            f"  ({report.runs} runs, {len(report.gaps)} with gaps found)"
        )
        compactor = ChunkCompactor(settings)
        try:
            t0 = time.monotonic()
            repaired = compactor.repair_once(older_than_s=0)
            repair_s = time.monotonic() - t0
        finally:
            compactor.close()
        print(
            f"  pass repair                         {repair_s * 1000:8.0f} ms"
            f"  ({repaired.runs} runs, {repaired.chunks} records produced)"
        )
        alone, carrying = asyncio.run(marks_riding_along(settings, 200))
        print(
            f"  group of 200 finishes               median {statistics.median(alone):8.2f} ms"
            f"  [{min(alone):.2f}-{max(alone):.2f}]"
        )
        print(
            f"    the same carrying 200 marks       median {statistics.median(carrying):8.2f} ms"
            f"  [{min(carrying):.2f}-{max(carrying):.2f}]"
        )
    finally:
        delete_topics(settings)
        drop_schema(settings)
        if state is not None:
            down(state)
            shutil.rmtree(state, ignore_errors=True)


if __name__ == "__main__":
    main()
