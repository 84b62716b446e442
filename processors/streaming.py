"""One attempt's output: the handler pumped into chunk batches, and its calls tallied.

:func:`stream` drives the handler; :class:`ChunkBatcher` writes its chunks, Postgres
first (through the group writer), then the chunk topic; :class:`CallTally` keeps the
attempt's billable calls, so a failed, stopped or cut attempt still knows them. A call
whose usage came is written to the ledger by the next batch (its :class:`CallBook`),
in the chunks' fenced transaction: a worker killed later in the attempt has billed it.

Output is made storable before it is batched: NUL and surrogates become U+FFFD, a
text chunk over :data:`~koda_runtime.lifecycle.chunks.MAX_CHUNK_BYTES` is written as
several, and any other event over it ends the run ``failed``. What Postgres or Kafka
refuses all the same (:func:`refusal`) ends the run ``failed`` naming the cause
(:class:`OutputRefused`), never an attempt tried again. :class:`AttemptLimits` end an
attempt at its deadline (``KODA_MAX_RUN_S``), past ``KODA_MAX_OUTPUT_BYTES`` of output,
or at the first batch whose ledger rows find the user's budget spent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

import psycopg
import sqlalchemy.exc

from koda_runtime import tracing
from koda_runtime.errors import HandlerError
from koda_runtime.lifecycle.attempts import first_output
from koda_runtime.lifecycle.chunks import (
    MAX_CHUNK_BYTES,
    Chunk,
    ChunkKind,
    SeqCounter,
    content_bytes,
    split_content,
    storable,
)
from koda_runtime.lifecycle.handler import (
    Item,
    RunContext,
    RunFailed,
    Status,
    ToolActivity,
    Usage,
)
from koda_runtime.metrics import TIME_TO_FIRST_CHUNK_SECONDS
from koda_runtime.processors.control import RunControl
from koda_runtime.processors.emitter import REFUSALS
from koda_runtime.processors.fences import FencedOut
from koda_runtime.processors.groupcommit import GroupWriter
from koda_runtime.schemas.epochs import Fence
from koda_runtime.schemas.runs.worker import ChunkWrite

if TYPE_CHECKING:
    from koda_runtime.lifecycle.ledger import Exceeded, LedgerCall
    from koda_runtime.processors.ports import RunOutput
    from koda_runtime.schemas.ledger import PricedCall

log = logging.getLogger("koda.worker")

_END = object()
_STOP = object()  # a cancel or a merge stopped the attempt
_TICK = object()  # a window or the attempt's deadline came: look at the clock


def window_end(now: float, window_s: float) -> float:
    """When a batch opened at ``now`` is flushed: on the worker's ticks, every half
    window of the event loop's clock, the first at least half a window away. Every run
    of a worker then flushes on the same ticks, and the group writer commits their
    batches together: a transaction per tick, not one per run and window. A chunk
    waits between half a window and a window (before: always a whole one), and a run
    that streams without pause still flushes once per window."""
    if window_s <= 0:
        return now
    half = window_s / 2
    return math.ceil((now + half) / half) * half


class OutputRefused(RunFailed):
    """Postgres or Kafka refused the attempt's output (or its ledger rows) for what it
    is: the same bytes would be refused on every attempt, so the run ends ``failed``
    with the cause named, without a retry."""


# What Postgres or the client refuses for the data itself: a value out of range, text
# it cannot hold, a string UTF-8 cannot encode. With the producer's refusals
# (processors/emitter.py: a record too large...), trying again cannot help.
_DATA_ERRORS: tuple[type[BaseException], ...] = (
    psycopg.DataError,
    sqlalchemy.exc.DataError,
    UnicodeEncodeError,
    *REFUSALS,
)


def refusal(exc: BaseException) -> str | None:
    """The refusal of the data itself in ``exc`` or what it wraps, as ``<type>: <text>``;
    None for anything else (an outage, a lost connection: the chain retries those)."""
    seen: BaseException | None = exc
    for _ in range(8):  # a short chain of causes; never loop on a cycle
        if seen is None:
            return None
        if isinstance(seen, _DATA_ERRORS):
            return f"{type(seen).__name__}: {storable(str(seen))[:300]}"
        seen = seen.__cause__ or seen.__context__
    return None


@dataclass(frozen=True)
class AttemptLimits:
    """What one attempt may use: it ends at ``deadline`` (``time.monotonic()``; its claim
    plus ``max_run_s``, ``KODA_MAX_RUN_S``) and after ``max_output_bytes`` of output
    (``KODA_MAX_OUTPUT_BYTES``: text and tool events, UTF-8, as cleaned). Crossing
    either ends the run ``failed``, its error naming it."""

    deadline: float
    max_run_s: float
    max_output_bytes: int

    def past_deadline(self) -> RunFailed:
        return RunFailed(
            f"deadline: the attempt ran for {self.max_run_s:g} s without finishing (KODA_MAX_RUN_S)"
        )

    def output_over(self, total: int) -> RunFailed:
        return RunFailed(
            f"output_bytes: the attempt's output reached {total} bytes, over the cap of "
            f"{self.max_output_bytes} (KODA_MAX_OUTPUT_BYTES)"
        )


def budget_spent(by: Exceeded) -> RunFailed:
    """The failure of a run whose calls spent its user's budget mid-way."""
    return RunFailed(
        f"budget_exceeded: the user's {by.period.value} budget of {by.limit_usd} USD is "
        f"spent ({by.spend_usd} USD); the run stopped after the call that crossed it"
    )


@dataclass
class CallTally:
    """An attempt's billable calls so far, and the chunks streamed since the last one.

    Chunks after the last usage record belong to a call whose usage has not come (yet):
    when the attempt ends there, they are counted as an estimated call.
    """

    usage: list[Usage]
    unreported_chunks: int = 0
    # Calls 0..written-1 are in the ledger already, written by a chunk batch (as ``ok``):
    # the attempt's end writes only the others.
    written: int = 0

    def settled(self, model: str) -> list[Usage]:
        """The calls, with an estimated one for chunks no usage record covered."""
        if self.unreported_chunks == 0:
            return list(self.usage)
        tail = Usage(model, 0, self.unreported_chunks, estimated=True)
        return [*self.usage, tail]


class CallBook(Protocol):
    """An attempt's ledger, as its chunk batches write it (processors/billing.py)."""

    def due(self) -> list[LedgerCall]:
        """The calls whose usage came and that no batch wrote yet (none: ledger off)."""
        ...

    async def written(
        self, fence: Fence, calls: list[LedgerCall], priced: list[PricedCall]
    ) -> list[asyncio.Future[Any]]:
        """``calls`` are in the ledger (``priced``: the rows inserted); their events."""
        ...

    def refused(self, calls: list[LedgerCall], cause: str) -> None:
        """Postgres refused the batch carrying ``calls``: they are not tried again."""
        ...


# A coalesced chunk grows to at most this many characters; the next token starts one.
COALESCE_MAX_CHARS = 4096


class ChunkBatcher:
    """Collects chunks and writes them (Postgres first, then the topic) in batches.

    With ``coalesce`` (``KODA_CHUNK_COALESCE``), consecutive text chunks of one batch
    are one chunk: a model's tokens of one ``KODA_CHUNK_BATCH_MS`` window cost one seq,
    one Postgres row, one chunk record and one SSE event. A viewer still gets every seq
    once, gap-free; only the granularity changes. The first output is written alone
    and at once, as without it.

    ``futures`` collects the deliveries of what it produced; the run awaits them before
    its record is acked. With a ``book``, each batch also writes the attempt's calls
    whose usage came since the last one, in the same transaction.
    """

    def __init__(
        self,
        writer: GroupWriter,
        emitter: RunOutput,
        fence: Fence,
        run_id: str,
        attempt: int,
        seq: SeqCounter,
        futures: list[asyncio.Future[Any]],
        max_size: int,
        input_version: int | None = None,
        *,
        coalesce: bool = False,
    ) -> None:
        self.writer, self.emitter, self.fence = writer, emitter, fence
        self.run_id, self.attempt, self.seq = run_id, attempt, seq
        self.futures = futures
        self.max_size = max_size
        self.input_version = input_version
        self.coalesce = coalesce
        self.pending: list[Chunk] = []
        self.streaming = False
        self.book: CallBook | None = None
        # The budget the last batch's ledger rows found spent (schemas/runs/worker.py).
        self.spent: Exceeded | None = None
        # Kafka refused a batch Postgres holds: the run is never marked whole on the topic.
        self.holed = False

    def add(self, kind: ChunkKind, content: str) -> None:
        """Add one event; ``content`` is :func:`storable` (:func:`stream` cleans the
        handler's output). A text chunk over :data:`MAX_CHUNK_BYTES` becomes several
        (same kind, consecutive seqs: a viewer joins them as it joins tokens); any other
        event over it raises :class:`RunFailed` (a tool event is one JSON value: it
        cannot be cut)."""
        if kind is ChunkKind.CHUNK:
            for piece in split_content(content):
                self._add(kind, piece)
            return
        if len(content) * 4 > MAX_CHUNK_BYTES and content_bytes(content) > MAX_CHUNK_BYTES:
            raise RunFailed(
                f"chunk_size: a {kind.value} event of {content_bytes(content)} bytes is over "
                f"the cap of {MAX_CHUNK_BYTES} bytes per event"
            )
        self._add(kind, content)

    def _add(self, kind: ChunkKind, content: str) -> None:
        last = self.pending[-1] if self.pending else None
        if (
            self.coalesce
            and kind is ChunkKind.CHUNK
            and last is not None
            and last.kind is ChunkKind.CHUNK
            and len(last.content) + len(content) <= COALESCE_MAX_CHARS
        ):
            # One window's tokens as one chunk: one seq, row, record and SSE event.
            self.pending[-1] = replace(last, content=last.content + content)
            return
        self.pending.append(Chunk(self.run_id, self.seq.take(), kind, content, self.attempt))

    def take(self) -> list[Chunk]:
        """The chunks not written yet, now the caller's to write (a finish)."""
        taken, self.pending = self.pending, []
        return taken

    def give_back(self, taken: list[Chunk]) -> None:
        """``taken`` was not written after all, and its last chunk (the end event that
        was added for it) never will be: the rest is pending again, its seq free."""
        self.pending = taken[:-1]
        self.seq.give_back(taken[-1].seq)

    @property
    def full(self) -> bool:
        return len(self.pending) >= self.max_size

    @property
    def first_output_pending(self) -> bool:
        """Whether the run's first output (``→ streaming``) waits in the batch."""
        return first_output(self.streaming, self.pending)

    async def flush(self) -> None:
        calls = self.book.due() if self.book is not None else []
        if not self.pending and not calls:
            return
        batch = self.take()
        first = first_output(self.streaming, batch)
        try:
            with tracing.span("koda.chunks.write", attributes=_batch_attributes(batch)):
                written = await self.writer.chunks(
                    ChunkWrite(self.fence, self.run_id, batch, first, self.input_version, calls)
                )
        except Exception as exc:
            cause = refusal(exc)
            if cause is None:
                raise
            # Nothing of the batch was written (its transaction rolled back): its seqs
            # are free again, and its calls, refused as they are, are not tried again.
            if batch:
                self.seq.rewind(batch[0].seq)
            if calls and self.book is not None:
                self.book.refused(calls, cause)
            raise OutputRefused(f"Postgres refused the run's output: {cause}") from exc
        if written is None:
            raise FencedOut(f"run {self.run_id}: chunk write fenced out")
        if first:
            self.streaming = True
        if written.spent is not None:
            self.spent = written.spent
        # The whole batch, also seqs that were in Postgres already: only this owner writes
        # them, so they are this batch (its group committed, then the answer was lost).
        try:
            with tracing.span("koda.chunks.produce", attributes=_batch_attributes(batch)):
                self.futures += await self.emitter.chunks(self.fence.partition, batch)
        except Exception as exc:
            cause = refusal(exc)
            if cause is None:
                raise
            self.holed = True
            raise OutputRefused(f"Kafka refused the run's output: {cause}") from exc
        if calls and self.book is not None:
            self.futures += await self.book.written(self.fence, calls, written.ledger)


def _batch_attributes(batch: list[Chunk]) -> dict[str, int] | None:
    """A chunk batch's span attributes, built only when tracing (koda/tracing.py)."""
    if not tracing.ON or not batch:
        return None
    return {"koda.chunks": len(batch), "koda.seq.first": batch[0].seq}


async def stream(
    source: AsyncIterator[Item],
    batcher: ChunkBatcher,
    control: RunControl,
    tally: CallTally,
    *,
    ctx: RunContext,
    window_s: float,
    started: float,
    limits: AttemptLimits | None = None,
) -> None:
    """Pump the handler's ``source`` into ``batcher``; flush by size or ``window_s``
    seconds after the first unflushed chunk (0: every chunk at once).

    A cancel or a merge (``control``) stops the attempt at once: the handler's task
    is cancelled and what it said so far stays in the batcher. Usage records go to
    ``tally`` as they come. Raises :class:`HandlerError` when the handler fails, and
    :class:`RunFailed` when the attempt crosses one of its ``limits`` or a batch finds
    the user's budget spent: the handler's task is cancelled, what it said before
    stays in the batcher (the call in flight is billed as estimated, as a cut one).
    """
    queue: asyncio.Queue[Any] = asyncio.Queue(maxsize=4 * batcher.max_size)
    pump = asyncio.create_task(_pump(source, queue))
    loop = asyncio.get_running_loop()
    # When the pending batch is flushed (loop.time()); None: nothing is pending. One
    # timer per window, not one per token: a token costs a queue hop and no more.
    deadline: float | None = None
    timer: asyncio.TimerHandle | None = None
    # A timer that fired says so itself: the loop may run it a hair before its time by
    # the clock (the selector's rounding), and a clock-only check would then miss it and
    # wait for the handler's next item, or, at the attempt's deadline, for ever.
    due = False  # the window's timer fired
    over = False  # the attempt's deadline timer fired

    def wake() -> None:
        # A loop blocked on an empty queue takes this and looks again; a full queue
        # means it is not blocked, and it looks per item anyway.
        with contextlib.suppress(asyncio.QueueFull):
            queue.put_nowait(_TICK)

    def window_due() -> None:
        nonlocal due
        due = True
        wake()

    def attempt_over() -> None:
        nonlocal over
        over = True
        wake()

    def open_window() -> None:
        nonlocal deadline, timer
        deadline = window_end(loop.time(), window_s)
        timer = loop.call_at(deadline, window_due)

    def stop() -> None:
        log.info("attempt stopped run_id=%s by=%s", ctx.run_id, ctx.cancel.reason)
        pump.cancel()
        with contextlib.suppress(asyncio.QueueFull):  # full: the loop is not waiting
            queue.put_nowait(_STOP)

    async def flush() -> None:
        nonlocal deadline, timer, due
        deadline, due = None, False
        if timer is not None:
            timer.cancel()
            timer = None
        await batcher.flush()
        if batcher.spent is not None:  # this batch's calls spent the user's budget
            raise budget_spent(batcher.spent)

    control.on_stop(stop)
    ends_timer = (  # the attempt's own deadline
        None
        if limits is None
        else loop.call_later(max(0.0, limits.deadline - time.monotonic()), attempt_over)
    )
    output = 0  # bytes of output so far, against limits.max_output_bytes
    first = True
    try:
        while True:
            if limits is not None and (over or time.monotonic() >= limits.deadline):
                raise limits.past_deadline()
            # Due: chunks are flushed even while the handler keeps the queue full (a
            # coalesced chunk never fills a batch); calls alone wait for a pause, and
            # ride the next batch or the finish if one is near.
            if (
                deadline is not None
                and (due or loop.time() >= deadline)
                and (batcher.pending or queue.empty())
            ):
                await flush()
            item = await queue.get()
            if item is _TICK:
                continue  # the clock is read at the top of the loop
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
                model = storable(item.model)  # a model name is output too
                tally.usage.append(item if model == item.model else replace(item, model=model))
                tally.unreported_chunks = 0
                # The call goes to the ledger with the window's batch, or alone when
                # no chunk follows within the window (a tool call, a slow next step).
                if deadline is None:
                    open_window()
                continue
            if isinstance(item, ToolActivity):
                kind, content = ChunkKind.TOOL, item.content
            elif isinstance(item, Status):
                kind, content = ChunkKind.STATUS, item.content
            else:
                kind, content = ChunkKind.CHUNK, str(item)
            # Cleaned once, here, before anything is batched or counted.
            content = storable(content)
            if limits is not None:
                output += content_bytes(content)
                if output > limits.max_output_bytes:
                    raise limits.output_over(output)
            if kind is ChunkKind.CHUNK:
                if first:
                    TIME_TO_FIRST_CHUNK_SECONDS.observe(time.monotonic() - started)
                    first = False
                tally.unreported_chunks += 1
            batcher.add(kind, content)
            # A run's first output is written at once: the time to first token is the
            # wait a user feels, and the window would add up to window_s to it.
            if batcher.full or window_s == 0 or batcher.first_output_pending:
                await flush()
            elif deadline is None:
                open_window()
        # The last batch is not flushed here: the finish writes it with the terminal
        # event in one transaction. A short run then costs one commit (and its
        # fsync) fewer, and the batch is produced no later than before.
    finally:
        for t in (timer, ends_timer):
            if t is not None:
                t.cancel()
        if not pump.done():
            pump.cancel()
            await asyncio.gather(pump, return_exceptions=True)


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
