"""The journal of a run's tool steps in Postgres (``tool_steps``, migration 0018).

Every write is fenced like the worker's other writes (processors/store.py): it
succeeds only while the partition's epoch is the writer's and the run's ``fence`` is
that epoch with the run still claimed (``running``/``streaming``), taking ``FOR
SHARE`` locks on both rows so a new owner's epoch bump waits for it and then sees
it. A write that matches nothing raises :class:`FencedOut`: a worker that lost the
run (a zombie woken from SIGSTOP, a drained owner) records nothing the next owner
could use.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import TextClause, text
from sqlalchemy.ext.asyncio import AsyncEngine

from koda_runtime.lifecycle.states import ACTIVE
from koda_runtime.processors.store import Fence
from koda_runtime.processors.streaming import FencedOut

INITIATED = "initiated"
FINISHED = "finished"
AWAITING = "awaiting"  # an approval tool's step, waiting for a person (0019)
APPROVED = "approved"
REJECTED = "rejected"

_ACTIVE = sorted(s.value for s in ACTIVE)

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
    UPDATE runs r SET status = 'waiting'
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
    """What a ``waiting`` run waits for (:meth:`Journal.pending`)."""

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


class Journal:
    """Reads and fenced writes of ``tool_steps``."""

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
        fence: Fence,
        run_id: str,
        *,
        step: int,
        position: int,
        tool: str,
        arguments: str,
        attempt: int,
    ) -> None:
        await self._fenced(
            INITIATE,
            fence,
            run_id,
            "initiate",
            step=step,
            position=position,
            tool=tool,
            arguments=arguments,
            attempt=attempt,
        )

    async def call_again(self, fence: Fence, run_id: str, *, step: int, attempt: int) -> None:
        await self._fenced(CALL_AGAIN, fence, run_id, "call again", step=step, attempt=attempt)

    async def finish(self, fence: Fence, run_id: str, *, step: int, result: str) -> None:
        await self._fenced(FINISH, fence, run_id, "finish", step=step, result=result)

    async def await_approval(
        self,
        fence: Fence,
        run_id: str,
        *,
        step: int,
        position: int,
        tool: str,
        arguments: str,
        attempt: int,
    ) -> None:
        await self._fenced(
            AWAIT,
            fence,
            run_id,
            "await approval",
            step=step,
            position=position,
            tool=tool,
            arguments=arguments,
            attempt=attempt,
        )

    async def start_approved(self, fence: Fence, run_id: str, *, step: int, attempt: int) -> None:
        await self._fenced(START_APPROVED, fence, run_id, "start", step=step, attempt=attempt)

    async def time_out(self, fence: Fence, run_id: str, *, step: int) -> None:
        await self._fenced(TIME_OUT, fence, run_id, "time out", step=step)

    async def park(self, fence: Fence, run_id: str) -> None:
        """The run waits: ``→ waiting`` while ``fence`` still owns it."""
        await self._fenced(PARK, fence, run_id, "wait")

    async def pending(self, run_id: str) -> Pending | None:
        async with self.engine.connect() as conn:
            row = (await conn.execute(PENDING, {"run_id": run_id})).first()
        if row is None:
            return None
        return Pending(
            row.status, bool(row.cancel_requested), row.step, row.decision, float(row.age_s or 0)
        )

    async def supersede(self, fence: Fence, run_id: str, *, position: int) -> None:
        """Mark the live steps from ``position`` on as no longer asked for."""
        async with self.engine.begin() as conn:
            owned = (await conn.execute(OWNS, _params(fence, run_id))).first()
            if owned is None:
                raise FencedOut(f"run {run_id}: tool journal fenced out (supersede)")
            await conn.execute(SUPERSEDE, {**_params(fence, run_id), "position": position})

    async def _fenced(
        self, statement: TextClause, fence: Fence, run_id: str, verb: str, **values: object
    ) -> None:
        async with self.engine.begin() as conn:
            row = (await conn.execute(statement, {**_params(fence, run_id), **values})).first()
        if row is None:
            step = values.get("step")
            raise FencedOut(f"run {run_id}: tool journal {verb} of step {step} fenced out")


def _params(fence: Fence, run_id: str) -> dict[str, object]:
    return {
        "topic": fence.topic,
        "partition": fence.partition,
        "epoch": fence.epoch,
        "run_id": run_id,
        "active": _ACTIVE,
    }
