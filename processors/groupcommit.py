"""Group commit: the worker's runs share their Postgres transactions.

Every run starts with a claim, flushes its chunks (with the ledger rows of the calls
that reported usage meanwhile) every ``KODA_CHUNK_BATCH_MS`` and ends with a finish
(trailing chunks, usage, terminal transition). Written one run at a
time, 200 streaming runs ask for 10,000 transactions a second, far more than a worker
and its database can commit, and latency grows without bound; short runs pay two
transactions and their round trips each. The writer instead takes every claim, chunk
batch and finish that is waiting, writes them all in one transaction
(``RunStore.write_group``: at most eight statements in four round trips, however
many runs), and hands
each run its own result. While one group
commits the next one gathers, so an idle worker adds no delay and a busy one commits
fewer, larger groups.

The same groups carry the marks that a terminal run's messages are all on the chunk
topic (``runs.published_seq``, :meth:`GroupWriter.published`); nothing waits for them.

Failure modes and what happens:

* a run no longer owned (fenced out): its part is not written and it gets None; the
  other runs of the group are written as usual;
* a group fails (a row Postgres refuses, a deadlock, a lost connection): each part of
  the group is written again as a group of one (the same statements), so one bad part
  fails only its own run and nothing of the failed group was half-written (it rolled
  back);
* a run cancelled while its part waits (handoff ceiling): the part is taken out of
  the queue unwritten. Once a group has started it cannot be taken back; as with a
  run cut off during its own transaction, the successor resumes after what committed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from koda_runtime.metrics import GROUP_COMMIT_RUNS, RUN_PHASE_SECONDS
from koda_runtime.processors import faults
from koda_runtime.processors.store import (
    Batched,
    ChunkWrite,
    Claim,
    ClaimWrite,
    Finished,
    FinishWrite,
    GroupResult,
    GroupWrite,
    PublishedWrite,
    Superseded,
)

log = logging.getLogger("koda.worker")

# A group holds at most this many chunk rows; a backlog is written in several groups.
MAX_GROUP_ROWS = 4096


@dataclass
class _Waiting:
    write: GroupWrite
    done: asyncio.Future[GroupResult] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class GroupStore(Protocol):
    """What the writer needs of the store: one transaction for a group of writes, a
    result per write (processors/store.py ``RunStore.write_group``)."""

    async def write_group(self, writes: Sequence[GroupWrite]) -> list[GroupResult]: ...


class GroupWriter:
    """Writes runs' claims, chunk batches and finishes to Postgres in shared transactions."""

    def __init__(
        self, store: GroupStore, max_rows: int = MAX_GROUP_ROWS, *, fault: str | None = None
    ) -> None:
        self.store = store
        self.max_rows = max_rows
        self.fault = fault  # KODA_TEST_FAULT: tests only (processors/faults.py)
        self.groups = 0  # group transactions tried (tests read it)
        self._queue: list[_Waiting] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def claim(self, write: ClaimWrite) -> Claim | None:
        """Claim one run; the claim, or None if someone moved first or it is fenced out."""
        started = time.monotonic()
        result = await self._submit(write)
        RUN_PHASE_SECONDS.labels(phase="claim").observe(time.monotonic() - started)
        if result is None or isinstance(result, Claim):
            return result
        raise TypeError(f"a claim came back as {type(result).__name__}")

    async def chunks(self, write: ChunkWrite) -> Batched | None:
        """Write one run's chunk batch (and its ledger rows); the seqs inserted, or None
        if fenced out."""
        result = await self._submit(write)
        if result is None or isinstance(result, Batched):
            return result
        raise TypeError(f"a chunk batch came back as {type(result).__name__}")

    async def finish(self, write: FinishWrite) -> Finished | Superseded | None:
        """Write one run's finish; what was written, None if fenced out, or why a cancel
        request or a merge refused it."""
        started = time.monotonic()
        result = await self._submit(write)
        RUN_PHASE_SECONDS.labels(phase="finish").observe(time.monotonic() - started)
        if result is None or isinstance(result, Finished | Superseded):
            return result
        raise TypeError(f"a finish came back as {type(result).__name__}")

    def published(self, run_id: str, seq: int) -> None:
        """Record, in a coming group, that the terminal run's messages 0..``seq`` are all on
        the chunk topic. Nothing waits for it: a mark lost with the process only means
        that run's messages are produced once more later (see processors/republish.py)."""
        waiting = self._enqueue(PublishedWrite(run_id, seq))
        waiting.done.add_done_callback(_consume)

    def _enqueue(self, write: GroupWrite) -> _Waiting:
        waiting = _Waiting(write)
        self._queue.append(waiting)
        self._wake.set()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="koda-group-writer")
        return waiting

    async def _submit(self, write: GroupWrite) -> GroupResult:
        waiting = self._enqueue(write)
        try:
            return await asyncio.shield(waiting.done)
        except asyncio.CancelledError:
            if waiting in self._queue:
                self._queue.remove(waiting)  # not started: nothing of it is written
            else:  # in a group already: its outcome is no longer anyone's to read
                waiting.done.add_done_callback(_consume)
            raise

    async def close(self) -> None:
        """Stop the writer; parts still waiting fail with a clear error."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        self._fail(self._queue, RuntimeError("the group writer was closed"))
        self._queue = []

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                group = self._take()
                try:
                    await self._write(group)
                except asyncio.CancelledError:
                    self._fail(group, RuntimeError("the group writer was closed"))
                    raise

    def _take(self) -> list[_Waiting]:
        """The oldest waiting parts up to ``max_rows`` chunk rows, one per run (at least one)."""
        group: list[_Waiting] = []
        runs: set[str] = set()
        rows = 0
        rest: list[_Waiting] = []
        for waiting in self._queue:
            size = len(waiting.write.chunks)
            fits = not group or rows + size <= self.max_rows
            if fits and waiting.write.run_id not in runs:
                group.append(waiting)
                runs.add(waiting.write.run_id)
                rows += size
            else:
                rest.append(waiting)
        self._queue = rest
        return group

    async def _write(self, group: list[_Waiting]) -> None:
        self.groups += 1
        GROUP_COMMIT_RUNS.observe(len(group))
        try:
            results = await self.store.write_group([w.write for w in group])
        except Exception as exc:  # noqa: BLE001 - each part is tried alone below
            if len(group) == 1:
                self._fail(group, exc)
                return
            log.warning(
                "group of %d runs failed (%s); writing each run alone",
                len(group),
                type(exc).__name__,
            )
            for waiting in group:
                await self._alone(waiting)
            return
        faults.after_commit(self.fault, [w.write for w in group])
        for waiting, result in zip(group, results, strict=True):
            if not waiting.done.done():
                waiting.done.set_result(result)

    async def _alone(self, waiting: _Waiting) -> None:
        """Write one part of a failed group as a group of its own: its error is its own."""
        try:
            (result,) = await self.store.write_group([waiting.write])
        except Exception as exc:  # noqa: BLE001 - the run's own error, handed to it
            if not waiting.done.done():
                waiting.done.set_exception(exc)
            return
        if not waiting.done.done():
            waiting.done.set_result(result)

    @staticmethod
    def _fail(group: list[_Waiting], exc: BaseException) -> None:
        for waiting in group:
            if not waiting.done.done():
                waiting.done.set_exception(exc)


def _consume(done: asyncio.Future[GroupResult]) -> None:
    if not done.cancelled():
        done.exception()
