"""Per-user erasure: ``koda users erase USER`` and ``POST /admin/users/{user_id}/erase``.

:meth:`Eraser.erase` removes a user from koda, in this order, each step in short
transactions:

1. **Schedules** are deleted first, so no new scheduled run is fired meanwhile.
2. **Open runs are cancelled** through the run-control path (schemas/runs/control.py):
   a pending run ends ``cancelled`` at once (its ``cancelled`` event produced and the
   run marked whole, as ``POST /v1/runs/{id}/cancel`` does), a running one gets a
   durable cancel request and a run-control record. The erasure then waits, up to
   ``KODA_ERASURE_WAIT_S``, until every run of the user is *settled*: terminal, and its
   output known to be whole on the chunk topic (``published_seq`` or ``compacted_at``
   set), so no worker, republish or completeness pass produces one of its chunk
   records any more. A run ended more than ``SETTLE_GRACE_S`` ago and still unmarked
   is marked by the erasure itself. Past the wait it raises :class:`RunsStillOpen`
   naming the runs (HTTP 409); nothing was deleted, the cancels stay, and erasing
   again continues.
3. **A receipt** is written to ``erasures`` (the user only as its digest).
4. **Runs**, a batch at a time: the batch's rows are locked, a tombstone is produced
   for every chunk-topic key the runs used (``<run_id>:<seq>`` for seq 0..the last
   message, unless the compactor tombstoned those already, and ``<run_id>:final``), and
   once the broker acknowledged them all the runs' messages, usage, merged messages
   and rows are deleted in the same transaction. Ledger rows stay (their ``run_id``
   keeps no foreign key, migration 0013).
5. Runs admitted meanwhile (the user's token still works) go through 2-4 again, within
   the same deadline.
6. **Sessions, memories, budgets and period spend** are deleted; the user's **ledger**
   rows are kept for finance with ``user_id`` replaced by the stable pseudonym
   (schemas/erasures.py). The user's webhooks and their deliveries and attempts go too.
7. The receipt gets its counts per store and ``completed_at``.

Idempotent by repetition: erasing a user again runs every step again (deleting what the
user made since) and records a receipt of its own, with zero counts when nothing was
left.

    KodaError
    └── RunsStillOpen    runs of the user did not settle within the wait (HTTP 409)
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from koda_runtime.errors import KodaError
from koda_runtime.lifecycle.chunks import ChunkKind, chunk_key, final_key
from koda_runtime.lifecycle.control import CANCEL, ControlRecord
from koda_runtime.lifecycle.ids import uuid7
from koda_runtime.lifecycle.states import TERMINAL
from koda_runtime.schemas import erasures
from koda_runtime.schemas.erasures import pseudonym, user_digest
from koda_runtime.schemas.runs.control import CANCELLED, REQUESTED, ControlStore
from koda_runtime.settings import Settings
from koda_runtime.topics.catalogue import RUN_CHUNKS, RUN_CONTROL, partition_for_key
from koda_runtime.topics.records.codec import RUN_CHUNK, chunk_value, headers_for

log = logging.getLogger(__name__)

CANCEL_REASON = "erasure"
POLL_S = 0.2
RUN_BATCH = 100
LEDGER_BATCH = 5000
NAMED_RUNS = 5  # runs a RunsStillOpen message names
SETTLE_GRACE_S = 5.0
_TERMINAL = sorted(s.value for s in TERMINAL)

# The stores of the counts, in the order the erasure visits them.
STORES = (
    "schedules",
    "runs_cancelled",
    "chunk_tombstones",
    "messages",
    "usage",
    "run_merges",
    "runs",
    "sessions",
    "webhook_deliveries",
    "webhooks",
    "memories",
    "budgets",
    "spend_periods",
    "ledger_pseudonymized",
)

# ``RunPublisher.send``: ``(topic, key, value, headers, partition=None)``, one record to
# a koda topic (value None: a tombstone); the future resolves on the broker's ack.
Send = Callable[..., Awaitable[Any]]


class RunsStillOpen(KodaError):
    """Runs of the user did not end (or their output did not settle on the chunk topic)
    within the wait; nothing of the user was deleted but their schedules, and the
    runs stay cancelled."""

    def __init__(self, runs: Sequence[tuple[str, str]], wait_s: float) -> None:
        self.runs = list(runs)
        named = ", ".join(f"{run_id} ({status})" for run_id, status in self.runs[:NAMED_RUNS])
        more = len(self.runs) - NAMED_RUNS
        super().__init__(
            f"{len(self.runs)} runs of the user did not end within {wait_s:g} s of the "
            f"erasure cancelling them: {named}{f' and {more} more' if more > 0 else ''}; "
            "they stay cancelled: erase again once they have ended (a terminal run is "
            "settled once its output is whole on the chunk topic: `koda chunks repair` "
            "settles one that is not)"
        )


@dataclass(frozen=True)
class Receipt:
    """What an erasure did, as recorded in ``erasures``."""

    id: str
    user_digest: str
    pseudonym: str
    requested_at: datetime
    completed_at: datetime
    counts: dict[str, int]
    requested_by: str


@dataclass
class _Tally:
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STORES, 0))

    def add(self, store: str, n: int) -> None:
        self.counts[store] += max(0, n)


class Eraser:
    """Erases one user at a time; see the module docstring for the order of the steps.

    ``send`` produces records (the gateway's producer: ``RunPublisher.send``); every
    tombstone is acknowledged before the rows it stands for are deleted.
    """

    def __init__(
        self,
        engine: AsyncEngine,
        settings: Settings,
        send: Send,
        *,
        wait_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engine = engine
        self.settings = settings
        self.send = send
        self.control = ControlStore(engine)
        self.wait_s = settings.erasure_wait_s if wait_s is None else wait_s
        self.chunks_topic = settings.names.topic(RUN_CHUNKS)
        self.control_topic = settings.names.topic(RUN_CONTROL)
        self.ack_timeout_s = settings.publish_timeout_s + 5.0
        self._clock = clock

    async def erase(self, user_id: str, requested_by: str) -> Receipt:
        """Erase ``user_id``; the receipt. Raises RunsStillOpen (runs that did not end
        in time), DatabaseError, or the producer's error when a tombstone was not
        acknowledged (the batch it belonged to was not deleted: erase again)."""
        started = datetime.now(UTC)
        deadline = self._clock() + self.wait_s
        tally = _Tally()
        tally.add("schedules", await erasures.delete_schedules(self.engine, user_id))
        receipt_id: str | None = None
        while True:
            await self._settle(user_id, deadline, tally)
            if receipt_id is None:
                receipt_id = await self._open_receipt(user_id, started, requested_by)
            while await self._delete_runs(user_id, tally):
                pass
            tally.add("schedules", await erasures.delete_schedules(self.engine, user_id))
            tally.add("sessions", await erasures.delete_sessions(self.engine, user_id))
            if not await erasures.rows_left(self.engine, user_id):
                break
            # Admitted while the erasure ran: cancel, wait and delete them too.
        await self._delete_user_rows(user_id, tally)
        completed_at = await erasures.complete_receipt(self.engine, receipt_id, tally.counts)
        log.info(
            "event=user_erased erasure_id=%s digest=%s %s",
            receipt_id,
            user_digest(user_id)[:12],
            " ".join(f"{k}={v}" for k, v in tally.counts.items()),
        )
        return Receipt(
            receipt_id,
            user_digest(user_id),
            pseudonym(user_id),
            started,
            completed_at,
            dict(tally.counts),
            requested_by,
        )

    # -- 2. cancel and wait ----------------------------------------------------------

    async def _settle(self, user_id: str, deadline: float, tally: _Tally) -> None:
        """Cancel the user's open runs, then wait until every run is settled."""
        asked: set[str] = set()
        while True:
            rows = await erasures.unsettled_runs(self.engine, user_id)
            if not rows:
                return
            for row in rows:
                if row["status"] in _TERMINAL or row["id"] in asked:
                    continue
                asked.add(row["id"])
                if await self._cancel(row["id"], user_id):
                    tally.add("runs_cancelled", 1)
            if any(row["status"] in _TERMINAL for row in rows):
                adopted = await erasures.mark_ended_runs_whole(
                    self.engine, user_id, grace_s=SETTLE_GRACE_S
                )
                if adopted:
                    log.info("event=erasure_marked_whole runs=%d", adopted)
                    continue
            if self._clock() >= deadline:
                raise RunsStillOpen([(r["id"], r["status"]) for r in rows], self.wait_s)
            await asyncio.sleep(POLL_S)

    async def _cancel(self, run_id: str, user_id: str) -> bool:
        """Cancel one open run as its owner would; True when this call cancelled it."""
        outcome = await self.control.cancel(run_id, user_id, CANCEL_REASON)
        if outcome is None:
            return False
        if outcome.outcome == CANCELLED and outcome.event_seq is not None:
            # As POST /v1/runs/{id}/cancel: the pending run's one event goes to the chunk
            # topic and the run is marked whole, so no worker produces it after the
            # tombstones.
            partition = outcome.partition
            if partition is None:
                partition = partition_for_key(user_id.encode(), self.settings.partitions)
            await self._acked(
                [
                    self.send(
                        self.chunks_topic,
                        chunk_key(run_id, outcome.event_seq).encode(),
                        chunk_value(
                            run_id,
                            outcome.event_seq,
                            ChunkKind.CANCELLED.value,
                            outcome.event_content or "",
                            0,
                        ),
                        list(headers_for(RUN_CHUNK)),
                        partition=partition,
                    )
                ]
            )
            if outcome.event_seq == 0:
                await self.control.mark_published(run_id, outcome.event_seq)
            return True
        if outcome.outcome == REQUESTED:
            record = ControlRecord(run_id, user_id, CANCEL, reason=CANCEL_REASON)
            try:
                await self._acked(
                    [self.send(self.control_topic, user_id.encode(), record.encode(), [])]
                )
            except (KodaError, TimeoutError) as exc:
                # The request is durable: the worker's next write finds it anyway.
                log.warning("event=erasure_cancel_signal_failed run_id=%s error=%s", run_id, exc)
            return True
        return False

    # -- 3. and 7. the receipt ------------------------------------------------------

    async def _open_receipt(self, user_id: str, started: datetime, by: str) -> str:
        receipt_id = uuid7()
        await erasures.open_receipt(
            self.engine, receipt_id, user_id, requested_at=started, requested_by=by
        )
        return receipt_id

    # -- 4. runs and their chunk records -----------------------------------------------

    async def _delete_runs(self, user_id: str, tally: _Tally) -> bool:
        """Tombstone and delete one batch of the user's settled runs; False when none
        was left."""

        async def tombstone(runs: Sequence[Any], last: dict[str, int]) -> None:
            tally.add("chunk_tombstones", await self._tombstone(user_id, runs, last))

        deleted = await erasures.delete_settled_runs(
            self.engine, user_id, batch=RUN_BATCH, tombstone=tombstone
        )
        if deleted is None:
            return False
        for store, n in deleted.items():
            tally.add(store, n)
        return True

    async def _tombstone(self, user_id: str, runs: Sequence[Any], last: dict[str, int]) -> int:
        """Produce a tombstone for every chunk-topic key of ``runs`` and wait for every
        acknowledgement; the number produced."""
        headers = list(headers_for(RUN_CHUNK))
        sends = []
        for run in runs:
            partition = run.partition
            if partition is None:
                partition = partition_for_key(user_id.encode(), self.settings.partitions)
            keys = [final_key(run.id)]
            if run.compacted_at is None:  # compacted: the compactor tombstoned the chunks
                keys += [chunk_key(run.id, seq) for seq in range(last.get(run.id, -1) + 1)]
            for key in keys:
                sends.append(
                    self.send(self.chunks_topic, key.encode(), None, headers, partition=partition)
                )
        await self._acked(sends)
        return len(sends)

    async def _acked(self, sends: Sequence[Awaitable[Any]]) -> None:
        """Wait for every delivery; the first failure is raised (after all settled)."""
        results = await asyncio.wait_for(
            asyncio.gather(*sends, return_exceptions=True), self.ack_timeout_s
        )
        for result in results:
            if isinstance(result, BaseException):
                raise result

    # -- 5. and 6. what is left of the user ------------------------------------------

    async def _delete_user_rows(self, user_id: str, tally: _Tally) -> None:
        for store, n in (await erasures.delete_user_rows(self.engine, user_id)).items():
            tally.add(store, n)
        while True:
            n = await erasures.pseudonymize_ledger(self.engine, user_id, batch=LEDGER_BATCH)
            tally.add("ledger_pseudonymized", n)
            if n < LEDGER_BATCH:
                return
