"""Execute one runs-topic record: decode, claim, stream, retry, finish or dead-letter.

``RunExecutor.process`` returns normally when the record may be acked (its
outcome is durable in Postgres and on the topics), and raises :class:`FencedOut`
when this worker no longer owns the partition: then nothing is acked and the
successor redoes the work. ``asyncio.CancelledError`` (handoff ceiling) also
leaves the record unacked.
"""

from __future__ import annotations

import asyncio
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
from koda.lifecycle.retry import RetryPolicy
from koda.lifecycle.states import RunStatus
from koda.metrics import (
    QUEUE_AGE_SECONDS,
    RETRIES,
    RUN_DURATION_SECONDS,
    RUNS,
    TIME_TO_FIRST_CHUNK_SECONDS,
)
from koda.settings import Settings
from processors.emitter import Emitter
from processors.groupcommit import GroupWriter
from processors.store import ChunkWrite, ClaimWrite, Fence, FinishWrite, RunStore
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
    ) -> None:
        self.writer, self.emitter, self.fence = writer, emitter, fence
        self.run_id, self.attempt, self.seq = run_id, attempt, seq
        self.futures = futures
        self.max_size = max_size
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
        inserted = await self.writer.chunks(ChunkWrite(self.fence, self.run_id, batch, first))
        if inserted is None:
            raise FencedOut(f"run {self.run_id}: chunk write fenced out")
        if first:
            self.streaming = True
        self.futures += await self.emitter.chunks(self.fence.partition, _only(batch, inserted))


def _only(chunks: list[Chunk], seqs: list[int]) -> list[Chunk]:
    keep = set(seqs)
    return [c for c in chunks if c.seq in keep]


class RunExecutor:
    """Runs records through the lifecycle; one instance per worker process."""

    def __init__(
        self, settings: Settings, store: RunStore, emitter: Emitter, handler: Handler
    ) -> None:
        self.settings = settings
        self.store = store
        self.emitter = emitter
        self.handler = handler
        self.writer = GroupWriter(store)
        self.policy = RetryPolicy(settings.max_attempts, settings.retry_base_s)
        self.worker_id = settings.worker_id

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
            return
        for pred in await self.store.pending_predecessors(run) if run.older_pending else []:
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
        started = time.monotonic()
        while True:
            claim = await self.writer.claim(ClaimWrite(fence, run_id, self.worker_id))
            if claim is None:
                current = await self.store.load_run(run_id)
                if current is not None and current.status.terminal:
                    return  # someone finished it first; nothing to do
                raise FencedOut(f"run {run_id}: claim fenced out")
            attempt = claim.attempt
            if attempt == 1 and claim.queue_age_s is not None:
                QUEUE_AGE_SECONDS.observe(max(0.0, claim.queue_age_s))
            futures: list[asyncio.Future[Any]] = []
            futures.append(
                await self.emitter.event(
                    fence.partition,
                    run_id,
                    "transition",
                    to="running",
                    attempt=attempt,
                    worker_id=self.worker_id,
                )
            )
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
            )
            # The retry budget counts handler failures; resumptions after a handoff or a
            # dead worker are not the run's fault. Claims still have a (larger) bound, so a
            # run that takes its worker down every time cannot circulate for ever.
            if self.policy.exhausted(claim.failures):
                await self._give_up(record, batcher, fence, attempt - 1, "attempts exhausted")
                return
            if attempt > self.settings.max_attempts * MAX_CLAIMS_PER_ATTEMPT:
                await self._give_up(
                    record,
                    batcher,
                    fence,
                    attempt - 1,
                    f"claimed {attempt - 1} times without finishing (cut off or its worker died)",
                )
                return
            if claim.had_output:
                batcher.add(ChunkKind.RESET, json.dumps({"attempt": attempt}))
            log.info(
                "run start run_id=%s user_id=%s attempt=%d partition=%d offset=%d",
                run_id,
                user_id,
                attempt,
                record.partition,
                record.offset,
            )
            ctx = RunContext(run_id, user_id, inp, attempt, cancel)
            try:
                usage = await self._stream(ctx, batcher, started)
            except HandlerError as exc:
                # Keep what this attempt already said, so seq stays contiguous.
                await batcher.flush()
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
                    await self._give_up(record, batcher, fence, attempt, error)
                    return
                # Output already written stays; the next attempt starts with `reset`.
                await asyncio.sleep(self.policy.backoff_s(failures))
                continue
            batcher.add(ChunkKind.DONE, json.dumps({"status": "done"}))
            final = batcher.pending
            batcher.pending = []
            first = not batcher.streaming and any(c.kind is ChunkKind.CHUNK for c in final)
            finished = await self.writer.finish(
                FinishWrite(fence, run_id, RunStatus.DONE, final, usage, first_output=first)
            )
            if finished is None:
                raise FencedOut(f"run {run_id}: finish fenced out")
            futures += await self.emitter.chunks(fence.partition, _only(final, finished.inserted))
            futures.append(
                await self.emitter.event(
                    fence.partition, run_id, "transition", to="done", attempt=attempt
                )
            )
            for i, u in enumerate(usage):
                futures.append(
                    await self.emitter.event(
                        fence.partition,
                        run_id,
                        "usage",
                        call_index=i,
                        model=u.model,
                        prompt_tokens=u.prompt_tokens,
                        completion_tokens=u.completion_tokens,
                        **_cost(finished.costs.get(i)),
                    )
                )
            await asyncio.gather(*futures)
            RUNS.labels(outcome="done").inc()
            RUN_DURATION_SECONDS.labels(outcome="done").observe(time.monotonic() - started)
            log.info("run done run_id=%s attempt=%d", run_id, attempt)
            return

    async def _stream(self, ctx: RunContext, batcher: ChunkBatcher, started: float) -> list[Usage]:
        """Pump the handler into the batcher; flush by size or after ``chunk_batch_ms``."""
        usage: list[Usage] = []
        queue: asyncio.Queue[Any] = asyncio.Queue(maxsize=4 * batcher.max_size)
        pump = asyncio.create_task(_pump(self.handler.stream(ctx), queue))
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
                if item is _END:
                    break
                if isinstance(item, BaseException):
                    if isinstance(item, HandlerError):
                        raise item
                    raise HandlerError(f"{type(item).__name__}: {item}") from item
                if isinstance(item, Usage):
                    usage.append(item)
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
                if batcher.full or window == 0:
                    await batcher.flush()
                    deadline = None
                elif deadline is None:
                    deadline = time.monotonic() + window
            # The last batch is not flushed here: ``finish`` writes it with the terminal
            # event in one transaction. A short run then costs one commit (and its
            # fsync) fewer, and the batch is produced no later than before.
            return usage
        finally:
            if not pump.done():
                pump.cancel()
                await asyncio.gather(pump, return_exceptions=True)

    async def _give_up(
        self, record: Record, batcher: ChunkBatcher, fence: Fence, attempts: int, error: str
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
        futures = await self.emitter.chunks(fence.partition, _only(final, finished.inserted))
        futures.append(
            await self.emitter.event(
                fence.partition, final[0].run_id, "transition", to="failed", attempt=attempts
            )
        )
        await asyncio.gather(*futures, *batcher.futures)
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


def _kv(fields: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in fields.items())


def _cost(usd: Decimal | None) -> dict[str, str]:
    """The usage event's ``cost_usd`` field, priced in the same transaction as the row."""
    return {} if usd is None else {"cost_usd": str(usd)}
