"""What an attempt's model calls cost, and who hears of it.

The ledger rows of an attempt (``cost_ledger`` on) and the ``usage`` events on the
run-events topic, one per row written: at the finish (in its transaction), for a
failed or merge-stopped attempt (in a transaction of their own) and for an attempt
cut off at the handoff ceiling or fenced out (shielded from the cancellation).
"""

from __future__ import annotations

import asyncio
import logging
from decimal import Decimal
from typing import Any

from koda_runtime.lifecycle.handler import RunContext, Usage
from koda_runtime.lifecycle.ledger import LedgerCall, Outcome, calls_of
from koda_runtime.metrics import LEDGER_CALLS
from koda_runtime.processors.ports import RunOutput, WorkerStore
from koda_runtime.processors.store import Fence, Finished
from koda_runtime.processors.streaming import CallTally
from koda_runtime.schemas.ledger import PricedCall

log = logging.getLogger("koda.worker")


class Billing:
    """An executor's billing of attempts; ``model`` prices an estimated call."""

    def __init__(self, ledger: bool, store: WorkerStore, emitter: RunOutput, model: str) -> None:
        self.ledger, self.store, self.emitter, self.model = ledger, store, emitter, model

    def calls(self, ctx: RunContext, usage: list[Usage], outcome: Outcome) -> list[LedgerCall]:
        """The ledger rows of ``ctx``'s attempt (none with the ledger switched off)."""
        if not self.ledger:
            return []
        return calls_of(ctx.user_id, ctx.run_id, ctx.attempt, usage, outcome)

    async def record_attempt(
        self, fence: Fence, ctx: RunContext, tally: CallTally, outcome: Outcome
    ) -> list[asyncio.Future[Any]]:
        """Write an attempt's calls to the ledger with ``outcome``; its usage events."""
        usage = tally.settled(self.model)
        if not usage or not self.ledger:
            return []
        priced = await self.store.record_calls(self.calls(ctx, usage, outcome))
        return await self._usage_events(fence, ctx, usage, outcome, priced)

    async def record_cut(self, fence: Fence, ctx: RunContext, tally: CallTally) -> None:
        """An attempt cut off (handoff ceiling, fenced out): its calls were billed all the
        same, so they go to the ledger as ``cancelled``, shielded from the cancellation.
        A failure here is logged, never raised over the cut itself."""
        if not tally.settled(self.model) or not self.ledger:
            return
        try:
            await asyncio.shield(self.record_attempt(fence, ctx, tally, Outcome.CANCELLED))
        except Exception as exc:  # noqa: BLE001 - the cut is what the caller must see
            log.warning(
                "ledger write of a cut attempt failed run_id=%s attempt=%d error=%s",
                ctx.run_id,
                ctx.attempt,
                type(exc).__name__,
            )
        except asyncio.CancelledError:
            log.warning(
                "ledger write of a cut attempt interrupted run_id=%s attempt=%d",
                ctx.run_id,
                ctx.attempt,
            )

    async def finish_events(
        self,
        fence: Fence,
        ctx: RunContext,
        billed: list[Usage],
        own: list[Usage],
        outcome: Outcome,
        finished: Finished,
    ) -> list[asyncio.Future[Any]]:
        """The usage events of a finish: one per ledger row it wrote (the finishing
        attempt's calls; a stopped attempt's went out when it stopped), or, with the
        ledger switched off, one per usage row, priced as the usage table was."""
        if self.ledger:
            return await self._usage_events(fence, ctx, own, outcome, finished.ledger)
        priced = [
            PricedCall(ctx.run_id, ctx.attempt, i, cost, None) for i, cost in finished.costs.items()
        ]
        return await self._usage_events(fence, ctx, [*billed, *own], outcome, priced)

    async def _usage_events(
        self,
        fence: Fence,
        ctx: RunContext,
        usage: list[Usage],
        outcome: Outcome,
        priced: list[PricedCall],
    ) -> list[asyncio.Future[Any]]:
        """One ``usage`` event per ledger row written, with the row's cost and price id."""
        by_index = {p.call_index: p for p in priced}
        futures = []
        for i, u in enumerate(usage):
            row = by_index.get(i)
            if row is None:
                continue  # written before (a redelivery): its event went out then
            if self.ledger:
                LEDGER_CALLS.labels(outcome=outcome.value, estimated=str(u.estimated).lower()).inc()
            futures.append(
                await self.emitter.event(
                    fence.partition,
                    ctx.run_id,
                    "usage",
                    call_index=i,
                    model=u.model,
                    prompt_tokens=u.prompt_tokens,
                    completion_tokens=u.completion_tokens,
                    **_cost(row.cost_usd),
                    user_id=ctx.user_id,
                    attempt=ctx.attempt,
                    kind=u.kind,
                    outcome=outcome.value,
                    estimated=u.estimated,
                    price_id=row.price_id,
                )
            )
        return futures


def _cost(usd: Decimal | None) -> dict[str, str]:
    """The usage event's ``cost_usd`` field, priced in the same transaction as the row."""
    return {} if usd is None else {"cost_usd": str(usd)}
