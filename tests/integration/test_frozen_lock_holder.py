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

import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

from koda_runtime.db import async_engine
from koda_runtime.processors.store import RunStore
from koda_runtime.settings import Settings

TOPIC = "frozen-lock-topic"


async def test_a_lock_held_by_a_frozen_transaction_is_released(database: Settings) -> None:
    settings = database.with_(session_timeout_s=2.0)
    frozen_engine = async_engine(settings, pool_size=1)
    successor_engine = async_engine(settings, pool_size=1)
    try:
        await RunStore(successor_engine).bump_epochs(TOPIC, [0], "frozen")
        frozen = await frozen_engine.connect()
        transaction = await frozen.begin()
        await frozen.execute(
            text("SELECT epoch FROM partition_epochs WHERE topic = :t AND partition = 0 FOR SHARE"),
            {"t": TOPIC},
        )
        # The "worker" now does nothing more: frozen between its statement and commit.
        started = time.monotonic()
        epochs = await asyncio.wait_for(
            RunStore(successor_engine).bump_epochs(TOPIC, [0], "successor"), timeout=20
        )
        waited = time.monotonic() - started
        assert epochs == {0: 2}
        assert 1.5 < waited < 10, f"the bump waited {waited:.1f}s"
        # The frozen session was ended by the server: its next statement fails.
        with pytest.raises(DBAPIError):
            await frozen.execute(text("SELECT 1"))
        await transaction.rollback()
        await frozen.close()
    finally:
        await frozen_engine.dispose()
        await successor_engine.dispose()
