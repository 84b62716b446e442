"""What an attempt's model calls cost, and who hears of it.

The ledger rows of an attempt (``cost_ledger`` on) and the ``usage`` events on the
run-events topic, one per row written. A call whose usage came is written ``ok`` by
the attempt's next chunk batch (:class:`AttemptBook`, in the batch's fenced
transaction), so a worker killed later in the attempt has billed it. What is left at
the attempt's end (a call cut before its usage came, estimated; calls no batch wrote
yet) is written with the attempt's outcome: at the finish (in its transaction), for a
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
from koda_runtime.metrics import LEDGER_CALLS, MODEL_COST_USD, MODEL_TOKENS
from koda_runtime.processors.ports import RunOutput, WorkerStore
from koda_runtime.processors.streaming import CallTally
from koda_runtime.schemas.epochs import Fence
from koda_runtime.schemas.ledger import PricedCall
from koda_runtime.schemas.runs.worker import Finished

log = logging.getLogger("koda.worker")


class Billing:
    """An executor's billing of attempts; ``model`` prices an estimated call."""

    def __init__(self, ledger: bool, store: WorkerStore, emitter: RunOutput, model: str) -> None:
        self.ledger, self.store, self.emitter, self.model = ledger, store, emitter, model

    def calls(
        self, ctx: RunContext, usage: list[Usage], outcome: Outcome, written: int = 0
    ) -> list[LedgerCall]:
        """The ledger rows of ``ctx``'s attempt from call ``written`` on (the earlier ones
        are in the ledger already); none with the ledger switched off."""
        if not self.ledger:
            return []
        return calls_of(ctx.user_id, ctx.run_id, ctx.attempt, usage, outcome)[written:]

    def book(self, ctx: RunContext, tally: CallTally) -> AttemptBook | None:
        """The ledger of ``ctx``'s attempt as its chunk batches write it (None with the
        ledger switched off: batches carry no calls)."""
        return AttemptBook(self, ctx, tally) if self.ledger else None

    async def record_attempt(
        self, fence: Fence, ctx: RunContext, tally: CallTally, outcome: Outcome
    ) -> list[asyncio.Future[Any]]:
        """Write an attempt's calls no batch wrote to the ledger with ``outcome``; their
        usage events."""
        usage = tally.settled(self.model)
        if len(usage) <= tally.written or not self.ledger:
            return []
        priced = await self.store.record_calls(self.calls(ctx, usage, outcome, tally.written))
        return await self.usage_events(fence, ctx, usage, outcome, priced)

    async def record_cut(self, fence: Fence, ctx: RunContext, tally: CallTally) -> None:
        """An attempt cut off (handoff ceiling, fenced out): its calls no batch wrote were
        billed all the same, so they go to the ledger as ``cancelled``, shielded from the
        cancellation. A failure here is logged, never raised over the cut itself."""
        if len(tally.settled(self.model)) <= tally.written or not self.ledger:
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
        attempt's calls no batch wrote; a stopped attempt's went out when it stopped, a
        batch's with the batch), or, with the
        ledger switched off, one per usage row, priced as the usage table was."""
        if self.ledger:
            return await self.usage_events(fence, ctx, own, outcome, finished.ledger)
        priced = [
            PricedCall(ctx.run_id, ctx.attempt, i, cost, None) for i, cost in finished.costs.items()
        ]
        return await self.usage_events(fence, ctx, [*billed, *own], outcome, priced)

    async def usage_events(
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
            _count_call(u, row.cost_usd)
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


class AttemptBook:
    """One attempt's calls as its chunk batches write them (a ``CallBook``): each batch
    carries the calls whose usage came since the last one, ``ok``, not estimated.

    A usage record the handler itself marks estimated (its stream was cut) stops the
    batches there: that call and the later ones are the attempt's end's to write, with
    its outcome, so the call indices stay in the order the calls came.
    """

    def __init__(self, billing: Billing, ctx: RunContext, tally: CallTally) -> None:
        self.billing, self.ctx, self.tally = billing, ctx, tally

    def due(self) -> list[LedgerCall]:
        usage = self.tally.usage
        end = self.tally.written
        while end < len(usage) and not usage[end].estimated:
            end += 1
        if end == self.tally.written:
            return []
        return self.billing.calls(self.ctx, usage[:end], Outcome.OK, self.tally.written)

    async def written(
        self, fence: Fence, calls: list[LedgerCall], priced: list[PricedCall]
    ) -> list[asyncio.Future[Any]]:
        self.tally.written = calls[-1].call_index + 1
        return await self.billing.usage_events(
            fence, self.ctx, self.tally.usage, Outcome.OK, priced
        )

    def refused(self, calls: list[LedgerCall], cause: str) -> None:
        """Postgres refused the batch that carried ``calls`` (a data error: a count out
        of range...). The same rows would be refused again, at the attempt's end too, so
        they are passed over, with an error log: the run ends ``failed`` naming it."""
        self.tally.written = calls[-1].call_index + 1
        log.error(
            "event=ledger_rows_refused run_id=%s attempt=%d calls=%d: %s",
            self.ctx.run_id,
            self.ctx.attempt,
            len(calls),
            cause,
        )


def _count_call(u: Usage, cost_usd: Decimal | None) -> None:
    """A billed call's tokens and cost on the model series (once per row written)."""
    MODEL_TOKENS.labels(model=u.model, direction="in").inc(u.prompt_tokens)
    MODEL_TOKENS.labels(model=u.model, direction="out").inc(u.completion_tokens)
    if cost_usd:
        MODEL_COST_USD.labels(model=u.model).inc(float(cost_usd))


def _cost(usd: Decimal | None) -> dict[str, str]:
    """The usage event's ``cost_usd`` field, priced in the same transaction as the row."""
    return {} if usd is None else {"cost_usd": str(usd)}
