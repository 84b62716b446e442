"""A worker frozen inside a transaction cannot hold its successor's rebalance hostage.

Found by the chaos run: a worker SIGSTOPped between a fenced write's ``FOR SHARE`` on
its partition's epoch row and the commit kept that lock; the new owner's epoch bump
waited for it, Faust's rebalance waited for the bump, and half the partitions did
nothing for 82 s, until the frozen worker was woken. koda's engines now have
PostgreSQL end a session idle in a transaction for longer than KODA_SESSION_TIMEOUT.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine

from koda_runtime.errors import DatabaseError
from koda_runtime.lifecycle.ids import uuid7
from koda_runtime.schemas.db import async_engine
from koda_runtime.schemas.runs.control import MARK_LOCK_WAIT_MS, ControlStore
from koda_runtime.schemas.runs.worker import RunStore
from koda_runtime.settings import Settings
from tests.support import async_wait_until

TOPIC = "frozen-lock-topic"


@asynccontextmanager
async def frozen_in_transaction(
    engine: AsyncEngine, statement: str, params: dict[str, Any]
) -> AsyncIterator[None]:
    """A connection of ``engine`` that ran ``statement`` in a transaction and then does
    nothing more, as a worker frozen between a statement and its commit. On leaving,
    the server must have ended that session: its next statement fails."""
    frozen = await engine.connect()
    transaction = await frozen.begin()
    await frozen.execute(text(statement), params)
    yield
    with pytest.raises(DBAPIError):
        await frozen.execute(text("SELECT 1"))
    await transaction.rollback()
    await frozen.close()


async def test_a_lock_held_by_a_frozen_transaction_is_released(database: Settings) -> None:
    settings = database.with_(session_timeout_s=2.0)
    frozen_engine = async_engine(settings, pool_size=1)
    successor_engine = async_engine(settings, pool_size=1)
    try:
        await RunStore(successor_engine).bump_epochs(TOPIC, [0], "frozen")
        async with frozen_in_transaction(
            frozen_engine,
            "SELECT epoch FROM partition_epochs WHERE topic = :t AND partition = 0 FOR SHARE",
            {"t": TOPIC},
        ):
            started = time.monotonic()
            epochs = await asyncio.wait_for(
                RunStore(successor_engine).bump_epochs(TOPIC, [0], "successor"), timeout=20
            )
            waited = time.monotonic() - started
        assert epochs == {0: 2}
        assert 1.5 < waited < 10, f"the bump waited {waited:.1f}s"
    finally:
        await frozen_engine.dispose()
        await successor_engine.dispose()


async def _insert_run(engine: AsyncEngine, user: str, status: str) -> str:
    run_id = uuid7()
    finished = "now()" if status in ("done", "failed", "cancelled") else "NULL"
    async with engine.begin() as conn:
        await conn.execute(
            text("INSERT INTO sessions (id, user_id) VALUES (:s, :u) ON CONFLICT DO NOTHING"),
            {"s": f"s-{user}", "u": user},
        )
        await conn.execute(
            text(
                "INSERT INTO runs (id, session_id, user_id, idempotency_key, input, status,"
                f" finished_at) VALUES (:id, :s, :u, :k, '{{}}', :status, {finished})"
            ),
            {"id": run_id, "s": f"s-{user}", "u": user, "k": f"k-{run_id}", "status": status},
        )
    return run_id


async def _published_seq(engine: AsyncEngine, run_id: str) -> int | None:
    async with engine.connect() as conn:
        row = (
            await conn.execute(text("SELECT published_seq FROM runs WHERE id = :r"), {"r": run_id})
        ).one()
    return None if row.published_seq is None else int(row.published_seq)


async def _hold_row(
    engine: AsyncEngine, run_id: str, seconds: float, started: asyncio.Event
) -> None:
    """What the gateway's ``published_at`` flush does to a run's row, held ``seconds``."""
    async with engine.begin() as conn:
        await conn.execute(
            text("UPDATE runs SET published_at = now() WHERE id = :r"), {"r": run_id}
        )
        started.set()
        await asyncio.sleep(seconds)


async def test_a_cancelled_runs_published_mark_waits_out_a_short_row_lock(
    database: Settings,
) -> None:
    """Found in CI: the mark skipped a row the gateway's own ``published_at`` flush held
    for milliseconds, and the cancelled event was left to be produced again."""
    engine = async_engine(database, pool_size=2)
    try:
        run_id = await _insert_run(engine, "mark-short", "cancelled")
        started = asyncio.Event()
        holder = asyncio.create_task(_hold_row(engine, run_id, 0.3, started))
        await started.wait()
        await ControlStore(engine).mark_published(run_id, 0)
        await holder
        assert await _published_seq(engine, run_id) == 0
    finally:
        await engine.dispose()


async def test_a_published_mark_behind_a_long_row_lock_fails_and_stays_unset(
    database: Settings,
) -> None:
    engine = async_engine(database, pool_size=2)
    try:
        run_id = await _insert_run(engine, "mark-long", "cancelled")
        started = asyncio.Event()
        holder = asyncio.create_task(
            _hold_row(engine, run_id, MARK_LOCK_WAIT_MS / 1000 + 2, started)
        )
        await started.wait()
        began = time.monotonic()
        with pytest.raises(DatabaseError, match="marking a run published"):
            await ControlStore(engine).mark_published(run_id, 0)
        waited = time.monotonic() - began
        assert MARK_LOCK_WAIT_MS / 1000 * 0.9 < waited < MARK_LOCK_WAIT_MS / 1000 + 1.5, waited
        await holder
        assert await _published_seq(engine, run_id) is None  # the completeness pass's to set
    finally:
        await engine.dispose()


async def test_a_cancel_waits_for_a_frozen_writers_row_lock_at_most_the_session_timeout(
    database: Settings,
) -> None:
    """Found in CI: a worker SIGSTOPped inside a group write keeps ``FOR SHARE`` on its
    run's row, which the cancel's UPDATE needs (the lock is what serialises a cancel and
    a finish). The server ends the frozen session after KODA_SESSION_TIMEOUT, and the
    cancel then goes through; it is never refused and never waits longer."""
    settings = database.with_(session_timeout_s=2.0)
    engine = async_engine(settings, pool_size=1)
    frozen_engine = async_engine(settings, pool_size=1)
    try:
        run_id = await _insert_run(engine, "cancel-frozen", "running")
        async with frozen_in_transaction(
            frozen_engine, "SELECT 1 FROM runs WHERE id = :r FOR SHARE", {"r": run_id}
        ):
            began = time.monotonic()
            outcome = await asyncio.wait_for(
                ControlStore(engine).cancel(run_id, "cancel-frozen", "frozen"), timeout=20
            )
            waited = time.monotonic() - began
        assert outcome is not None and outcome.outcome == "requested"
        assert 1.5 < waited < 10, f"the cancel waited {waited:.1f}s"
    finally:
        await engine.dispose()
        await frozen_engine.dispose()


async def _frozen_mid_pipeline(engine: AsyncEngine, statement: bytes, *params: bytes) -> Any:
    """A connection of ``engine`` that sent ``statement`` in pipeline mode and then
    nothing more: no Sync, as a worker stopped inside its group write's pipeline."""
    conn = await engine.connect()
    raw = (await conn.get_raw_connection()).driver_connection
    assert raw is not None
    pg = raw.pgconn
    pg.enter_pipeline_mode()
    pg.send_query_params(statement, list(params))
    pg.flush()
    return conn, pg.backend_pid


async def test_a_worker_frozen_inside_a_pipeline_cannot_hold_its_successor_back(
    database: Settings,
) -> None:
    """Found by the 10,000-run chaos run: a worker SIGSTOPped between its pipeline's
    statements and their Sync kept ``FOR SHARE`` on its epoch rows for over 90 s. Such
    a session is ``active`` (waiting on ClientRead), not idle in a transaction, so the
    idle timeout never ends it; ``transaction_timeout`` does."""
    settings = database.with_(session_timeout_s=2.0)
    topic = "frozen-pipeline-topic"
    frozen_engine = async_engine(settings, pool_size=1, pipelines=True)
    successor_engine = async_engine(settings, pool_size=1)
    pid = None
    try:
        await RunStore(successor_engine).bump_epochs(topic, [0], "frozen")
        conn, pid = await _frozen_mid_pipeline(
            frozen_engine,
            b"SELECT epoch FROM partition_epochs WHERE topic = $1 AND partition = 0 FOR SHARE",
            topic.encode(),
        )

        async def waiting_for_input() -> bool:
            async with successor_engine.connect() as probe:
                row = (
                    await probe.execute(
                        text("SELECT state, wait_event FROM pg_stat_activity WHERE pid = :p"),
                        {"p": pid},
                    )
                ).first()
            return row is not None and (row.state, row.wait_event) == ("active", "ClientRead")

        await async_wait_until(waiting_for_input, timeout=10, what="the frozen pipeline's lock")
        started = time.monotonic()
        epochs = await asyncio.wait_for(
            RunStore(successor_engine).bump_epochs(topic, [0], "successor"), timeout=20
        )
        waited = time.monotonic() - started
        assert epochs == {0: 2}
        assert waited < 10, f"the bump waited {waited:.1f}s"
        await conn.invalidate()
    finally:
        if pid is not None:  # failed: end the frozen session, or teardown waits on it
            async with successor_engine.connect() as probe:
                await probe.execute(text("SELECT pg_terminate_backend(:p)"), {"p": pid})
        await frozen_engine.dispose()
        await successor_engine.dispose()
