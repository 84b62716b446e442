"""Load a run's context: its session's earlier turns within the token budget.

Read when the run is first claimed; the per-user order guarantees the earlier runs of
the session have ended, so the turns do not change between the run's attempts and are
read once per run. The runs a worker starts together are read together: one statement
(schemas/runs/reads.py) for the requests that queued while the last one was in flight
(koda/batching.py's rules: a read that fails fails the runs of its batch, each then
retried by its claim's rules, and not the next batch). A statement per run was a pool
checkout and a round trip each: 9.7 % of a worker's samples under W1.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from koda_runtime.batching import Batcher
from koda_runtime.lifecycle.turns import Turn, fit_budget, input_tokens
from koda_runtime.schemas.runs.reads import MAX_TURNS, earlier_turns_of

# At most this many runs' turns in one statement.
MAX_READ_BATCH = 128


class SessionHistory:
    """The earlier turns of a run's session, newest kept within ``budget`` tokens."""

    def __init__(self, engine: AsyncEngine | None, budget: int) -> None:
        self.engine = engine
        self.budget = budget
        self.reads = 0  # statements sent (tests read it)
        self._batcher: Batcher[tuple[str, int], list[Turn]] = Batcher(
            self._read, name="koda-history-reads", max_batch=MAX_READ_BATCH
        )

    async def turns(self, run_id: str, inp: dict[str, Any]) -> tuple[Turn, ...]:
        """Oldest first; none without an engine (in-memory stores) or with a budget the
        run's own input already fills. A database error propagates (the claim's retry
        rules apply)."""
        reserved = input_tokens(inp)
        if self.engine is None or self.budget <= reserved:
            return ()
        # Each turn costs at least a token: no more than the budget can be kept.
        limit = min(MAX_TURNS, self.budget - reserved)
        turns = await self._batcher.submit((run_id, limit))
        return fit_budget(turns, self.budget, reserved)

    async def _read(self, wanted: list[tuple[str, int]]) -> list[list[Turn]]:
        assert self.engine is not None  # noqa: S101 - turns() reads only with an engine
        self.reads += 1
        async with self.engine.connect() as conn:
            return await earlier_turns_of(conn, wanted)


def history_for(store: Any, budget: int) -> SessionHistory:
    """The history of ``store``'s database: a store without an ``engine`` (the unit
    tests' in-memory ones) has no earlier turns."""
    engine = getattr(store, "engine", None)
    return SessionHistory(engine if isinstance(engine, AsyncEngine) else None, budget)
