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

import logging
import time
from collections.abc import Sequence
from typing import Protocol

from koda_runtime.batching import Batcher
from koda_runtime.metrics import GROUP_COMMIT_RUNS, RUN_PHASE_SECONDS
from koda_runtime.processors import faults
from koda_runtime.schemas.runs.worker import (
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


class GroupStore(Protocol):
    """What the writer needs of the store: one transaction for a group of writes, a
    result per write (schemas/runs/worker.py ``RunStore.write_group``)."""

    async def write_group(self, writes: Sequence[GroupWrite]) -> list[GroupResult]: ...


class GroupWriter:
    """Writes runs' claims, chunk batches and finishes to Postgres in shared transactions.

    The queue and the flusher are koda/batching.py's :class:`Batcher` (its failure
    rules): a group is chosen by :meth:`_take`, a failed group of several is written
    again part by part, a part whose run was cancelled before its group started is
    withdrawn, and closing fails what still waits."""

    def __init__(
        self, store: GroupStore, max_rows: int = MAX_GROUP_ROWS, *, fault: str | None = None
    ) -> None:
        self.store = store
        self.max_rows = max_rows
        self.fault = fault  # KODA_TEST_FAULT: tests only (processors/faults.py)
        self.groups = 0  # group transactions tried (tests read it)
        self._batcher: Batcher[GroupWrite, GroupResult] = Batcher(
            self._write,
            name="koda-group-writer",
            take=self._take,
            retry_alone=_each_alone,
            flush_alone=self.store.write_group,
            withdraw=True,
            closed=lambda: RuntimeError("the group writer was closed"),
        )

    @property
    def _queue(self) -> list[GroupWrite]:
        """The parts waiting for a group (tests read it)."""
        return self._batcher.queued

    async def claim(self, write: ClaimWrite) -> Claim | None:
        """Claim one run; the claim, or None if someone moved first or it is fenced out."""
        started = time.monotonic()
        result = await self._batcher.submit(write)
        RUN_PHASE_SECONDS.labels(phase="claim").observe(time.monotonic() - started)
        if result is None or isinstance(result, Claim):
            return result
        raise TypeError(f"a claim came back as {type(result).__name__}")

    async def chunks(self, write: ChunkWrite) -> Batched | None:
        """Write one run's chunk batch (and its ledger rows); the seqs inserted, or None
        if fenced out."""
        result = await self._batcher.submit(write)
        if result is None or isinstance(result, Batched):
            return result
        raise TypeError(f"a chunk batch came back as {type(result).__name__}")

    async def finish(self, write: FinishWrite) -> Finished | Superseded | None:
        """Write one run's finish; what was written, None if fenced out, or why a cancel
        request or a merge refused it."""
        started = time.monotonic()
        result = await self._batcher.submit(write)
        RUN_PHASE_SECONDS.labels(phase="finish").observe(time.monotonic() - started)
        if result is None or isinstance(result, Finished | Superseded):
            return result
        raise TypeError(f"a finish came back as {type(result).__name__}")

    def published(self, run_id: str, seq: int) -> None:
        """Record, in a coming group, that the terminal run's messages 0..``seq`` are all on
        the chunk topic. Nothing waits for it: a mark lost with the process only means
        that run's messages are produced once more later (see processors/republish.py)."""
        self._batcher.put(PublishedWrite(run_id, seq))

    async def close(self) -> None:
        """Stop the writer; parts still waiting fail with a clear error."""
        await self._batcher.close(drain=False)

    def _take(self, queued: Sequence[GroupWrite]) -> list[int]:
        """The oldest waiting parts up to ``max_rows`` chunk rows, one per run (at least one)."""
        chosen: list[int] = []
        runs: set[str] = set()
        rows = 0
        for i, write in enumerate(queued):
            size = len(write.chunks)
            fits = not chosen or rows + size <= self.max_rows
            if fits and write.run_id not in runs:
                chosen.append(i)
                runs.add(write.run_id)
                rows += size
        return chosen

    async def _write(self, group: list[GroupWrite]) -> list[GroupResult]:
        self.groups += 1
        GROUP_COMMIT_RUNS.observe(len(group))
        results = await self.store.write_group(group)
        faults.after_commit(self.fault, group)
        return results


def _each_alone(exc: Exception, group: Sequence[GroupWrite]) -> bool:
    """A failed group is written again part by part: each part's error is its own."""
    log.warning(
        "group of %d runs failed (%s); writing each run alone", len(group), type(exc).__name__
    )
    return True
