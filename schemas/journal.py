"""The journal of a run's tool steps (``tool_steps``, migration 0018) and a person's
decision on a step that waits for one (migration 0019): every statement on them.

Every write of the worker is fenced like its other writes (schemas/runs/worker.py): it
succeeds only while the partition's epoch is the writer's and the run's ``fence`` is
that epoch with the run still claimed (``running``/``streaming``), taking ``FOR
SHARE`` locks on both rows so a new owner's epoch bump waits for it and then sees it.
A fenced write that matches nothing returns False: the worker's journal
(processors/tools/journal.py) raises FencedOut for it, so a worker that lost the run
(a zombie woken from SIGSTOP, a drained owner) records nothing the next owner could
use. The statements are written out whole (SQL text is never built): the once-only
guarantee of a tool's side effect rests on them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from sqlalchemy import TextClause, text
from sqlalchemy.ext.asyncio import AsyncEngine

from koda_runtime.lifecycle.states import ACTIVE, RunStatus, sources_of
from koda_runtime.schemas.db import failing_as

INITIATED = "initiated"
FINISHED = "finished"
AWAITING = "awaiting"  # an approval tool's step, waiting for a person (0019)
APPROVED = "approved"
REJECTED = "rejected"

_ACTIVE = sorted(s.value for s in ACTIVE)
# PARK is the edge ``running/streaming → waiting``: the fence admits only a claimed run
# (``_ACTIVE``), every one of which the state machine lets enter ``waiting``.
_WAITING = RunStatus.WAITING.value
if not ACTIVE <= sources_of(RunStatus.WAITING):
    raise RuntimeError("the state machine no longer lets a claimed run enter waiting")


class Owner(Protocol):
    """Who writes: the partition's owner token (the worker's ``Fence``)."""

    @property
    def topic(self) -> str: ...

    @property
    def partition(self) -> int: ...

    @property
    def epoch(self) -> int: ...


# Every write is fenced by the two EXISTS clauses: the partition's epoch and the run's
# row, both FOR SHARE (written out in each statement: SQL text is never built).

LOAD = text(
    """
    SELECT step, position, tool, arguments, status, result, calls, decision, decided_by,
           EXTRACT(EPOCH FROM now() - created_at) AS age_s
      FROM tool_steps
     WHERE run_id = :run_id AND superseded_at IS NULL
     ORDER BY position
    """
)
LAST_STEP = text("SELECT COALESCE(MAX(step), 0) FROM tool_steps WHERE run_id = :run_id")

INITIATE = text(
    """
    INSERT INTO tool_steps (run_id, step, position, tool, arguments, status, attempt, epoch,
                            calls)
    SELECT :run_id, :step, :position, :tool, :arguments, 'initiated', :attempt, :epoch, 1
     WHERE EXISTS (SELECT 1 FROM partition_epochs e
                WHERE e.topic = :topic AND e.partition = :partition
                  AND e.epoch = :epoch FOR SHARE)
       AND EXISTS (SELECT 1 FROM runs f
                    WHERE f.id = :run_id AND f.fence = :epoch
                      AND f.status = ANY(:active) FOR SHARE)
    RETURNING step
    """
)
CALL_AGAIN = text(
    """
    UPDATE tool_steps SET calls = calls + 1, attempt = :attempt, epoch = :epoch
     WHERE run_id = :run_id AND step = :step AND status = 'initiated'
       AND superseded_at IS NULL
       AND EXISTS (SELECT 1 FROM partition_epochs e
                WHERE e.topic = :topic AND e.partition = :partition
                  AND e.epoch = :epoch FOR SHARE)
       AND EXISTS (SELECT 1 FROM runs f
                    WHERE f.id = :run_id AND f.fence = :epoch
                      AND f.status = ANY(:active) FOR SHARE)
    RETURNING step
    """
)
FINISH = text(
    """
    UPDATE tool_steps SET status = 'finished', result = :result, finished_at = now()
     WHERE run_id = :run_id AND step = :step AND status IN ('initiated', 'awaiting')
       AND superseded_at IS NULL
       AND EXISTS (SELECT 1 FROM partition_epochs e
                WHERE e.topic = :topic AND e.partition = :partition
                  AND e.epoch = :epoch FOR SHARE)
       AND EXISTS (SELECT 1 FROM runs f
                    WHERE f.id = :run_id AND f.fence = :epoch
                      AND f.status = ANY(:active) FOR SHARE)
    RETURNING step
    """
)
SUPERSEDE = text(
    """
    WITH fenced AS (SELECT 1 WHERE
       EXISTS (SELECT 1 FROM partition_epochs e
                WHERE e.topic = :topic AND e.partition = :partition
                  AND e.epoch = :epoch FOR SHARE)
       AND EXISTS (SELECT 1 FROM runs f
                    WHERE f.id = :run_id AND f.fence = :epoch
                      AND f.status = ANY(:active) FOR SHARE)
)
    UPDATE tool_steps SET superseded_at = now()
     WHERE run_id = :run_id AND position >= :position AND superseded_at IS NULL
       AND EXISTS (SELECT 1 FROM fenced)
    RETURNING step
    """
)
AWAIT = text(
    """
    INSERT INTO tool_steps (run_id, step, position, tool, arguments, status, attempt, epoch,
                            calls)
    SELECT :run_id, :step, :position, :tool, :arguments, 'awaiting', :attempt, :epoch, 0
     WHERE EXISTS (SELECT 1 FROM partition_epochs e
                WHERE e.topic = :topic AND e.partition = :partition
                  AND e.epoch = :epoch FOR SHARE)
       AND EXISTS (SELECT 1 FROM runs f
                    WHERE f.id = :run_id AND f.fence = :epoch
                      AND f.status = ANY(:active) FOR SHARE)
    RETURNING step
    """
)
# An approved step's call starts: it is an initiated step from here on.
START_APPROVED = text(
    """
    UPDATE tool_steps SET status = 'initiated', calls = calls + 1, attempt = :attempt,
           epoch = :epoch
     WHERE run_id = :run_id AND step = :step AND status = 'awaiting'
       AND decision = 'approved' AND superseded_at IS NULL
       AND EXISTS (SELECT 1 FROM partition_epochs e
                WHERE e.topic = :topic AND e.partition = :partition
                  AND e.epoch = :epoch FOR SHARE)
       AND EXISTS (SELECT 1 FROM runs f
                    WHERE f.id = :run_id AND f.fence = :epoch
                      AND f.status = ANY(:active) FOR SHARE)
    RETURNING step
    """
)
TIME_OUT = text(
    """
    UPDATE tool_steps SET decision = 'rejected', decided_by = 'timeout', decided_at = now()
     WHERE run_id = :run_id AND step = :step AND status = 'awaiting' AND decision IS NULL
       AND EXISTS (SELECT 1 FROM partition_epochs e
                WHERE e.topic = :topic AND e.partition = :partition
                  AND e.epoch = :epoch FOR SHARE)
       AND EXISTS (SELECT 1 FROM runs f
                    WHERE f.id = :run_id AND f.fence = :epoch
                      AND f.status = ANY(:active) FOR SHARE)
    RETURNING step
    """
)
# The run stops to wait: ``→ waiting`` under its fence, from a claimed status.
PARK = text(
    """
    UPDATE runs r SET status = :waiting
     WHERE r.id = :run_id AND
       EXISTS (SELECT 1 FROM partition_epochs e
                WHERE e.topic = :topic AND e.partition = :partition
                  AND e.epoch = :epoch FOR SHARE)
       AND EXISTS (SELECT 1 FROM runs f
                    WHERE f.id = :run_id AND f.fence = :epoch
                      AND f.status = ANY(:active) FOR SHARE)
    RETURNING r.id
    """
)
# What a waiting run waits for: its step's decision, the step's age and a cancel request.
PENDING = text(
    """
    SELECT r.status, r.cancel_requested_at IS NOT NULL AS cancel_requested, s.step,
           s.decision, EXTRACT(EPOCH FROM now() - s.created_at) AS age_s
      FROM runs r
      LEFT JOIN tool_steps s ON s.run_id = r.id AND s.status = 'awaiting'
           AND s.superseded_at IS NULL
     WHERE r.id = :run_id
     ORDER BY s.step DESC NULLS LAST
     LIMIT 1
    """
)
OWNS = text(
    """
SELECT 1 WHERE
       EXISTS (SELECT 1 FROM partition_epochs e
                WHERE e.topic = :topic AND e.partition = :partition
                  AND e.epoch = :epoch FOR SHARE)
       AND EXISTS (SELECT 1 FROM runs f
                    WHERE f.id = :run_id AND f.fence = :epoch
                      AND f.status = ANY(:active) FOR SHARE)
    """
)


@dataclass(frozen=True)
class Step:
    """One live row of the journal."""

    step: int
    position: int
    tool: str
    arguments: str  # canonical JSON (sorted keys)
    status: str
    result: str | None
    calls: int
    decision: str | None = None
    decided_by: str | None = None
    age_s: float = 0.0

    @property
    def finished(self) -> bool:
        return self.status == FINISHED


@dataclass(frozen=True)
class Pending:
    """What a ``waiting`` run waits for (:meth:`ToolSteps.pending`)."""

    status: str
    cancel_requested: bool
    step: int | None
    decision: str | None
    age_s: float


@dataclass
class Journaled:
    """What the journal holds of a run: its live steps in order, and the highest step
    number ever used (superseded rows included: a step number is never reused)."""

    steps: list[Step]
    last_step: int


class ToolSteps:
    """Reads and fenced writes of ``tool_steps``: each write returns True when it was
    made, False when ``owner`` no longer owns the run (nothing was written)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    async def load(self, run_id: str) -> Journaled:
        async with self.engine.connect() as conn:
            rows = (await conn.execute(LOAD, {"run_id": run_id})).all()
            last = (await conn.execute(LAST_STEP, {"run_id": run_id})).scalar_one()
        steps = [
            Step(
                r.step,
                r.position,
                r.tool,
                r.arguments,
                r.status,
                r.result,
                r.calls,
                r.decision,
                r.decided_by,
                float(r.age_s or 0.0),
            )
            for r in rows
        ]
        return Journaled(steps, int(last))

    async def initiate(
        self,
        owner: Owner,
        run_id: str,
        *,
        step: int,
        position: int,
        tool: str,
        arguments: str,
        attempt: int,
    ) -> bool:
        values = {"step": step, "position": position, "tool": tool, "arguments": arguments}
        return await self._fenced(INITIATE, owner, run_id, **values, attempt=attempt)

    async def call_again(self, owner: Owner, run_id: str, *, step: int, attempt: int) -> bool:
        return await self._fenced(CALL_AGAIN, owner, run_id, step=step, attempt=attempt)

    async def finish(self, owner: Owner, run_id: str, *, step: int, result: str) -> bool:
        return await self._fenced(FINISH, owner, run_id, step=step, result=result)

    async def await_approval(
        self,
        owner: Owner,
        run_id: str,
        *,
        step: int,
        position: int,
        tool: str,
        arguments: str,
        attempt: int,
    ) -> bool:
        values = {"step": step, "position": position, "tool": tool, "arguments": arguments}
        return await self._fenced(AWAIT, owner, run_id, **values, attempt=attempt)

    async def start_approved(self, owner: Owner, run_id: str, *, step: int, attempt: int) -> bool:
        return await self._fenced(START_APPROVED, owner, run_id, step=step, attempt=attempt)

    async def time_out(self, owner: Owner, run_id: str, *, step: int) -> bool:
        return await self._fenced(TIME_OUT, owner, run_id, step=step)

    async def park(self, owner: Owner, run_id: str) -> bool:
        """The run waits: ``→ waiting`` while ``owner`` still owns it."""
        return await self._fenced(PARK, owner, run_id, waiting=_WAITING)

    async def pending(self, run_id: str) -> Pending | None:
        async with self.engine.connect() as conn:
            row = (await conn.execute(PENDING, {"run_id": run_id})).first()
        if row is None:
            return None
        return Pending(
            row.status, bool(row.cancel_requested), row.step, row.decision, float(row.age_s or 0)
        )

    async def supersede(self, owner: Owner, run_id: str, *, position: int) -> bool:
        """Mark the live steps from ``position`` on as no longer asked for."""
        async with self.engine.begin() as conn:
            owned = (await conn.execute(OWNS, _params(owner, run_id))).first()
            if owned is None:
                return False
            await conn.execute(SUPERSEDE, {**_params(owner, run_id), "position": position})
        return True

    async def _fenced(
        self, statement: TextClause, owner: Owner, run_id: str, **values: object
    ) -> bool:
        async with self.engine.begin() as conn:
            row = (await conn.execute(statement, {**_params(owner, run_id), **values})).first()
        return row is not None


def _params(owner: Owner, run_id: str) -> dict[str, object]:
    return {
        "topic": owner.topic,
        "partition": owner.partition,
        "epoch": owner.epoch,
        "run_id": run_id,
        "active": _ACTIVE,
    }


# -- a person's decision (POST /v1/runs/{run_id}/approve, /reject) -------------------

# The run (owner's only) and its latest step that waits or was decided, locked.
_READ_DECISION = text(
    """
    SELECT r.id, r.user_id, r.status, COALESCE(r.input_version, 0) AS input_version,
           s.step, s.tool, s.status AS step_status, s.decision,
           EXTRACT(EPOCH FROM now() - s.created_at) AS age_s
      FROM runs r
      LEFT JOIN LATERAL (
           SELECT step, tool, status, decision, created_at FROM tool_steps
            WHERE run_id = r.id AND superseded_at IS NULL
              AND (status = 'awaiting' OR decision IS NOT NULL)
            ORDER BY step DESC LIMIT 1) s ON true
     WHERE r.id = :run_id AND r.user_id = :user_id
       FOR UPDATE OF r
    """
)
_DECIDE = text(
    """
    UPDATE tool_steps SET decision = :decision, decided_by = :by, decided_at = now()
     WHERE run_id = :run_id AND step = :step AND status = 'awaiting' AND decision IS NULL
    RETURNING step
    """
)


@dataclass(frozen=True)
class Awaited:
    """A run and its latest tool step that waits for a decision or has one (no such
    step: ``step`` and the step's fields are None)."""

    run_id: str
    status: str
    input_version: int
    step: int | None
    tool: str | None
    step_status: str | None
    decision: str | None
    age_s: float


async def decide(
    engine: AsyncEngine,
    run_id: str,
    user_id: str,
    decision: str,
    *,
    by: str,
    check: Callable[[Awaited], bool],
) -> tuple[Awaited, bool] | None:
    """Record ``decision`` on the awaited step of the user's run, in one transaction
    holding the run's row: None when the user has no such run. ``check`` sees the run
    and its step first: it raises to refuse (nothing is written), or says whether the
    decision is to be written (False: the same answer again). Returns the run and
    whether this call recorded the decision."""
    with failing_as("deciding a tool call"):
        async with engine.begin() as conn:
            row = (
                await conn.execute(_READ_DECISION, {"run_id": run_id, "user_id": user_id})
            ).first()
            if row is None:
                return None
            awaited = Awaited(
                row.id,
                row.status,
                int(row.input_version),
                row.step,
                row.tool,
                row.step_status,
                row.decision,
                float(row.age_s or 0),
            )
            if not check(awaited):
                return awaited, False
            params = {"decision": decision, "by": by, "run_id": run_id, "step": row.step}
            fresh = (await conn.execute(_DECIDE, params)).first() is not None
    return awaited, fresh
