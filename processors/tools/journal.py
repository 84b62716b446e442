"""The worker's journal of a run's tool steps: the fenced writes of
schemas/journal.py, where a write that matches nothing raises :class:`FencedOut`.

Every write succeeds only while the partition's epoch is the writer's and the run is
still claimed under it (schemas/journal.py holds the statements): a worker that lost
the run (a zombie woken from SIGSTOP, a drained owner) records nothing the next owner
could use, and stops.
"""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncEngine

from koda_runtime.processors.fences import FencedOut
from koda_runtime.schemas.journal import Journaled, Owner, Pending, ToolSteps


class Journal:
    """Reads and fenced writes of a run's tool steps."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.rows = ToolSteps(engine)

    async def load(self, run_id: str) -> Journaled:
        return await self.rows.load(run_id)

    async def initiate(
        self,
        fence: Owner,
        run_id: str,
        *,
        step: int,
        position: int,
        tool: str,
        arguments: str,
        attempt: int,
    ) -> None:
        made = await self.rows.initiate(
            fence,
            run_id,
            step=step,
            position=position,
            tool=tool,
            arguments=arguments,
            attempt=attempt,
        )
        _owned(made, run_id, "initiate", step)

    async def call_again(self, fence: Owner, run_id: str, *, step: int, attempt: int) -> None:
        made = await self.rows.call_again(fence, run_id, step=step, attempt=attempt)
        _owned(made, run_id, "call again", step)

    async def finish(self, fence: Owner, run_id: str, *, step: int, result: str) -> None:
        _owned(
            await self.rows.finish(fence, run_id, step=step, result=result), run_id, "finish", step
        )

    async def await_approval(
        self,
        fence: Owner,
        run_id: str,
        *,
        step: int,
        position: int,
        tool: str,
        arguments: str,
        attempt: int,
    ) -> None:
        made = await self.rows.await_approval(
            fence,
            run_id,
            step=step,
            position=position,
            tool=tool,
            arguments=arguments,
            attempt=attempt,
        )
        _owned(made, run_id, "await approval", step)

    async def start_approved(self, fence: Owner, run_id: str, *, step: int, attempt: int) -> None:
        made = await self.rows.start_approved(fence, run_id, step=step, attempt=attempt)
        _owned(made, run_id, "start", step)

    async def time_out(self, fence: Owner, run_id: str, *, step: int) -> None:
        _owned(await self.rows.time_out(fence, run_id, step=step), run_id, "time out", step)

    async def park(self, fence: Owner, run_id: str) -> None:
        """The run waits: ``→ waiting`` while ``fence`` still owns it."""
        _owned(await self.rows.park(fence, run_id), run_id, "wait", None)

    async def pending(self, run_id: str) -> Pending | None:
        return await self.rows.pending(run_id)

    async def supersede(self, fence: Owner, run_id: str, *, position: int) -> None:
        """Mark the live steps from ``position`` on as no longer asked for."""
        if not await self.rows.supersede(fence, run_id, position=position):
            raise FencedOut(f"run {run_id}: tool journal fenced out (supersede)")


def _owned(made: bool, run_id: str, verb: str, step: int | None) -> None:
    if not made:
        raise FencedOut(f"run {run_id}: tool journal {verb} of step {step} fenced out")
