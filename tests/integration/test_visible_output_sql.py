"""The visible-output rule is written once: koda_runtime.lifecycle.chunks.visible_output is
its source, and every read that shows a run's answer in SQL (schemas/runs/reads.py's
visible_output_sql: a run's view, a session's turns, a context's earlier turns, a
Responses object) gives what that function gives on the same rows, in real PostgreSQL.

Failure mode: the SQL drifts from the rule (a reset not honoured, a non-chunk kind
counted, the order by insertion instead of seq): a run's view, the chat's history and
the worker's context would then disagree with the live stream and the compactor.
"""

from __future__ import annotations

import json
import random
from collections.abc import AsyncIterator

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from koda_runtime.lifecycle.chunks import ChunkKind, visible_output
from koda_runtime.schemas.db import async_engine
from koda_runtime.schemas.runs.reads import RunReads, earlier_turns, visible_output_sql
from koda_runtime.settings import Settings

USER = "visible-user"
SESSION = "visible-session"
KINDS = [k.value for k in ChunkKind]


@pytest.fixture
async def engine(module_database: Settings) -> AsyncIterator[AsyncEngine]:
    db = async_engine(module_database, pool_size=2)
    try:
        yield db
    finally:
        await db.dispose()


def random_events(rng: random.Random, n: int) -> list[tuple[int, str, str]]:
    """``n`` events with seqs 0..n-1, every kind possible, resets included."""
    return [(seq, rng.choice(KINDS), f"<{seq}:{rng.randint(0, 99)}>") for seq in range(n)]


async def insert_run(
    engine: AsyncEngine, run_id: str, order: int, events: list[tuple[int, str, str]]
) -> None:
    """A ``done`` run of USER's SESSION, created ``order`` ms after the first, and its
    messages inserted in an order other than seq's."""
    shuffled = list(events)
    random.Random(run_id).shuffle(shuffled)
    async with engine.begin() as conn:
        await conn.execute(
            text("INSERT INTO sessions (id, user_id) VALUES (:s, :u) ON CONFLICT (id) DO NOTHING"),
            {"s": SESSION, "u": USER},
        )
        await conn.execute(
            text(
                "INSERT INTO runs (id, session_id, user_id, idempotency_key, status, input,"
                " created_at) VALUES (:id, :s, :u, :id, 'done', CAST(:input AS jsonb),"
                " timestamptz '2026-01-01' + make_interval(secs => :order / 1000.0))"
            ),
            {
                "id": run_id,
                "s": SESSION,
                "u": USER,
                "order": order,
                "input": json.dumps({"text": run_id}),
            },
        )
        for seq, kind, content in shuffled:
            await conn.execute(
                text(
                    "INSERT INTO messages (run_id, seq, kind, content, attempt)"
                    " VALUES (:r, :seq, :kind, :content, 0)"
                ),
                {"r": run_id, "seq": seq, "kind": kind, "content": content},
            )


async def sql_output(engine: AsyncEngine, run_id: str) -> str:
    expression = visible_output_sql("r.id")
    async with engine.connect() as conn:
        value = (
            await conn.execute(
                text(f"SELECT {expression} AS output FROM runs r WHERE r.id = :id"),  # noqa: S608
                {"id": run_id},
            )
        ).scalar_one()
    return str(value)


async def test_every_read_shows_what_the_rule_gives(engine: AsyncEngine) -> None:
    rng = random.Random(35)
    cases = {
        "no-events": [],
        "only-chunks": [(0, "chunk", "a"), (1, "chunk", "b")],
        "reset-last": [(0, "chunk", "a"), (1, "reset", "{}")],
        "reset-between": [(0, "chunk", "gone"), (1, "reset", "{}"), (2, "chunk", "kept")],
        "non-chunk-kinds": [
            (0, "status", "s"),
            (1, "chunk", "x"),
            (2, "tool", "t"),
            (3, "done", ""),
        ],
        **{f"random-{i}": random_events(rng, rng.randint(1, 40)) for i in range(25)},
    }
    # The data exercises the rule: some run's naive concatenation is not its answer.
    assert any(
        visible_output(ev) != "".join(c for _, k, c in ev if k == "chunk") for ev in cases.values()
    )
    # Ended runs in creation order: each is a turn of the runs after it.
    for order, (run_id, events) in enumerate(cases.items()):
        await insert_run(engine, run_id, order, events)
    reads = RunReads(engine)
    for run_id, events in cases.items():
        expected = visible_output(events)
        assert await sql_output(engine, run_id) == expected, run_id
        view = await reads.get_run(run_id, USER)
        assert view is not None and view.output == expected, run_id
        state = await reads.response_state(run_id, USER, "served")
        assert state is not None and state.output == expected, run_id
        assert state.resets == sum(1 for _, k, _ in events if k == "reset"), run_id
    turns = await reads.session_runs(SESSION, USER, limit=len(cases))
    assert turns is not None
    assert {t.run_id: t.answer for t in turns} == {r: visible_output(e) for r, e in cases.items()}
    last = list(cases)[-1]
    async with engine.connect() as conn:
        earlier = await earlier_turns(conn, last, limit=len(cases))
    assert {t.run_id: t.answer for t in earlier} == {
        r: visible_output(e) for r, e in cases.items() if r != last
    }
