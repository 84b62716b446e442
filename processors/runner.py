"""Execute one runs-topic record: decode, claim, stream, retry, finish or dead-letter.

``RunExecutor.process`` returns normally when the record may be acked (its
outcome is durable in Postgres and on the topics), and raises :class:`FencedOut`
when this worker no longer owns the partition: then nothing is acked and the
successor redoes the work. ``asyncio.CancelledError`` (handoff ceiling) also
leaves the record unacked.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from koda.errors import HandlerError, KodaError, RecordError
from koda.lifecycle.chunks import Chunk, ChunkKind, SeqCounter
from koda.lifecycle.handler import (
    CancelToken,
    Handler,
    Item,
    RunContext,
    RunFailed,
    ToolActivity,
    Usage,
)
from koda.lifecycle.ledger import LedgerCall, Outcome, calls_of
from koda.lifecycle.retry import RetryPolicy
from koda.lifecycle.states import RunStatus
from koda.metrics import (
    LEDGER_CALLS,
    QUEUE_AGE_SECONDS,
    RETRIES,
    RUN_DURATION_SECONDS,
    RUNS,
    TIME_TO_FIRST_CHUNK_SECONDS,
)
from koda.settings import Settings
from processors.control import ControlBoard, RunControl
from processors.emitter import Emitter
from processors.groupcommit import GroupWriter
from processors.republish import ChunkRepair
from processors.store import (
    ChunkWrite,
    ClaimWrite,
    Fence,
    Finished,
    FinishWrite,
    RunStore,
    Superseded,
)
from schemas.ledger import PricedCall
from schemas.records import RUN_REQUESTED, RunRequested, decode_run_requested, headers_for

log = logging.getLogger("koda.worker")

# A run may be claimed at most KODA_MAX_ATTEMPTS x this many times (handler failures and
# resumptions together) before it is given up.
MAX_CLAIMS_PER_ATTEMPT = 3


class FencedOut(KodaError):
    """This worker lost the partition: its writes match zero rows; do not ack."""


@dataclass(frozen=True)
class Record:
    """The parts of a Kafka message the executor needs (decoupled from Faust)."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: Any


_END = object()
_STOP = object()  # a cancel or a merge stopped the attempt


@dataclass
class CallTally:
    """An attempt's billable calls so far, and the chunks streamed since the last one.

    Chunks after the last usage record belong to a call whose usage has not come (yet):
    when the attempt ends there, they are counted as an estimated call.
    """

    usage: list[Usage]
    unreported_chunks: int = 0

    def settled(self, model: str) -> list[Usage]:
        """The calls, with an estimated one for chunks no usage record covered."""
        if self.unreported_chunks == 0:
            return list(self.usage)
        tail = Usage(model, 0, self.unreported_chunks, estimated=True)
        return [*self.usage, tail]


class ChunkBatcher:
    """Collects chunks and writes them (Postgres first, then the topic) in batches."""

    def __init__(
        self,
        writer: GroupWriter,
        emitter: Emitter,
        fence: Fence,
        run_id: str,
        attempt: int,
        seq: SeqCounter,
        futures: list[asyncio.Future[Any]],
        max_size: int,
        input_version: int | None = None,
    ) -> None:
        self.writer, self.emitter, self.fence = writer, emitter, fence
        self.run_id, self.attempt, self.seq = run_id, attempt, seq
        self.futures = futures
        self.max_size = max_size
        self.input_version = input_version
        self.pending: list[Chunk] = []
        self.streaming = False

    def add(self, kind: ChunkKind, content: str) -> None:
        self.pending.append(Chunk(self.run_id, self.seq.take(), kind, content, self.attempt))

    @property
    def full(self) -> bool:
        return len(self.pending) >= self.max_size

    async def flush(self) -> None:
        if not self.pending:
            return
        batch, self.pending = self.pending, []
        first = not self.streaming and any(c.kind is ChunkKind.CHUNK for c in batch)
        inserted = await self.writer.chunks(
            ChunkWrite(self.fence, self.run_id, batch, first, self.input_version)
        )
        if inserted is None:
            raise FencedOut(f"run {self.run_id}: chunk write fenced out")
        if first:
            self.streaming = True
        # The whole batch, also seqs that were in Postgres already: only this owner writes
        # them, so they are this batch (its group committed, then the answer was lost).
        self.futures += await self.emitter.chunks(self.fence.partition, batch)


class RunExecutor:
    """Runs records through the lifecycle; one instance per worker process."""

    def __init__(
        self, settings: Settings, store: RunStore, emitter: Emitter, handler: Handler
    ) -> None:
        self.settings = settings
        self.store = store
        self.emitter = emitter
        self.handler = handler
        self.writer = GroupWriter(store, fault=settings.test_fault)
        self.repair = ChunkRepair(store, emitter, self.writer)
        self.policy = RetryPolicy(settings.max_attempts, settings.retry_base_s)
        self.worker_id = settings.worker_id
        self.board = ControlBoard()
        store.observer = self.board.observe

    async def process(self, record: Record, fence: Fence, cancel: CancelToken) -> None:
        """Do the record's work; return when it may be acked."""
        ctx_log = {"partition": record.partition, "offset": record.offset}
        try:
            req = decode_run_requested(record.key, record.value, record.headers)
        except RecordError as exc:
            log.warning("dead-letter reason=%s %s", exc.reason, _kv(ctx_log))
            await self._dead_letter(record, 0, exc.reason, exc.detail)
            return
        run = await self.store.load_run(req.run_id)
        if run is None:
            await self._dead_letter(record, 0, "unknown_run", f"no run {req.run_id} in Postgres")
            return
        if run.user_id != req.user_id:
            await self._dead_letter(record, 0, "user_mismatch", "record user is not the run's")
            return
        if run.status.terminal:
            log.info("skip terminal run_id=%s status=%s %s", run.id, run.status.value, _kv(ctx_log))
            await self.repair.terminal(run, fence.partition)
            return
        for pred in await self.store.unfinished_predecessors(run) if run.older_unfinished else []:
            log.info("predecessor first run_id=%s before=%s", pred.id, run.id)
            trigger = Record(
                record.topic,
                record.partition,
                -1,
                pred.user_id.encode(),
                RunRequested(pred.id, pred.user_id, pred.session_id, "").encode(),
                headers_for(RUN_REQUESTED),
            )
            await self._execute(trigger, pred.id, pred.user_id, pred.input, fence, cancel)
        await self._execute(record, run.id, run.user_id, run.input, fence, cancel)

    async def _execute(
        self,
        record: Record,
        run_id: str,
        user_id: str,
        inp: dict[str, Any],
        fence: Fence,
        cancel: CancelToken,
    ) -> None:
        control = self.board.open(run_id)
        try:
            await self._attempts(record, run_id, user_id, inp, fence, cancel, control)
        finally:
            self.board.close(run_id)

    async def _attempts(
        self,
        record: Record,
        run_id: str,
        user_id: str,
        inp: dict[str, Any],
        fence: Fence,
        cancel: CancelToken,
        control: RunControl,
    ) -> None:
        started = time.monotonic()
        # Every attempt's deliveries are awaited before the ack, retries' included.
        futures: list[asyncio.Future[Any]] = []
        resumed = False
        # The calls of attempts a merge stopped: in the ledger with their own attempt, and
        # in the run's usage rows with the run's ending.
        billed: list[Usage] = []
        while True:
            claim = await self.writer.claim(ClaimWrite(fence, run_id, self.worker_id))
            if claim is None:
                current = await self.store.load_run(run_id)
                if current is not None and current.status.terminal:
                    return  # someone finished it first; nothing to do
                raise FencedOut(f"run {run_id}: claim fenced out")
            attempt = claim.attempt
            rerun = control.attempt_version < claim.input_version
            token = control.begin(claim.input_version)
            if claim.input is not None:
                inp = claim.input
            if attempt == 1 and claim.queue_age_s is not None:
                QUEUE_AGE_SECONDS.observe(max(0.0, claim.queue_age_s))
            if not resumed:  # earlier output may be in Postgres only (its writer died)
                futures += await self.repair.resumed(run_id, fence.partition, claim.next_seq)
                resumed = True
            seq = SeqCounter(claim.next_seq)
            batcher = ChunkBatcher(
                self.writer,
                self.emitter,
                fence,
                run_id,
                attempt,
                seq,
                futures,
                self.settings.chunk_batch_size,
                claim.input_version,
            )
            ctx = RunContext(run_id, user_id, inp, attempt, token)
            if claim.cancel_requested:
                # The request is durable: whoever claims next ends the run, never reruns it.
                await self._cancel(batcher, fence, ctx, claim.cancel_reason, billed, [])
                return
            futures.append(
                await self.emitter.event(
                    fence.partition,
                    run_id,
                    "transition",
                    to="running",
                    attempt=attempt,
                    worker_id=self.worker_id,
                    **({"reason": "merged", "input_version": claim.input_version} if rerun else {}),
                )
            )
            # The retry budget counts handler failures; resumptions after a handoff or a
            # dead worker are not the run's fault. Claims still have a (larger) bound, so a
            # run that takes its worker down every time cannot circulate for ever.
            if self.policy.exhausted(claim.failures):
                await self._give_up(record, batcher, fence, ctx, attempt - 1, "attempts exhausted")
                return
            if attempt > self.settings.max_attempts * MAX_CLAIMS_PER_ATTEMPT:
                await self._give_up(
                    record,
                    batcher,
                    fence,
                    ctx,
                    attempt - 1,
                    f"claimed {attempt - 1} times without finishing (cut off or its worker died)",
                )
                return
            if claim.had_output:
                batcher.add(ChunkKind.RESET, json.dumps({"attempt": attempt}))
                if rerun:
                    # Viewers drop the answer to the old input now, not with the
                    # rerun's first chunk batch (a model's first token can take seconds).
                    await batcher.flush()
            log.info(
                "run start run_id=%s user_id=%s attempt=%d partition=%d offset=%d",
                run_id,
                user_id,
                attempt,
                record.partition,
                record.offset,
            )
            tally = CallTally([])
            try:
                await self._stream(ctx, batcher, started, control, tally)
            except HandlerError as exc:
                if not control.stopping:  # stopped on purpose: the handler's complaint is moot
                    # Keep what this attempt already said, so seq stays contiguous.
                    await batcher.flush()
                    # The failed attempt's calls are billed: into the ledger before
                    # anything else of the failure (whoever owns the run by now).
                    futures += await self._record_attempt(fence, ctx, tally, Outcome.FAILED)
                    error = str(exc)
                    RETRIES.inc()
                    failures = await self.store.record_failure(fence, run_id)
                    if failures is None:
                        raise FencedOut(f"run {run_id}: failure count fenced out") from exc
                    log.warning(
                        "attempt failed run_id=%s attempt=%d failures=%d error=%s",
                        run_id,
                        attempt,
                        failures,
                        error[:200],
                    )
                    if isinstance(exc, RunFailed) or self.policy.exhausted(failures):
                        await self._give_up(record, batcher, fence, ctx, attempt, error)
                        return
                    # Output already written stays; the next attempt starts with `reset`.
                    await asyncio.sleep(self.policy.backoff_s(failures))
                    continue
            except (FencedOut, asyncio.CancelledError):
                await self._record_cut(fence, ctx, tally)
                raise
            own = tally.settled(self._model)
            if control.cancel_requested:
                await self._cancel(batcher, fence, ctx, control.cancel_reason, billed, own)
                return
            if control.stopping:
                futures += await self._merged_stop(batcher, fence, ctx, tally)
                billed = [*billed, *own]
                continue
            batcher.add(ChunkKind.DONE, json.dumps({"status": "done"}))
            final = batcher.pending
            batcher.pending = []
            first = not batcher.streaming and any(c.kind is ChunkKind.CHUNK for c in final)
            try:
                finished = await self.writer.finish(
                    FinishWrite(
                        fence,
                        run_id,
                        RunStatus.DONE,
                        final,
                        [*billed, *own],
                        first_output=first,
                        input_version=claim.input_version,
                        ledger=self._calls(ctx, own, Outcome.OK),
                    )
                )
                if finished is None:
                    raise FencedOut(f"run {run_id}: finish fenced out")
            except (FencedOut, asyncio.CancelledError):
                # Rows the finish committed stay as written (ok); the others are cancelled.
                await self._record_cut(fence, ctx, tally)
                raise
            if isinstance(finished, Superseded):
                # The row changed under this attempt and no signal said so: the finish
                # refused to write. Give the done event's seq back and act on the row.
                batcher.pending = final[:-1]
                seq.give_back(final[-1].seq)
                if finished.cancelled:
                    control.cancel(finished.cancel_reason)
                    await self._cancel(batcher, fence, ctx, finished.cancel_reason, billed, own)
                    return
                control.merged(finished.input_version)
                futures += await self._merged_stop(batcher, fence, ctx, tally)
                billed = [*billed, *own]
                continue
            futures += await self.emitter.chunks(fence.partition, final)
            futures.append(
                await self.emitter.event(
                    fence.partition, run_id, "transition", to="done", attempt=attempt
                )
            )
            futures += await self._finish_events(fence, ctx, billed, own, Outcome.OK, finished)
            await asyncio.gather(*futures)
            self.repair.published(run_id, final[-1].seq)
            RUNS.labels(outcome="done").inc()
            RUN_DURATION_SECONDS.labels(outcome="done").observe(time.monotonic() - started)
            log.info("run done run_id=%s attempt=%d", run_id, attempt)
            return

    @property
    def _model(self) -> str:
        """The model an estimated call is priced as: the handler's, else its name."""
        return str(getattr(self.handler, "model", self.handler.name))

    def _calls(self, ctx: RunContext, usage: list[Usage], outcome: Outcome) -> list[LedgerCall]:
        """The ledger rows of ``ctx``'s attempt (none with the ledger switched off)."""
        if not self.settings.cost_ledger:
            return []
        return calls_of(ctx.user_id, ctx.run_id, ctx.attempt, usage, outcome)

    async def _record_attempt(
        self, fence: Fence, ctx: RunContext, tally: CallTally, outcome: Outcome
    ) -> list[asyncio.Future[Any]]:
        """Write an attempt's calls to the ledger with ``outcome``; its usage events."""
        usage = tally.settled(self._model)
        if not usage or not self.settings.cost_ledger:
            return []
        priced = await self.store.record_calls(self._calls(ctx, usage, outcome))
        return await self._usage_events(fence, ctx, usage, outcome, priced)

    async def _record_cut(self, fence: Fence, ctx: RunContext, tally: CallTally) -> None:
        """An attempt cut off (handoff ceiling, fenced out): its calls were billed all the
        same, so they go to the ledger as ``cancelled``, shielded from the cancellation.
        A failure here is logged, never raised over the cut itself."""
        if not tally.settled(self._model) or not self.settings.cost_ledger:
            return
        try:
            await asyncio.shield(self._record_attempt(fence, ctx, tally, Outcome.CANCELLED))
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

    async def _finish_events(
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
        if self.settings.cost_ledger:
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
            if self.settings.cost_ledger:
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

    async def _merged_stop(
        self, batcher: ChunkBatcher, fence: Fence, ctx: RunContext, tally: CallTally
    ) -> list[asyncio.Future[Any]]:
        """A merge stopped this attempt: keep what it said (seq stays contiguous) and bill
        its calls (``cancelled``: its answer was dropped); the next claim reads the merged
        input and starts with ``reset``. Returns the usage events' deliveries."""
        await batcher.flush()
        await asyncio.gather(*batcher.futures)
        futures = await self._record_attempt(fence, ctx, tally, Outcome.CANCELLED)
        log.info("run merged run_id=%s attempt=%d: running again", ctx.run_id, ctx.attempt)
        return futures

    async def _cancel(
        self,
        batcher: ChunkBatcher,
        fence: Fence,
        ctx: RunContext,
        reason: str | None,
        billed: list[Usage],
        own: list[Usage],
    ) -> None:
        """End the run ``cancelled``: partial output stays, the calls so far are billed
        (``own``, this attempt's, go to the ledger as ``cancelled``, an estimated one for
        output no usage record covered), a terminal ``cancelled`` event (with the reason)
        ends every viewer's stream."""
        run_id = batcher.run_id
        batcher.add(ChunkKind.CANCELLED, json.dumps({"status": "cancelled", "reason": reason}))
        final = batcher.pending
        batcher.pending = []
        first = not batcher.streaming and any(c.kind is ChunkKind.CHUNK for c in final)
        finished = await self.writer.finish(
            FinishWrite(
                fence,
                run_id,
                RunStatus.CANCELLED,
                final,
                [*billed, *own],
                first_output=first,
                ledger=self._calls(ctx, own, Outcome.CANCELLED),
            )
        )
        if not isinstance(finished, Finished):
            raise FencedOut(f"run {run_id}: cancel fenced out")
        futures = await self.emitter.chunks(fence.partition, final)
        futures.append(
            await self.emitter.event(
                fence.partition,
                run_id,
                "transition",
                to="cancelled",
                attempt=ctx.attempt,
                **({"reason": reason} if reason else {}),
            )
        )
        futures += await self._finish_events(fence, ctx, billed, own, Outcome.CANCELLED, finished)
        await asyncio.gather(*futures, *batcher.futures)
        self.repair.published(run_id, final[-1].seq)
        RUNS.labels(outcome="cancelled").inc()
        log.info("run cancelled run_id=%s attempt=%d", run_id, ctx.attempt)

    async def _stream(
        self,
        ctx: RunContext,
        batcher: ChunkBatcher,
        started: float,
        control: RunControl,
        tally: CallTally,
    ) -> None:
        """Pump the handler into the batcher; flush by size or after ``chunk_batch_ms``.

        A cancel or a merge (``control``) stops the attempt at once: the handler's task
        is cancelled and what it said so far stays in the batcher. Usage records go to
        ``tally`` as they come, so a failed, stopped or cut attempt still knows its calls.
        """
        queue: asyncio.Queue[Any] = asyncio.Queue(maxsize=4 * batcher.max_size)
        pump = asyncio.create_task(_pump(self.handler.stream(ctx), queue))

        def stop() -> None:
            log.info("attempt stopped run_id=%s by=%s", ctx.run_id, ctx.cancel.reason)
            pump.cancel()
            with contextlib.suppress(asyncio.QueueFull):  # full: the loop is not waiting
                queue.put_nowait(_STOP)

        control.on_stop(stop)
        window = self.settings.chunk_batch_ms / 1000.0
        deadline: float | None = None
        first = True
        try:
            while True:
                try:
                    # What the handler already queued is taken without a wait_for task
                    # and without yielding to the loop per chunk: on a busy worker each
                    # yield could outlast the window and split the batch.
                    item = queue.get_nowait()
                except asyncio.QueueEmpty:
                    timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
                    try:
                        item = await asyncio.wait_for(queue.get(), timeout)
                    except TimeoutError:
                        await batcher.flush()
                        deadline = None
                        continue
                if item is _END or item is _STOP or control.stopping:
                    if control.stopping:
                        held = [item] if isinstance(item, Usage) else []
                        tally.usage += [*held, *_usage_queued(queue)]
                    break
                if isinstance(item, BaseException):
                    if isinstance(item, HandlerError):
                        raise item
                    raise HandlerError(f"{type(item).__name__}: {item}") from item
                if isinstance(item, Usage):
                    tally.usage.append(item)
                    tally.unreported_chunks = 0
                    continue
                if isinstance(item, ToolActivity):
                    batcher.add(ChunkKind.TOOL, item.content)
                    if batcher.full or window == 0:
                        await batcher.flush()
                        deadline = None
                    elif deadline is None:
                        deadline = time.monotonic() + window
                    continue
                if first:
                    TIME_TO_FIRST_CHUNK_SECONDS.observe(time.monotonic() - started)
                    first = False
                batcher.add(ChunkKind.CHUNK, str(item))
                tally.unreported_chunks += 1
                if batcher.full or window == 0:
                    await batcher.flush()
                    deadline = None
                elif deadline is None:
                    deadline = time.monotonic() + window
            # The last batch is not flushed here: ``finish`` writes it with the terminal
            # event in one transaction. A short run then costs one commit (and its
            # fsync) fewer, and the batch is produced no later than before.
        finally:
            if not pump.done():
                pump.cancel()
                await asyncio.gather(pump, return_exceptions=True)

    async def _give_up(
        self,
        record: Record,
        batcher: ChunkBatcher,
        fence: Fence,
        ctx: RunContext,
        attempts: int,
        error: str,
    ) -> None:
        """Retries exhausted: DLQ record, ``failed``, an ``error`` event, then ack."""
        await self._dead_letter(record, attempts, "handler_failed", error)
        batcher.add(ChunkKind.ERROR, json.dumps({"error": error[:500], "attempts": attempts}))
        final = batcher.pending
        batcher.pending = []
        finished = await self.writer.finish(
            FinishWrite(fence, final[0].run_id, RunStatus.FAILED, final, error=error[:2000])
        )
        if finished is None:
            raise FencedOut(f"run {final[0].run_id}: fail fenced out")
        if isinstance(finished, Superseded):  # a cancel request wins over the failure
            batcher.pending = final[:-1]
            batcher.seq.give_back(final[-1].seq)
            await self._cancel(batcher, fence, ctx, finished.cancel_reason, [], [])
            return
        futures = await self.emitter.chunks(fence.partition, final)
        futures.append(
            await self.emitter.event(
                fence.partition, final[0].run_id, "transition", to="failed", attempt=attempts
            )
        )
        await asyncio.gather(*futures, *batcher.futures)
        self.repair.published(final[0].run_id, final[-1].seq)
        RUNS.labels(outcome="failed").inc()
        log.warning("run failed run_id=%s attempts=%d", final[0].run_id, attempts)

    async def _dead_letter(self, record: Record, attempts: int, reason: str, error: str) -> None:
        await self.emitter.dead_letter(
            key=record.key,
            value=record.value,
            headers=record.headers,
            topic=record.topic,
            partition=record.partition,
            offset=record.offset,
            attempts=attempts,
            reason=reason,
            error=error,
        )


async def _pump(source: AsyncIterator[Item], queue: asyncio.Queue[Any]) -> None:
    try:
        async for item in source:
            await queue.put(item)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - handed to the consumer side
        await queue.put(exc)
        return
    await queue.put(_END)


def _usage_queued(queue: asyncio.Queue[Any]) -> list[Usage]:
    """The usage records a stopped handler had already queued: those calls were made,
    so they are billed, while the chunks queued with them are not shown."""
    out = []
    while not queue.empty():
        item = queue.get_nowait()
        if isinstance(item, Usage):
            out.append(item)
    return out


def _kv(fields: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in fields.items())


def _cost(usd: Decimal | None) -> dict[str, str]:
    """The usage event's ``cost_usd`` field, priced in the same transaction as the row."""
    return {} if usd is None else {"cost_usd": str(usd)}
