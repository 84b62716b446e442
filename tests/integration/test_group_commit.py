"""Group commit (processors/groupcommit.py) on the real database.

Provoked here: many runs flushing at once share transactions; finishes in a group
write the same rows, costs and transitions as alone; a fenced-out run in a group is
refused while the others are written; a part Postgres refuses fails only its own run;
a finish's ledger rows (written through SQLAlchemy) and its pipelined chunks and
transition (on the driver connection) commit or roll back together; a run cancelled
while its part waits leaves nothing written; a closed writer fails what still waits."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from koda_runtime.errors import TransitionRejected
from koda_runtime.lifecycle.chunks import Chunk, ChunkKind, SeqCounter
from koda_runtime.lifecycle.handler import Usage
from koda_runtime.lifecycle.ids import uuid7
from koda_runtime.lifecycle.ledger import LedgerCall, Outcome
from koda_runtime.lifecycle.states import RunStatus
from koda_runtime.processors.emitter import Emitter
from koda_runtime.processors.groupcommit import GroupWriter
from koda_runtime.processors.runner import ChunkBatcher
from koda_runtime.schemas.db import async_engine
from koda_runtime.schemas.epochs import Fence
from koda_runtime.schemas.runs.worker import (
    ChunkWrite,
    Claim,
    ClaimWrite,
    Finished,
    FinishWrite,
    GroupResult,
    GroupWrite,
    RunStore,
)
from koda_runtime.settings import Settings
from koda_runtime.topics.records.codec import chunk_value
from tests.support import async_wait_until

TOPIC = "group-commit-runs"


@dataclass
class Stack:
    engine: AsyncEngine
    store: RunStore


@pytest.fixture
async def db(database: Settings) -> AsyncIterator[Stack]:
    engine = async_engine(database, pool_size=4)
    try:
        yield Stack(engine, RunStore(engine))
    finally:
        await engine.dispose()


async def new_run(s: Stack, partition: int) -> tuple[str, Fence]:
    """A ``pending`` run, and the partition's current epoch."""
    run_id, session = uuid7(), uuid7()
    async with s.engine.begin() as conn:
        await conn.execute(
            text("INSERT INTO sessions (id, user_id) VALUES (:s, 'u')"), {"s": session}
        )
        await conn.execute(
            text(
                "INSERT INTO runs (id, session_id, user_id, idempotency_key, input)"
                " VALUES (:id, :s, 'u', :id, CAST(:input AS jsonb))"
            ),
            {"id": run_id, "s": session, "input": json.dumps({})},
        )
        row = await conn.execute(
            text("SELECT epoch FROM partition_epochs WHERE topic = :t AND partition = :p"),
            {"t": TOPIC, "p": partition},
        )
        epoch = row.scalar_one()
    return run_id, Fence(TOPIC, partition, int(epoch))


async def alone(s: Stack, write: GroupWrite) -> GroupResult:
    """``write`` as a group of one, straight to the store."""
    (result,) = await s.store.write_group([write])
    return result


async def claimed_run(s: Stack, partition: int) -> tuple[str, Fence]:
    """A run claimed (``running``) under the partition's current epoch."""
    run_id, fence = await new_run(s, partition)
    assert await alone(s, ClaimWrite(fence, run_id, "w1")) is not None
    return run_id, fence


def batch(run_id: str, start: int, n: int, content: str = "tok") -> list[Chunk]:
    return [Chunk(run_id, start + i, ChunkKind.CHUNK, f"{content}{i}", 1) for i in range(n)]


async def stored(s: Stack, run_id: str) -> tuple[list[int], str]:
    async with s.engine.connect() as conn:
        seqs = await conn.execute(
            text("SELECT seq FROM messages WHERE run_id = :id ORDER BY seq"), {"id": run_id}
        )
        status = await conn.execute(text("SELECT status FROM runs WHERE id = :id"), {"id": run_id})
        return [int(r[0]) for r in seqs], str(status.scalar_one())


async def test_runs_flushing_together_share_transactions(db: Stack) -> None:
    await db.store.bump_epochs(TOPIC, range(8), "w1")
    runs = [await claimed_run(db, i % 8) for i in range(40)]
    writer = GroupWriter(db.store)
    try:
        results = await asyncio.gather(
            *(writer.chunks(ChunkWrite(f, r, batch(r, 0, 3), True)) for r, f in runs)
        )
        assert results == [[0, 1, 2]] * 40
        # All were waiting before the writer first ran: one transaction for forty runs.
        assert writer.groups == 1, writer.groups
        for r, _ in runs:
            assert await stored(db, r) == ([0, 1, 2], "streaming")
        # Writing the same batches again inserts nothing (ON CONFLICT DO NOTHING).
        again = await asyncio.gather(
            *(writer.chunks(ChunkWrite(f, r, batch(r, 0, 3), False)) for r, f in runs)
        )
        assert again == [[]] * 40
    finally:
        await writer.close()


async def ended(s: Stack, run_id: str) -> tuple[str, str | None, bool, bool, list[tuple]]:
    """Status, error, finished_at set, first_chunk_at set, and the usage rows."""
    async with s.engine.connect() as conn:
        run = (
            await conn.execute(
                text(
                    "SELECT status, error, finished_at IS NOT NULL, first_chunk_at IS NOT NULL"
                    " FROM runs WHERE id = :id"
                ),
                {"id": run_id},
            )
        ).one()
        usage = await conn.execute(
            text(
                "SELECT call_index, model, prompt_tokens, completion_tokens, cost_usd"
                " FROM usage WHERE run_id = :id ORDER BY call_index"
            ),
            {"id": run_id},
        )
        return (run[0], run[1], run[2], run[3], [tuple(r) for r in usage])


async def test_finishes_in_a_group_write_what_each_would_write_alone(db: Stack) -> None:
    await db.store.bump_epochs(TOPIC, [0, 1], "w1")
    async with db.engine.begin() as conn:
        await conn.execute(
            text(
                "INSERT INTO prices (model, prompt_usd_per_mtok, completion_usd_per_mtok,"
                " effective_from) VALUES ('m-priced', 3, 15, now() - interval '1 day')"
            )
        )
    usage = [Usage("m-priced", 1000, 200), Usage("m-unpriced", 7, 9)]
    single, grouped = [await claimed_run(db, i % 2) for i in range(4)], []
    for i in range(4):
        grouped.append(await claimed_run(db, i % 2))

    def finishing(run: str, fence: Fence, n: int) -> FinishWrite:
        if n == 3:  # one failure, with its error and no usage
            chunks = [Chunk(run, 0, ChunkKind.ERROR, "{}", 1)]
            return FinishWrite(fence, run, RunStatus.FAILED, chunks, error="boom")
        chunks = [*batch(run, 0, 2), Chunk(run, 2, ChunkKind.DONE, "{}", 1)]
        return FinishWrite(fence, run, RunStatus.DONE, chunks, usage, first_output=n == 0)

    expected = [await alone(db, finishing(run, fence, n)) for n, (run, fence) in enumerate(single)]
    writer = GroupWriter(db.store)
    try:
        got = await asyncio.gather(
            *(writer.finish(finishing(r, f, n)) for n, (r, f) in enumerate(grouped))
        )
    finally:
        await writer.close()
    assert got == expected
    assert got[0] == Finished([0, 1, 2], {0: Decimal("0.00600000"), 1: Decimal("0E-8")})
    for (a, _), (g, _) in zip(single, grouped, strict=True):
        status, error, done_at, first_at, rows = await ended(db, g)
        assert (status, error, done_at, first_at) == (await ended(db, a))[:4]
        assert rows == (await ended(db, a))[4]
        assert (await stored(db, g))[0] == (await stored(db, a))[0]
    assert (await ended(db, grouped[3][0]))[:2] == ("failed", "boom")
    with pytest.raises(ValueError, match="not terminal"):
        FinishWrite(grouped[0][1], grouped[0][0], RunStatus.STREAMING, [])


async def test_chunk_batches_and_finishes_share_a_group(db: Stack) -> None:
    await db.store.bump_epochs(TOPIC, [0], "w1")
    streaming, ending, late = [await claimed_run(db, 0) for _ in range(3)]
    writer = GroupWriter(db.store)
    try:
        (r1, f1), (r2, f2), (r3, f3) = streaming, ending, late
        done = [Chunk(r2, 0, ChunkKind.DONE, "{}", 1)]
        results = await asyncio.gather(
            writer.chunks(ChunkWrite(f1, r1, batch(r1, 0, 1), True)),
            writer.chunks(ChunkWrite(f1, r1, batch(r1, 1, 1), False)),
            writer.finish(FinishWrite(f2, r2, RunStatus.DONE, done)),
            writer.chunks(ChunkWrite(f3, r3, batch(r3, 0, 3), True)),
        )
        assert list(results) == [[0], [1], Finished([0], {}), [0, 1, 2]]
        assert writer.groups == 2  # r1's first batch with r2 and r3, then r1's second
        assert await stored(db, r2) == ([0], "done")
        assert await stored(db, r3) == ([0, 1, 2], "streaming")
    finally:
        await writer.close()


async def test_claims_in_a_group_match_claims_alone(db: Stack) -> None:
    await db.store.bump_epochs(TOPIC, [0, 1], "w1")
    fresh, resumed, finished, stale = [await new_run(db, p) for p in (0, 0, 0, 1)]
    # `resumed` was claimed and wrote output before; `finished` is done already.
    (r, f), (t, g) = resumed, finished
    await alone(db, ClaimWrite(f, r, "old"))
    await alone(db, ChunkWrite(f, r, batch(r, 0, 3), True))
    await alone(db, ClaimWrite(g, t, "old"))
    await alone(db, FinishWrite(g, t, RunStatus.DONE, [Chunk(t, 0, ChunkKind.DONE, "{}", 1)]))
    # `stale` is claimed under an epoch its partition no longer has.
    old_fence = stale[1]
    await db.store.bump_epochs(TOPIC, [1], "w1")
    writer = GroupWriter(db.store)
    try:
        got = await asyncio.gather(
            writer.claim(ClaimWrite(f, fresh[0], "w2")),
            writer.claim(ClaimWrite(f, r, "w2")),
            writer.claim(ClaimWrite(g, t, "w2")),
            writer.claim(ClaimWrite(old_fence, stale[0], "w2")),
        )
    finally:
        await writer.close()
    assert writer.groups == 1
    assert got[0] is not None and got[1] is not None
    assert (got[0].attempt, got[0].next_seq, got[0].had_output, got[0].failures) == (1, 0, False, 0)
    assert (got[1].attempt, got[1].next_seq, got[1].had_output) == (2, 3, True)
    assert isinstance(got[0].queue_age_s, float) and got[0].queue_age_s >= 0
    assert got[2] is None  # terminal: nothing to claim
    assert got[3] is None  # fenced: the partition's epoch moved on
    assert await stored(db, stale[0]) == ([], "pending")
    # The same claim in a group of one gives the same answer as in the group.
    again = await alone(db, ClaimWrite(f, fresh[0], "w2"))
    assert again == Claim(2, 0, False, got[0].queue_age_s, 0, input=got[0].input)
    assert got[0].input == {} and got[0].input_version == 0 and not got[0].cancel_requested


async def test_a_fenced_out_run_is_refused_and_the_rest_of_its_group_written(db: Stack) -> None:
    await db.store.bump_epochs(TOPIC, [0, 1], "w1")
    kept, kept_fence = await claimed_run(db, 0)
    lost, lost_fence = await claimed_run(db, 1)
    await db.store.bump_epochs(TOPIC, [1], "successor")  # partition 1 moved away
    writer = GroupWriter(db.store)
    try:
        ends = [Chunk(lost, 0, ChunkKind.DONE, "{}", 1)]
        results = await asyncio.gather(
            writer.chunks(ChunkWrite(kept_fence, kept, batch(kept, 0, 2), True)),
            writer.chunks(ChunkWrite(lost_fence, lost, batch(lost, 0, 2), True)),
            writer.chunks(ChunkWrite(kept_fence, kept, batch(kept, 2, 2), False)),
            writer.finish(FinishWrite(lost_fence, lost, RunStatus.DONE, ends)),
        )
        assert list(results) == [[0, 1], None, [2, 3], None]
        assert await stored(db, kept) == ([0, 1, 2, 3], "streaming")
        assert await stored(db, lost) == ([], "running")
    finally:
        await writer.close()


async def test_a_batchs_ledger_rows_are_fenced_with_its_chunks_and_counted_once(
    db: Stack,
) -> None:
    await db.store.bump_epochs(TOPIC, [2, 3], "w1")
    kept, kept_fence = await claimed_run(db, 2)
    lost, lost_fence = await claimed_run(db, 3)
    await db.store.bump_epochs(TOPIC, [3], "successor")  # partition 3 moved away
    user = f"gc-{uuid7()}"

    def call(run_id: str, index: int) -> LedgerCall:
        return LedgerCall(user, run_id, 1, index, Usage("gc-model", 10, 20), Outcome.OK)

    async def billed() -> tuple[list[tuple[str, int]], int]:
        async with db.engine.connect() as conn:
            rows = await conn.execute(
                text("SELECT run_id, call_index FROM ledger WHERE user_id = :u ORDER BY 1, 2"),
                {"u": user},
            )
            calls = await conn.execute(
                text("SELECT calls FROM spend_periods WHERE user_id = :u AND period = 'month'"),
                {"u": user},
            )
            return [(r, int(i)) for r, i in rows], int(calls.scalar_one_or_none() or 0)

    writer = GroupWriter(db.store)
    try:
        results = await asyncio.gather(
            writer.chunks(
                ChunkWrite(kept_fence, kept, batch(kept, 0, 1), True, ledger=[call(kept, 0)])
            ),
            writer.chunks(
                ChunkWrite(lost_fence, lost, batch(lost, 0, 1), True, ledger=[call(lost, 0)])
            ),
        )
        assert list(results) == [[0], None]
        assert results[0] is not None
        assert [(p.run_id, p.call_index, p.price_id) for p in results[0].ledger] == [
            (kept, 0, None)
        ]
        # The fenced-out writer wrote neither its chunks nor its call.
        assert await billed() == ([(kept, 0)], 1)
        # Redelivered with the next call (the answer was lost): only the new call is
        # inserted, and only it is added to the month's spend row.
        again = await writer.chunks(
            ChunkWrite(
                kept_fence, kept, batch(kept, 0, 2), False, ledger=[call(kept, 0), call(kept, 1)]
            )
        )
        assert again == [1] and [p.call_index for p in again.ledger] == [1]
        assert await billed() == ([(kept, 0), (kept, 1)], 2)
    finally:
        await writer.close()


async def test_a_batch_postgres_refuses_fails_only_its_own_run(db: Stack) -> None:
    await db.store.bump_epochs(TOPIC, [0], "w1")
    runs = [await claimed_run(db, 0) for _ in range(5)]
    bad_run, bad_fence = runs[2]
    writer = GroupWriter(db.store)
    # Hold the writer in a first group so the next five gather into one.
    first_run, first_fence = await claimed_run(db, 0)
    try:
        writes = [writer.chunks(ChunkWrite(first_fence, first_run, batch(first_run, 0, 1), True))]
        for r, f in runs:
            chunks = batch(r, 0, 2, content="nul\x00" if r == bad_run else "ok")
            writes.append(writer.chunks(ChunkWrite(f, r, chunks, True)))
        results = await asyncio.gather(*writes, return_exceptions=True)
        assert isinstance(results[3], Exception), results
        assert "0x00" in str(results[3]) or "NUL" in str(results[3]), results[3]
        assert [x for i, x in enumerate(results) if i != 3] == [[0]] + [[0, 1]] * 4
        assert await stored(db, bad_run) == ([], "running")  # nothing half-written
        for r, _ in runs:
            if r != bad_run:
                assert await stored(db, r) == ([0, 1], "streaming")
    finally:
        await writer.close()


async def ledger_rows(s: Stack, run_id: str) -> list[tuple[int, str]]:
    async with s.engine.connect() as conn:
        rows = await conn.execute(
            text("SELECT call_index, model FROM ledger WHERE run_id = :id ORDER BY call_index"),
            {"id": run_id},
        )
        return [(int(r[0]), str(r[1])) for r in rows]


async def test_a_finishs_ledger_rows_commit_and_roll_back_with_its_pipelined_writes(
    db: Stack,
) -> None:
    """The ledger rows go through SQLAlchemy after the chunks and the transition went
    through psycopg's pipeline on the connection under it: one transaction. A ledger
    row Postgres refuses (a NUL in its model) rolls the chunks and the terminal move
    back with it; a good one commits with them."""
    await db.store.bump_epochs(TOPIC, [0], "w1")
    (good, good_fence), (bad, bad_fence) = [await claimed_run(db, 0) for _ in range(2)]

    def finishing(run: str, fence: Fence, model: str) -> FinishWrite:
        chunks = [*batch(run, 0, 2), Chunk(run, 2, ChunkKind.DONE, "{}", 1)]
        call = LedgerCall("u", run, 1, 0, Usage(model, 10, 20), Outcome.OK)
        return FinishWrite(fence, run, RunStatus.DONE, chunks, first_output=True, ledger=[call])

    done = await alone(db, finishing(good, good_fence, "m-ledger"))
    assert isinstance(done, Finished) and done.inserted == [0, 1, 2]
    assert [(p.run_id, p.call_index) for p in done.ledger] == [(good, 0)]
    assert await stored(db, good) == ([0, 1, 2], "done")
    assert await ledger_rows(db, good) == [(0, "m-ledger")]
    with pytest.raises(Exception, match="0x00|NUL"):
        await alone(db, finishing(bad, bad_fence, "m\x00"))
    assert await stored(db, bad) == ([], "running")  # the pipelined writes rolled back
    assert await ledger_rows(db, bad) == []
    # The connection went back to the pool clean: the same run now finishes whole.
    again = await alone(db, finishing(bad, bad_fence, "m-ledger"))
    assert isinstance(again, Finished) and again.inserted == [0, 1, 2]
    assert await stored(db, bad) == ([0, 1, 2], "done")


async def test_a_move_the_state_machine_has_no_edge_for_fails_only_its_own_run(
    db: Stack,
) -> None:
    """``streaming → streaming`` is no edge of the state machine: a batch that claims to
    be a run's first output when the run streams already is refused by the transition
    statement, which rolls its whole group back; written again part by part, only that
    run's batch fails, and nothing of it is written."""
    await db.store.bump_epochs(TOPIC, [0], "w1")
    (ok, ok_fence), (bad, bad_fence) = [await claimed_run(db, 0) for _ in range(2)]
    assert await alone(db, ChunkWrite(bad_fence, bad, batch(bad, 0, 1), True)) == [0]
    writer = GroupWriter(db.store)
    try:
        results = await asyncio.gather(
            writer.chunks(ChunkWrite(ok_fence, ok, batch(ok, 0, 2), True)),
            writer.chunks(ChunkWrite(bad_fence, bad, batch(bad, 1, 2), True)),
            return_exceptions=True,
        )
    finally:
        await writer.close()
    assert results[0] == [0, 1]
    assert isinstance(results[1], TransitionRejected), results[1]
    assert "to streaming" in str(results[1])
    assert writer.groups == 1  # one group, rolled back, then each part alone
    assert await stored(db, ok) == ([0, 1], "streaming")
    assert await stored(db, bad) == ([0], "streaming")


async def blocked_on_a_lock(s: Stack) -> None:
    """Until some session of this database waits for a lock (a group held by the blocker)."""

    async def waiting() -> bool:
        async with s.engine.connect() as conn:
            row = await conn.execute(
                text(
                    "SELECT count(*) FROM pg_stat_activity"
                    " WHERE datname = current_database() AND wait_event_type = 'Lock'"
                )
            )
            return bool(row.scalar_one())

    await async_wait_until(waiting, timeout=10, interval=0.02, what="a group waiting on a lock")


async def test_a_run_cancelled_while_its_batch_waits_leaves_nothing(db: Stack) -> None:
    await db.store.bump_epochs(TOPIC, [0], "w1")
    (busy, busy_fence), (cut, cut_fence) = [await claimed_run(db, 0) for _ in range(2)]
    writer = GroupWriter(db.store)
    try:
        async with db.engine.connect() as blocker:
            # Lock the first run's row so the first group waits inside its transaction.
            tx = await blocker.begin()
            await blocker.execute(
                text("SELECT 1 FROM runs WHERE id = :id FOR UPDATE"), {"id": busy}
            )
            first = asyncio.create_task(
                writer.chunks(ChunkWrite(busy_fence, busy, batch(busy, 0, 1), True))
            )
            await blocked_on_a_lock(db)
            waiting = asyncio.create_task(
                writer.chunks(ChunkWrite(cut_fence, cut, batch(cut, 0, 2), True))
            )
            await async_wait_until(
                lambda: _now(len(writer._queue) == 1), timeout=10, interval=0.01, what="queued"
            )
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            await tx.rollback()
        assert await first == [0]
        # A later write is taken after anything still queued: had the cut batch stayed
        # queued, it would be written by now.
        assert await writer.chunks(ChunkWrite(busy_fence, busy, batch(busy, 1, 1), False)) == [1]
        assert await stored(db, cut) == ([], "running")
        assert writer.groups == 2
    finally:
        await writer.close()


async def test_closing_the_writer_fails_batches_still_waiting(db: Stack) -> None:
    await db.store.bump_epochs(TOPIC, [0], "w1")
    run, fence = await claimed_run(db, 0)
    writer = GroupWriter(db.store)
    async with db.engine.connect() as blocker:
        tx = await blocker.begin()
        await blocker.execute(text("SELECT 1 FROM runs WHERE id = :id FOR UPDATE"), {"id": run})
        pending = asyncio.create_task(writer.chunks(ChunkWrite(fence, run, batch(run, 0, 1), True)))
        await blocked_on_a_lock(db)
        await writer.close()
        with pytest.raises(RuntimeError, match="group writer was closed"):
            await pending
        await tx.rollback()
    assert await stored(db, run) == ([], "running")


async def _now(value: bool) -> bool:
    return value


async def published_seq(s: Stack, run_id: str) -> int | None:
    async with s.engine.connect() as conn:
        row = await conn.execute(
            text("SELECT published_seq FROM runs WHERE id = :id"), {"id": run_id}
        )
        value = row.scalar_one()
        return None if value is None else int(value)


async def test_a_published_mark_rides_a_group_and_skips_a_row_the_compactor_holds(
    db: Stack,
) -> None:
    """Marks wait for nothing, and a terminal run's row that the compactor holds (it
    locks runs while compacting them, for as long as its deliveries take) must not hold
    up the worker's whole group: that mark is skipped, the group commits at once."""
    await db.store.bump_epochs(TOPIC, [0], "w1")
    (held, hf), (free, ff), (streaming, sf) = [await claimed_run(db, 0) for _ in range(3)]
    for run, fence in ((held, hf), (free, ff)):
        done = [Chunk(run, 0, ChunkKind.DONE, "{}", 1)]
        assert await alone(db, FinishWrite(fence, run, RunStatus.DONE, done)) is not None
    writer = GroupWriter(db.store)
    try:
        async with db.engine.connect() as compactor:
            await compactor.execute(
                text("SELECT 1 FROM runs WHERE id = :id FOR UPDATE"), {"id": held}
            )
            writer.published(held, 0)
            writer.published(free, 0)
            writer.published(streaming, 5)  # not terminal: nothing to mark
            written = await asyncio.wait_for(
                writer.chunks(ChunkWrite(sf, streaming, batch(streaming, 0, 2), True)), 10
            )
            assert written == [0, 1]
            await compactor.rollback()
        assert await published_seq(db, free) == 0
        assert await published_seq(db, held) is None  # the completeness pass marks it later
        assert await published_seq(db, streaming) is None
        writer.published(held, 0)

        async def marked() -> bool:
            return await published_seq(db, held) == 0

        await async_wait_until(marked, what="the mark once the lock is gone")
    finally:
        await writer.close()


async def test_a_batch_postgres_already_holds_is_still_produced_whole(
    db: Stack, database: Settings
) -> None:
    """A group whose COMMIT went through but whose answer was lost (the connection died)
    is written again part by part, where ON CONFLICT inserts nothing. Only the run's owner
    writes those seqs, so they are this very batch: it must still reach the topic, or
    Postgres holds chunks the topic never gets."""
    await db.store.bump_epochs(TOPIC, [0], "w1")
    run, fence = await claimed_run(db, 0)
    committed = batch(run, 0, 3)
    assert await alone(db, ChunkWrite(fence, run, committed, True)) == [0, 1, 2]
    sent: list[bytes] = []

    async def send(**record: Any) -> asyncio.Future[None]:
        sent.append(record["value"])
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done

    writer = GroupWriter(db.store)
    futures: list[asyncio.Future[Any]] = []
    batcher = ChunkBatcher(
        writer, Emitter(database, send), fence, run, 1, SeqCounter(0), futures, 32
    )
    batcher.streaming = True  # a later batch: the run is streaming already
    try:
        for c in committed:
            batcher.add(c.kind, c.content)
        await batcher.flush()
    finally:
        await writer.close()
    assert sent == [chunk_value(run, c.seq, c.kind.value, c.content, 1) for c in committed]
    assert len(futures) == 3


async def test_runs_loaded_together_share_one_read_and_an_unstorable_id_fails_none(
    db: Stack,
) -> None:
    await db.store.bump_epochs(TOPIC, [0], "w1")
    ids = [(await new_run(db, 0))[0] for _ in range(4)]
    reads_before = db.store._loads.reads
    # A record's run_id may be any string: NUL and a lone surrogate name no run, and
    # sent to Postgres they would fail the read of every run beside them.
    asked = [*ids, "no-such-run", "nul\x00id", "\ud800"]
    rows = await asyncio.gather(*(db.store.load_run(i) for i in asked))
    assert [r.id if r is not None else None for r in rows] == [*ids, None, None, None]
    assert all(r.status is RunStatus.PENDING and r.input == {} for r in rows[:4] if r)
    # Asked in one turn of the loop, before the reader ran: one read for all seven.
    assert db.store._loads.reads - reads_before == 1
