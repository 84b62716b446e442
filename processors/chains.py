"""One sequential chain per user key inside each held partition; a worker-wide bound on
runs in flight.

The runs topic is keyed by user, so one partition interleaves many users. Per-user
order needs only that one *user's* records run one at a time, in offset order: records
of other users on the same partition run beside it. So every (partition, key) has its
own chain, made when a record of that key arrives and gone once its queue is empty.

* The dispatcher never blocks: it appends to the key's chain. Fetching pauses for a
  partition whose records not yet started reach ``high_water`` (resumed at
  ``low_water``), and for every held partition while the worker holds ``max_backlog``
  records not yet started (resumed at half of it): memory stays bounded whatever
  arrives, and one busy partition never stalls the others.
* A chain takes a slot of the worker-wide semaphore only while a run executes, so a
  user blocked on a long run holds no slot for the records queued behind it.
* Acks happen in whatever order records end; the partition cursors commit only up to
  the lowest offset not yet acked (processors/cursor.py), so the committed offset of
  a partition is always its low-water mark: everything below it has ended.
* ``drain`` (revoke, shutdown) stops starting work on the partitions it is given,
  waits for their running work up to a ceiling, cancels the rest and never acks it.
* A fenced-out record closes its whole partition: none of its chains acks again.
* A record whose run waits for a person raises :class:`Parked`: its slot is released
  and the chain waits (``Parked.wait``) holding none, then processes the same record
  again. It is not acked meanwhile, so the partition's committed offset stays below it
  and a restart reads it again (and finds the run waiting); the user's later records
  wait behind it, other users' run beside it. A drain or a fence ends the wait.

Records waiting, by reason (``koda_runs_waiting{reason}``): ``user_order`` (behind a
record of the same user), ``worker_full`` (first of its user, waiting for a slot);
the executor counts ``model_cap`` itself.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from koda_runtime.lifecycle.handler import CancelToken
from koda_runtime.metrics import (
    INTAKE_PAUSED_PARTITIONS,
    PARTITION_QUEUE_AGE_SECONDS,
    RUNS_IN_FLIGHT,
    RUNS_WAITING,
)

log = logging.getLogger("koda.worker")

T = TypeVar("T")  # the fetched record (opaque here)

INFRA_RETRY_MAX_S = 10.0


class Parked(Exception):  # noqa: N818 - a state the chain handles, not an error
    """The record's run waits (for a person's approval): hold no slot, ``await wait()``
    (it returns when the run may go on, or to look again), then process the record
    again. Raised by ``process``."""

    def __init__(self, wait: Callable[[], Awaitable[None]], why: str = "") -> None:
        super().__init__(why or "the run waits")
        self.wait = wait


@dataclass
class Item(Generic[T]):
    event: T
    partition: int
    offset: int
    created: float  # when the record was written (unix seconds), for the queue age


@dataclass
class Chain:
    """The sequential queue of one user key in one partition (records not started)."""

    key: bytes | None
    queue: deque[Item[Any]] = field(default_factory=deque)
    task: asyncio.Task[None] | None = None
    running: bool = False
    started: bool = False  # its head record has started (and may be retrying)


@dataclass
class PartitionChains:
    """The chains of one held partition."""

    partition: int
    chains: dict[bytes | None, Chain] = field(default_factory=dict)
    closed: bool = False  # fenced out or past the drain: nothing of it is acked again
    stopping: bool = False  # draining: no new record starts
    paused: bool = False
    waiting: int = 0  # records queued, not started
    running: int = 0
    cancel: CancelToken = field(default_factory=CancelToken)
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    # Set once it is draining or closed: ends the wait of its parked records.
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    def oldest_waiting(self) -> float | None:
        heads = [c.queue[0].created for c in self.chains.values() if c.queue]
        return min(heads) if heads else None


class ChainSet:
    """The key chains of every partition this worker holds."""

    def __init__(
        self,
        *,
        max_inflight: int,
        process: Callable[[Any, int, CancelToken], Awaitable[None]],
        ack: Callable[[Any], None],
        pause: Callable[[int], None],
        resume: Callable[[int], None],
        is_fenced: Callable[[BaseException], bool],
        high_water: int = 64,
        low_water: int = 16,
        max_backlog: int | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.slots = asyncio.Semaphore(max_inflight)
        self.max_inflight = max_inflight
        self.in_flight = 0
        self.parts: dict[int, PartitionChains] = {}
        self.accepting = True
        self._process = process
        self._ack = ack
        self._pause = pause
        self._resume = resume
        self._is_fenced = is_fenced
        self.high_water = high_water
        self.low_water = low_water
        self.max_backlog = max_backlog if max_backlog is not None else 4 * max_inflight
        self.backlog_low = self.max_backlog // 2
        self.full = False  # the worker-wide backlog paused every partition
        self.not_started = 0
        self.slot_waiters = 0
        self.parked = 0  # records whose run waits for a person (no slot held)
        self._clock = clock
        self._waiting_slot = RUNS_WAITING.labels(reason="worker_full")
        self._waiting_user = RUNS_WAITING.labels(reason="user_order")
        self._waiting_person = RUNS_WAITING.labels(reason="approval")

    # --- arrival ------------------------------------------------------------------

    def dispatch(
        self,
        event: Any,
        partition: int,
        offset: int,
        key: bytes | None = None,
        created: float | None = None,
    ) -> bool:
        """Queue ``event`` on its key's chain; False if it was refused (not acked)."""
        if not self.accepting:
            return False
        part = self.parts.get(partition)
        if part is None:
            part = self.parts[partition] = PartitionChains(partition)
        if part.closed or part.stopping:
            return False
        chain = part.chains.get(key)
        if chain is None:
            chain = part.chains[key] = Chain(key)
        when = self._clock() if created is None else created
        chain.queue.append(Item(event, partition, offset, when))
        part.waiting += 1
        self.not_started += 1
        if chain.task is None:
            chain.task = asyncio.create_task(self._run(part, chain), name=f"chain-{partition}")
            part.tasks.add(chain.task)
        if part.waiting >= self.high_water:
            # Repeated on purpose: a pause that reached the consumer after its assignment
            # changed was dropped there.
            self._set_paused(part, True)
        if not self.full and self.not_started >= self.max_backlog:
            self.full = True
            for p in self.parts.values():
                self._set_paused(p, True)
        self._gauges()
        return True

    # --- flow control -------------------------------------------------------------

    def _set_paused(self, part: PartitionChains, paused: bool) -> None:
        was = part.paused
        part.paused = paused
        if paused != was:
            INTAKE_PAUSED_PARTITIONS.inc() if paused else INTAKE_PAUSED_PARTITIONS.dec()
        # Flow control is an optimisation: a failure must never stop dispatching.
        try:
            (self._pause if paused else self._resume)(part.partition)
        except Exception:  # noqa: BLE001
            log.exception("flow control failed partition=%d", part.partition)

    def _started_one(self, part: PartitionChains) -> None:
        part.waiting -= 1
        self.not_started -= 1
        if not self._unfull() and part.paused and not self.full and part.waiting <= self.low_water:
            self._set_paused(part, False)

    def _unfull(self) -> bool:
        """End the worker-wide pause once the backlog is down to ``backlog_low``: resume
        every partition whose own backlog is low. True if it ended it."""
        if not (self.full and self.not_started <= self.backlog_low):
            return False
        self.full = False
        for p in self.parts.values():
            if p.paused and p.waiting <= self.low_water:
                self._set_paused(p, False)
        return True

    def _gauges(self) -> None:
        self._waiting_slot.set(self.slot_waiters)
        self._waiting_user.set(self.not_started - self.slot_waiters)
        self._waiting_person.set(self.parked)

    def queue_ages(self) -> dict[int, float]:
        """Per held partition: the age of its oldest record not yet started (0: none)."""
        now = self._clock()
        ages = {}
        for p, part in self.parts.items():
            oldest = part.oldest_waiting()
            ages[p] = 0.0 if oldest is None else max(0.0, now - oldest)
        return ages

    def refresh_metrics(self) -> None:
        """The per-partition queue-age gauge (call every few seconds)."""
        ages = self.queue_ages()
        for p, age in ages.items():
            PARTITION_QUEUE_AGE_SECONDS.labels(partition=str(p)).set(age)
        self._gauges()

    # --- one chain ----------------------------------------------------------------

    async def _run(self, part: PartitionChains, chain: Chain) -> None:
        try:
            while chain.queue and not part.closed and not part.stopping:
                if not await self._one(part, chain):
                    return
        finally:
            chain.task = None
            if part.chains.get(chain.key) is chain and not chain.queue:
                del part.chains[chain.key]
            part.tasks.discard(asyncio.current_task())

    async def _one(self, part: PartitionChains, chain: Chain) -> bool:
        """Run the head of ``chain`` until it may be acked; False: the chain must stop."""
        item = chain.queue[0]
        delay = 0.2
        failures = 0
        first = True
        while not part.closed:
            parked: Parked | None = None
            waiter = first  # a retry waiting for a slot again is not a record waiting
            self.slot_waiters += waiter
            self._gauges()
            try:
                await self.slots.acquire()
            finally:
                self.slot_waiters -= waiter
            try:
                if part.closed or (part.stopping and first):
                    return False
                if first:
                    first = False
                    chain.queue.popleft()
                    chain.started = True
                    self._started_one(part)
                self.in_flight += 1
                part.running += 1
                chain.running = True
                RUNS_IN_FLIGHT.set(self.in_flight)
                self._gauges()
                try:
                    await self._process(item.event, item.partition, part.cancel)
                except asyncio.CancelledError:
                    return False  # cut off at the ceiling: never acked
                except Parked as exc:
                    parked = exc
                except Exception as exc:  # noqa: BLE001 - the chain must survive
                    if self._is_fenced(exc):
                        log.warning("partition lost partition=%d: %s", part.partition, exc)
                        part.closed = True
                        part.stop.set()
                        return False
                    # The traceback once per record; then one line per retry, so a
                    # database or broker outage reads clearly and the log stays small.
                    failures += 1
                    log.warning(
                        "record failed, will retry in ~%.1fs partition=%d offset=%d "
                        "failures=%d error=%s: %s",
                        delay,
                        item.partition,
                        item.offset,
                        failures,
                        type(exc).__name__,
                        str(exc).splitlines()[0][:300] if str(exc) else "",
                        exc_info=failures == 1,
                    )
                else:
                    if not part.closed:
                        self._ack(item.event)
                    chain.started = False
                    return True
                finally:
                    chain.running = False
                    part.running -= 1
                    self.in_flight -= 1
                    RUNS_IN_FLIGHT.set(self.in_flight)
            finally:
                self.slots.release()
            if parked is not None:
                if not await self._park(part, parked):
                    return False  # drained or fenced while waiting: never acked
                delay, failures = 0.2, 0
                continue
            # Infrastructure trouble (database, broker): retry the same record, in
            # place, so the user's order holds; only this user's chain waits.
            await asyncio.sleep(delay * (0.5 + random.random() / 2))  # noqa: S311
            delay = min(INFRA_RETRY_MAX_S, delay * 2)
        return False

    async def _park(self, part: PartitionChains, parked: Parked) -> bool:
        """Wait, holding no slot, until ``parked`` says to look again or the partition
        stops; whether the record may be processed again."""
        self.parked += 1
        self._gauges()
        waiting = asyncio.ensure_future(parked.wait())
        stopped = asyncio.ensure_future(part.stop.wait())
        try:
            await asyncio.wait({waiting, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.parked -= 1
            self._gauges()
            for f in (waiting, stopped):
                f.cancel()
            await asyncio.gather(waiting, stopped, return_exceptions=True)
        return not (part.closed or part.stopping)

    # --- handoff ------------------------------------------------------------------

    async def drain(self, partitions: Iterable[int], ceiling_s: float) -> dict[str, Any]:
        """Stop the chains of ``partitions``; wait for their running runs up to
        ``ceiling_s``.

        Queued records are dropped unacked (the next owner reads them again from the
        committed low-water mark). Returns counts for logs and metrics.
        """
        doomed = [self.parts.pop(p) for p in list(partitions) if p in self.parts]
        running = 0
        for part in doomed:
            part.stopping = True
            part.stop.set()
            running += part.running
            for chain in part.chains.values():
                dropped = len(chain.queue)
                chain.queue.clear()
                part.waiting -= dropped
                self.not_started -= dropped
            if part.paused:
                part.paused = False
                INTAKE_PAUSED_PARTITIONS.dec()
            try:
                PARTITION_QUEUE_AGE_SECONDS.remove(str(part.partition))
            except KeyError:
                pass  # never measured
            for chain in part.chains.values():
                if not chain.started and chain.task is not None:
                    chain.task.cancel()  # waiting for a slot: nothing of it ran
        self._unfull()
        self._gauges()
        tasks = [t for part in doomed for t in part.tasks]
        pending: set[asyncio.Task[None]] = set()
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=ceiling_s)
        for part in doomed:
            part.closed = True  # late completions never ack
        for part in doomed:
            if any(t in pending for t in part.tasks):
                part.cancel.cancel("handoff ceiling")
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        return {"partitions": len(doomed), "running": running, "cut_off": len(pending)}

    def held(self) -> list[int]:
        return sorted(self.parts)

    def running_in(self, partition: int) -> int:
        part = self.parts.get(partition)
        return 0 if part is None else part.running
