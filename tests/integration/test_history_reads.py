"""The runs a worker starts together read their sessions' earlier turns together
(processors/history.py over schemas/runs/reads.py ``earlier_turns_of``), in real
PostgreSQL.

Failure modes: a batched read hands one run another run's turns (another session's,
or another user's), drops a run's limit, or loses the order of the turns; and the
batching itself does not happen (a statement per run, a pool checkout and a round trip
each). The test builds three sessions of two users, asks for each run's turns alone
and all at once, and compares.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from koda_runtime.processors.history import SessionHistory
from koda_runtime.schemas.db import async_engine
from koda_runtime.schemas.runs.reads import earlier_turns, earlier_turns_of
from koda_runtime.settings import Settings

# (user, session): the runs of each, oldest first.
SESSIONS = {
    ("ann", "s-ann-1"): ["a1", "a2", "a3", "a4"],
    ("ann", "s-ann-2"): ["b1", "b2"],
    ("bob", "s-bob-1"): ["c1", "c2", "c3"],
}


@pytest.fixture
async def engine(module_database: Settings) -> AsyncIterator[AsyncEngine]:
    db = async_engine(module_database, pool_size=2)
    try:
        await fill(db)
        yield db
    finally:
        await db.dispose()


async def fill(engine: AsyncEngine) -> None:
    order = 0
    async with engine.begin() as conn:
        for (user, session), runs in SESSIONS.items():
            await conn.execute(
                text("INSERT INTO sessions (id, user_id) VALUES (:s, :u) ON CONFLICT DO NOTHING"),
                {"s": session, "u": user},
            )
            for run_id in runs:
                order += 1
                await conn.execute(
                    text(
                        "INSERT INTO runs (id, session_id, user_id, idempotency_key, status,"
                        " input, created_at) VALUES (:id, :s, :u, :id, 'done',"
                        " CAST(:input AS jsonb),"
                        " timestamptz '2026-01-01' + make_interval(secs => :order))"
                        " ON CONFLICT DO NOTHING"
                    ),
                    {
                        "id": run_id,
                        "s": session,
                        "u": user,
                        "order": order,
                        "input": json.dumps({"text": f"asked in {run_id}"}),
                    },
                )
                await conn.execute(
                    text(
                        "INSERT INTO messages (run_id, seq, kind, content, attempt)"
                        " VALUES (:r, 0, 'chunk', :c, 1) ON CONFLICT DO NOTHING"
                    ),
                    {"r": run_id, "c": f"answer of {run_id}"},
                )


def ids(turns: object) -> list[str]:
    return [t.run_id for t in turns]  # type: ignore[attr-defined]


async def test_a_batched_read_gives_each_run_its_own_turns(engine: AsyncEngine) -> None:
    wanted = [("a4", 10), ("c3", 10), ("b2", 10), ("a3", 1), ("missing", 10), ("a1", 10)]
    async with engine.connect() as conn:
        together = await earlier_turns_of(conn, wanted)
        alone = [list(await earlier_turns(conn, r, limit)) for r, limit in wanted]
    assert [ids(t) for t in together] == [
        ["a1", "a2", "a3"],
        ["c1", "c2"],
        ["b1"],
        ["a2"],  # the limit keeps the newest
        [],
        [],
    ]
    assert together == alone
    assert together[0][2].answer == "answer of a3"
    assert together[0][2].messages == ("asked in a3",)


async def test_runs_started_together_share_one_statement(engine: AsyncEngine) -> None:
    history = SessionHistory(engine, budget=10_000)
    runs = ["a4", "c3", "b2", "a2", "c2", "a3"]
    got = await asyncio.gather(*(history.turns(r, {"text": "now"}) for r in runs))
    assert [ids(t) for t in got] == [
        ["a1", "a2", "a3"],
        ["c1", "c2"],
        ["b1"],
        ["a1"],
        ["c1"],
        ["a1", "a2"],
    ]
    # The first read goes at once, the other five queue behind it and go together.
    assert history.reads <= 2, f"{history.reads} statements for {len(runs)} runs"
