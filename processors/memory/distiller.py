"""Distilling a finished run's memories off the path of the user's next run.

A ``done`` finish of a worker whose handler remembers writes a row to
``memory_distillations`` in the run's terminal transaction (schemas/runs/worker.py), so
the marker exists exactly when the run is done. :class:`MemoryDistiller` is a loop in
every such worker that takes due markers, asks the handler for the run's statements
(``distil``: the openai handler's model call, the demo handler's rule), embeds them
and, in one transaction, stores them (processors/memory/truth.py's rules), writes the
calls to the cost ledger and deletes the marker. The user's next run never waits for
any of it: it is another record of the chain, and the loop holds no execution slot.

Failure modes, and what happens:

* The worker dies between the run's ``done`` and the memory's commit: the marker is
  still there. Taking a marker sets ``due_at`` a lease ahead
  (``KODA_MEMORY_DISTIL_LEASE_S``); when it passes, any worker's loop takes it again.
* The distillation or the embedding fails: the marker is due again after a backoff
  (1 s, doubling, at most 5 min) and given up after :data:`MAX_TRIES` (``gave_up_at``
  and ``last_error`` stay for operators, logged ``event=memory_distil_gave_up``).
* A try outlives its lease and another worker takes the marker: the first one's
  commit finds the marker's ``tries`` changed and writes nothing; the second stores the
  memories (the same, were both to commit: the writes are idempotent).
* The run is erased or deleted meanwhile: its marker goes with it (ON DELETE CASCADE)
  and the commit finds no marker, so nothing of the run comes back.

Ledger rows of a distillation are the run's, under its last attempt, with call indexes
from :data:`CALL_INDEX_BASE` (:data:`CALLS_PER_TRY` per try), so they never collide
with the attempt's own calls nor with another try's.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from sqlalchemy.exc import SQLAlchemyError

from koda_runtime.background import BackgroundTask
from koda_runtime.lifecycle.handler import RunContext, Usage
from koda_runtime.lifecycle.ledger import LedgerCall, Outcome
from koda_runtime.processors.memory.distil import Statement
from koda_runtime.processors.memory.service import MemoryService, embedding_usage
from koda_runtime.schemas import memories
from koda_runtime.schemas.ledger import insert_calls
from koda_runtime.schemas.memories import Taken
from koda_runtime.settings import Settings

log = logging.getLogger("koda.worker")

Distil = Callable[[RunContext, int], Awaitable[tuple[list[Statement], list[Usage]]]]

MAX_TRIES = 12
BACKOFF_BASE_S = 1.0
BACKOFF_CAP_S = 300.0
POLL_S = 5.0  # a marker left by a dead worker, or one due after a backoff, waits this long
BATCH = 8
CALL_INDEX_BASE = 100_000
CALLS_PER_TRY = 100


def backoff_s(tries: int) -> float:
    """How long a marker waits after its ``tries``-th try failed."""
    return float(min(BACKOFF_BASE_S * 2 ** max(tries - 1, 0), BACKOFF_CAP_S))


class MemoryDistiller:
    """The loop of one worker: :meth:`start` (idempotent), :meth:`wake` after a finish
    that left a marker, :meth:`stop`."""

    def __init__(
        self,
        memory: MemoryService,
        distil: Distil,
        *,
        lease_s: float,
        ledger: bool = True,
        max_output_tokens: int | None = None,
        poll_s: float = POLL_S,
    ) -> None:
        self.memory = memory
        self.distil = distil
        self.lease_s = lease_s
        self.ledger = ledger
        self.max_output_tokens = max_output_tokens
        self.poll_s = poll_s
        self._wake = asyncio.Event()
        self.task = BackgroundTask("koda-memory-distiller", self.run)

    def start(self) -> None:
        self.task.start()

    def wake(self) -> None:
        self._wake.set()

    async def stop(self) -> None:
        await self.task.stop()

    async def run(self) -> None:
        failures = 0
        while True:
            try:
                taken = await self.step()
            except (SQLAlchemyError, OSError) as exc:
                # Postgres away (also at a worker's start): one line, not a traceback per
                # poll; the markers wait in Postgres and the next poll takes them.
                failures += 1
                if failures == 1 or failures % 30 == 0:
                    log.warning(
                        "event=memory_distiller_failed failures=%d error=%s",
                        failures,
                        type(getattr(exc, "orig", None) or exc).__name__,
                    )
                taken = 0
            except Exception:  # noqa: BLE001 - anything else: logged whole, tried again
                log.exception("event=memory_distiller_failed")
                taken = 0
            else:
                failures = 0
            if taken:
                continue
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), self.poll_s)
            except TimeoutError:
                pass

    async def step(self) -> int:
        """Take the due markers (at most :data:`BATCH`) and distil each; how many."""
        taken = await memories.take_due(self.memory.engine, lease_s=self.lease_s, limit=BATCH)
        for one in taken:
            await self.distil_one(one)
        return len(taken)

    async def distil_one(self, taken: Taken) -> bool:
        """Distil one taken marker; True when its memories were committed."""
        engine = self.memory.engine
        run = await memories.distil_source(engine, taken.run_id)
        if run is None or run.status != "done":
            async with engine.begin() as conn:
                await memories.distilled(conn, taken)
            return False
        ctx = RunContext(
            taken.run_id,
            run.user_id,
            dict(run.input),
            int(run.attempt),
            max_output_tokens=self.max_output_tokens,
        )
        usage: list[Usage] = []
        try:
            statements, distil_usage = await self.distil(ctx, taken.tries)
            usage.extend(distil_usage)
            stored = None
            chunks, embedded = await self.memory.embed(statements) if statements else ([], None)
            if embedded is not None:
                usage.append(embedding_usage(embedded))
            async with engine.begin() as conn:
                if not await memories.still_taken(conn, taken):
                    log.info(
                        "event=memory_distil_superseded run_id=%s try=%d: taken again meanwhile",
                        taken.run_id,
                        taken.tries,
                    )
                    return False
                if chunks and embedded is not None:
                    stored = await self.memory.store(
                        conn,
                        user_id=run.user_id,
                        run_id=taken.run_id,
                        chunks=chunks,
                        embedded=embedded,
                        said_at=run.created_at,
                    )
                await self._bill(conn, ctx, taken.tries, usage, Outcome.OK)
                await memories.distilled(conn, taken)
        except Exception as exc:  # noqa: BLE001 - any failure: try again later
            await self._failed(ctx, taken, usage, exc)
            return False
        log.info(
            "event=memory_distilled run_id=%s try=%d statements=%d new=%d duplicates=%d "
            "superseded=%d",
            taken.run_id,
            taken.tries,
            len(statements),
            stored.new if stored else 0,
            stored.duplicates if stored else 0,
            stored.superseded if stored else 0,
        )
        return True

    async def _bill(
        self, conn: Any, ctx: RunContext, tries: int, usage: list[Usage], outcome: Outcome
    ) -> None:
        if not self.ledger or not usage:
            return
        first = CALL_INDEX_BASE + (tries - 1) * CALLS_PER_TRY
        calls = [
            LedgerCall(ctx.user_id, ctx.run_id, ctx.attempt, first + i, u, outcome)
            for i, u in enumerate(usage[:CALLS_PER_TRY])
        ]
        await insert_calls(conn, calls)

    async def _failed(
        self, ctx: RunContext, taken: Taken, usage: list[Usage], exc: Exception
    ) -> None:
        error = f"{type(exc).__name__}: {exc}"[:500]
        wait = backoff_s(taken.tries)
        gave_up = taken.tries >= MAX_TRIES
        try:
            async with self.memory.engine.begin() as conn:
                await self._bill(conn, ctx, taken.tries, usage, Outcome.FAILED)
                await memories.distil_failed(
                    conn, taken, wait_s=wait, error=error, max_tries=MAX_TRIES
                )
        except Exception:  # noqa: BLE001 - the lease brings it back anyway
            log.exception("event=memory_distil_not_recorded run_id=%s", taken.run_id)
        log.warning(
            "event=%s run_id=%s try=%d retry_in=%.0fs: %s",
            "memory_distil_gave_up" if gave_up else "memory_distil_failed",
            taken.run_id,
            taken.tries,
            wait,
            error[:300],
        )


def distiller_for(handler: Any, settings: Settings) -> MemoryDistiller | None:
    """The worker's distiller: when its handler remembers (a ``memory`` and a
    ``distil``), else None (no markers are written then)."""
    memory = getattr(handler, "memory", None)
    distil = getattr(handler, "distil", None)
    if not isinstance(memory, MemoryService) or distil is None:
        return None
    return MemoryDistiller(
        memory,
        distil,
        lease_s=settings.memory_distil_lease_s,
        ledger=settings.cost_ledger,
        max_output_tokens=settings.max_output_tokens or None,
    )
