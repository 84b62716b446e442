"""One queue, one flusher, many requests per batch: the group commits' shared helper.

The gateway's admissions and ``published_at`` marks, the worker's group commit and its
coalesced run reads all do the same thing: requests queue while one batch is in
flight, and the next batch takes what queued meanwhile (up to a bound), so a lone
request waits for nothing and a busy process sends fewer, larger batches.
:class:`Batcher` is that mechanism; its users say what a batch does.

Failure rules (each one provoked in tests/unit/test_batching.py):

* **One flusher.** At most one flusher task runs; it is started by the first request
  that finds none running and ends when the queue is empty, so the next request
  starts a new one.
* **A failed batch fails each of its requests.** When ``flush`` raises, every request
  of that batch gets the error (none is left waiting) and the next batch is flushed as
  usual. A ``flush`` that returns the wrong number of outcomes fails its batch too.
* **Retry alone.** When ``retry_alone(error, items)`` says so, each request of a
  failed batch of several is flushed again as a batch of its own (``flush_alone``,
  default ``flush``), so the item the batch failed on fails alone and the others get
  their answers. A batch of one is never retried.
* **Per-request outcomes.** ``flush`` returns one outcome per item, in order: the
  request's answer, an exception instance (that request's own error), or
  :data:`AGAIN` (the request goes back to the end of the queue and keeps waiting).
* **A waiter that goes away.** A request whose caller is cancelled is still flushed
  and its outcome dropped, unless ``withdraw`` is set: then a request not yet taken
  into a batch is taken out of the queue, unflushed. A request in a batch in flight
  cannot be taken back.
* **Closing.** :meth:`close` with ``drain`` (the default) waits until the flusher has
  flushed everything queued; without it, the flusher is cancelled, and the batch in
  flight and every queued request end with ``closed()`` (or are cancelled when
  ``closed`` is None). A flusher cancelled from outside ends its requests the same way.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeAlias, TypeVar

In = TypeVar("In")
Out = TypeVar("Out")
V = TypeVar("V")


class Again(enum.Enum):
    AGAIN = "again"


AGAIN = Again.AGAIN
"""An outcome that puts the request back at the end of the queue (it keeps waiting)."""

Outcome: TypeAlias = Out | BaseException | Again
"""One request's outcome of a flush: its answer, its own error, or AGAIN."""
Flush: TypeAlias = Callable[[list[In]], Awaitable[Sequence[Outcome[Out]]]]

MAX_BATCH = 256


@dataclass(eq=False)
class _Request(Generic[In, Out]):
    item: In
    answer: asyncio.Future[Out]


class Batcher(Generic[In, Out]):
    """Requests queued, flushed in batches by one lazily started flusher task.

    ``flush(items)`` handles one batch and returns one outcome per item. ``take(items)``
    chooses the next batch among the queued items (the indices to take, in queue
    order; default: the oldest ``max_batch``); at least the oldest item is taken when it
    chooses none. ``delay_s`` makes a new flusher wait that long before its first
    batch, so the requests of that interval share it.
    """

    def __init__(
        self,
        flush: Flush[In, Out],
        *,
        name: str,
        max_batch: int = MAX_BATCH,
        take: Callable[[Sequence[In]], Sequence[int]] | None = None,
        retry_alone: Callable[[Exception, Sequence[In]], bool] | None = None,
        flush_alone: Flush[In, Out] | None = None,
        withdraw: bool = False,
        closed: Callable[[], BaseException] | None = None,
        delay_s: float = 0.0,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        self.name = name
        self._flush = flush
        self._flush_alone = flush if flush_alone is None else flush_alone
        self._max_batch = max_batch
        self._take_indices = take
        self._retry_alone = retry_alone
        self._withdraw = withdraw
        self._closed = closed
        self._delay_s = delay_s
        self._queue: list[_Request[In, Out]] = []
        self._task: asyncio.Task[None] | None = None

    @property
    def waiting(self) -> int:
        """Requests queued for the next batch (not those of the batch in flight)."""
        return len(self._queue)

    @property
    def queued(self) -> list[In]:
        """The items queued for the next batches, oldest first."""
        return [r.item for r in self._queue]

    @property
    def flusher(self) -> asyncio.Task[None] | None:
        """The flusher task, running or ended; None before the first request."""
        return self._task

    async def submit(self, item: In) -> Out:
        """``item``'s answer once a batch has flushed it (or its error)."""
        request = self._enqueue(item)
        try:
            return await asyncio.shield(request.answer)
        except asyncio.CancelledError:
            if not request.answer.done():
                if self._withdraw and request in self._queue:
                    self._queue.remove(request)  # not taken yet: never flushed
                    request.answer.cancel()
                else:  # flushed anyway: its outcome is nobody's to read
                    request.answer.add_done_callback(_consume)
            raise

    def put(self, item: In) -> None:
        """Queue ``item`` with nobody waiting for it; its outcome is dropped."""
        self._enqueue(item).answer.add_done_callback(_consume)

    def _enqueue(self, item: In) -> _Request[In, Out]:
        request: _Request[In, Out] = _Request(item, asyncio.get_running_loop().create_future())
        self._queue.append(request)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name=self.name)
        return request

    async def close(self, *, drain: bool = True) -> None:
        """Drain: wait until everything queued is flushed. Otherwise stop the flusher
        and end the batch in flight and the queued requests with ``closed()``."""
        if drain:
            while self._task is not None and not self._task.done():
                await asyncio.gather(self._task, return_exceptions=True)
            return
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        self._end(self._queue)
        self._queue = []

    async def _run(self) -> None:
        batch: list[_Request[In, Out]] = []
        try:
            if self._delay_s > 0:
                await asyncio.sleep(self._delay_s)
            while self._queue:
                batch = self._take()
                await self._flush_batch(batch)
                batch = []
        except asyncio.CancelledError:
            self._end(batch + self._queue)
            self._queue = []
            raise

    def _take(self) -> list[_Request[In, Out]]:
        if self._take_indices is None:
            batch = self._queue[: self._max_batch]
            del self._queue[: self._max_batch]
            return batch
        chosen = set(self._take_indices([r.item for r in self._queue])) or {0}
        batch = [r for i, r in enumerate(self._queue) if i in chosen]
        self._queue = [r for i, r in enumerate(self._queue) if i not in chosen]
        return batch

    async def _flush_batch(self, batch: list[_Request[In, Out]]) -> None:
        items = [r.item for r in batch]
        try:
            outcomes = await self._flush(items)
        except Exception as exc:  # noqa: BLE001 - every request of the batch hears of it
            retry = self._retry_alone
            if len(batch) > 1 and retry is not None and retry(exc, items):
                for request in batch:
                    await self._flush_one(request)
                return
            self._fail(batch, exc)
            return
        self._settle(batch, outcomes)

    async def _flush_one(self, request: _Request[In, Out]) -> None:
        try:
            outcomes = await self._flush_alone([request.item])
        except Exception as exc:  # noqa: BLE001 - its own error, handed to it
            self._fail([request], exc)
            return
        self._settle([request], outcomes)

    def _settle(self, batch: list[_Request[In, Out]], outcomes: Sequence[Outcome[Out]]) -> None:
        if len(outcomes) != len(batch):
            self._fail(
                batch,
                RuntimeError(
                    f"{self.name}: a batch of {len(batch)} came back with {len(outcomes)} outcomes"
                ),
            )
            return
        for request, outcome in zip(batch, outcomes, strict=True):
            if request.answer.done():
                continue  # withdrawn or ended: nobody listens
            if outcome is AGAIN:
                self._queue.append(request)
            elif isinstance(outcome, BaseException):
                request.answer.set_exception(outcome)
            else:
                request.answer.set_result(outcome)

    @staticmethod
    def _fail(batch: Sequence[_Request[In, Out]], exc: BaseException) -> None:
        for request in batch:
            if not request.answer.done():
                request.answer.set_exception(exc)

    def _end(self, requests: Sequence[_Request[In, Out]]) -> None:
        for request in requests:
            if request.answer.done():
                continue
            if self._closed is None:
                request.answer.cancel()
            else:
                request.answer.set_exception(self._closed())


def _consume(answer: asyncio.Future[Any]) -> None:
    """Retrieve a dropped outcome, so asyncio does not log it as never retrieved."""
    if not answer.cancelled():
        answer.exception()


# --- reads by key, coalesced ---------------------------------------------------------
# Reads by key, coalesced: the keys asked for while one read is in flight are read by
# the next one, together.
#
# A poll hands the worker many runs at once, one per partition chain, and each chain
# starts by reading its run's row. One statement per run was a connection checkout and a
# round trip each. :class:`CoalescedReads` sends the first request at once (no timer, so
# a lone read waits for nothing) and the requests that arrive meanwhile in one read
# after it, as the group commit does for writes.
#
# Failure mode: a read that fails fails every request of its batch, each with the error
# its own read would have raised; the requests queued behind it get a read of their own.
# A caller that goes away (cancelled) is skipped when its answer arrives; a reader
# cancelled itself (the loop closing) cancels every request still waiting.

COALESCED_MAX_BATCH = 256


class CoalescedReads(Generic[V]):
    """``read(keys)`` returns the values of the keys it found; :meth:`get` is one key's.

    At most ``max_batch`` keys go into one read; more wait for the next. The queue and
    the reader are :class:`Batcher` (its failure rules).
    """

    def __init__(
        self,
        read: Callable[[list[str]], Awaitable[dict[str, V]]],
        *,
        max_batch: int = COALESCED_MAX_BATCH,
    ) -> None:
        self._read = read
        self._batcher: Batcher[str, V | None] = Batcher(
            self._read_batch, name="coalesced-reads", max_batch=max_batch
        )
        self.reads = 0  # reads sent, for tests and the bench

    @property
    def _reader(self) -> asyncio.Task[None] | None:
        """The reader task (tests cancel it)."""
        return self._batcher.flusher

    async def get(self, key: str) -> V | None:
        """``key``'s value, or None when the read did not find it."""
        return await self._batcher.submit(key)

    async def close(self) -> None:
        """Let the reads in flight and queued finish."""
        await self._batcher.close()

    async def _read_batch(self, keys: list[str]) -> list[V | None]:
        self.reads += 1
        found = await self._read(sorted(set(keys)))
        return [found.get(key) for key in keys]
