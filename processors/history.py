"""Load a run's context: its session's earlier turns within the token budget.

One statement (schemas/runs/reads.py) when the run is first claimed; the per-user order
guarantees the earlier runs of the session have ended, so the turns do not change
between the run's attempts and are read once per run.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from koda_runtime.lifecycle.turns import Turn, fit_budget, input_tokens
from koda_runtime.schemas.runs.reads import MAX_TURNS, earlier_turns


class SessionHistory:
    """The earlier turns of a run's session, newest kept within ``budget`` tokens."""

    def __init__(self, engine: AsyncEngine | None, budget: int) -> None:
        self.engine = engine
        self.budget = budget

    async def turns(self, run_id: str, inp: dict[str, Any]) -> tuple[Turn, ...]:
        """Oldest first; none without an engine (in-memory stores) or with a budget the
        run's own input already fills. A database error propagates (the claim's retry
        rules apply)."""
        reserved = input_tokens(inp)
        if self.engine is None or self.budget <= reserved:
            return ()
        # Each turn costs at least a token: no more than the budget can be kept.
        limit = min(MAX_TURNS, self.budget - reserved)
        async with self.engine.connect() as conn:
            turns = await earlier_turns(conn, run_id, limit)
        return fit_budget(turns, self.budget, reserved)


def history_for(store: Any, budget: int) -> SessionHistory:
    """The history of ``store``'s database: a store without an ``engine`` (the unit
    tests' in-memory ones) has no earlier turns."""
    engine = getattr(store, "engine", None)
    return SessionHistory(engine if isinstance(engine, AsyncEngine) else None, budget)
