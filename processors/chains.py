"""One sequential chain per held partition, a worker-wide bound on runs in flight.

* The dispatcher never blocks: it appends to the partition's chain and pauses
  fetching from a partition whose backlog reaches ``high_water`` (resumed below
  ``low_water``), so memory stays bounded and one busy partition never stalls
  the others.
* A chain takes a slot of the worker-wide semaphore only while a run executes,
  so a partition blocked on a long run does not hold slots for its backlog.
* Acks happen strictly in offset order per partition (Faust commits up to the
  first gap, and acking past a failed record would skip it).
* ``drain`` (revoke, shutdown) stops starting work, waits for running work up to
  a ceiling, cancels the rest and never acks it.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from koda_runtime.lifecycle.handler import CancelToken
from koda_runtime.metrics import RUNS_IN_FLIGHT

log = logging.getLogger("koda.worker")

T = TypeVar("T")  # the Faust event (opaque here)

INFRA_RETRY_MAX_S = 10.0


@dataclass
class Item(Generic[T]):
    event: T
    partition: int
    offset: int


@dataclass
class Chain:
    """The sequential queue of one partition."""

    partition: int
    queue: asyncio.Queue[Item[Any] | None] = field(default_factory=asyncio.Queue)
    task: asyncio.Task[None] | None = None
    closed: bool = False
    paused: bool = False
    cancel: CancelToken = field(default_factory=CancelToken)
    running: bool = False


class ChainSet:
    """The chains of every partition this worker holds."""

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
    ) -> None:
        self.slots = asyncio.Semaphore(max_inflight)
        self.max_inflight = max_inflight
        self.in_flight = 0
        self.chains: dict[int, Chain] = {}
        self.accepting = True
        self._process = process
        self._ack = ack
        self._pause = pause
        self._resume = resume
        self._is_fenced = is_fenced
        self.high_water = high_water
        self.low_water = low_water

    def dispatch(self, event: Any, partition: int, offset: int) -> bool:
        """Queue ``event`` on its partition's chain; False if it was refused (not acked)."""
        if not self.accepting:
            return False
        chain = self.chains.get(partition)
        if chain is None:
            chain = Chain(partition)
            chain.task = asyncio.create_task(self._run(chain), name=f"chain-{partition}")
            self.chains[partition] = chain
        if chain.closed:
            return False
        chain.queue.put_nowait(Item(event, partition, offset))
        if chain.queue.qsize() >= self.high_water:
            # Repeated on purpose: Faust's own buffer pressure may have resumed it.
            chain.paused = True
            self._flow(self._pause, partition)
        return True

    def _flow(self, fn: Callable[[int], None], partition: int) -> None:
        # Flow control is an optimisation: a failure must never stop dispatching.
        try:
            fn(partition)
        except Exception:  # noqa: BLE001
            log.exception("flow control failed partition=%d", partition)

    async def _run(self, chain: Chain) -> None:
        while True:
            item = await chain.queue.get()
            if item is None or chain.closed:
                return
            if chain.paused and chain.queue.qsize() <= self.low_water:
                chain.paused = False
                self._flow(self._resume, chain.partition)
            delay = 0.2
            failures = 0
            while not chain.closed:
                async with self.slots:
                    self.in_flight += 1
                    RUNS_IN_FLIGHT.set(self.in_flight)
                    chain.running = True
                    try:
                        await self._process(item.event, item.partition, chain.cancel)
                    except asyncio.CancelledError:
                        return  # cut off at the ceiling: never acked
                    except Exception as exc:  # noqa: BLE001 - the chain must survive
                        if self._is_fenced(exc):
                            log.warning("partition lost partition=%d: %s", chain.partition, exc)
                            chain.closed = True
                            return
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
                        if not chain.closed:
                            self._ack(item.event)
                        break
                    finally:
                        chain.running = False
                        self.in_flight -= 1
                        RUNS_IN_FLIGHT.set(self.in_flight)
                # Infrastructure trouble (database, broker): retry the same record,
                # in place, so the partition keeps its order; bounded backoff.
                await asyncio.sleep(delay * (0.5 + random.random() / 2))  # noqa: S311
                delay = min(INFRA_RETRY_MAX_S, delay * 2)

    async def drain(self, partitions: Iterable[int], ceiling_s: float) -> dict[str, Any]:
        """Stop the chains of ``partitions``; wait for running runs up to ``ceiling_s``.

        Queued records are dropped unacked (the next owner reads them again).
        Returns counts for logs and metrics.
        """
        doomed = [self.chains.pop(p) for p in list(partitions) if p in self.chains]
        for chain in doomed:
            while not chain.queue.empty():
                chain.queue.get_nowait()
            chain.queue.put_nowait(None)
        tasks = [c.task for c in doomed if c.task is not None]
        running = sum(1 for c in doomed if c.running)
        pending: set[asyncio.Task[None]] = set()
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=ceiling_s)
        for chain in doomed:
            chain.closed = True  # late completions never ack
        for chain in doomed:
            if chain.task in pending:
                chain.cancel.cancel("handoff ceiling")
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        return {"partitions": len(doomed), "running": running, "cut_off": len(pending)}

    def held(self) -> list[int]:
        return sorted(self.chains)
