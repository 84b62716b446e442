"""The partition chains (processors/chains.py), with a scripted process function:
order and acks per partition, the in-flight bound, flow control, retry in place,
fencing and the drain ceiling."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from koda_runtime.lifecycle.handler import CancelToken
from koda_runtime.processors.chains import ChainSet
from tests.support import loop_until


class Fenced(Exception):
    pass


class Harness:
    """A ChainSet whose process function runs ``behaviour[event]`` (default: return)."""

    def __init__(self, *, max_inflight: int = 4, high: int = 64, low: int = 16) -> None:
        self.acked: list[Any] = []
        self.started: list[Any] = []
        self.paused: list[int] = []
        self.resumed: list[int] = []
        self.tokens: dict[Any, CancelToken] = {}
        self.behaviour: dict[Any, Callable[[], Any]] = {}
        self.running = 0
        self.most_running = 0
        self.chains = ChainSet(
            max_inflight=max_inflight,
            process=self.process,
            ack=self.acked.append,
            pause=self.paused.append,
            resume=self.resumed.append,
            is_fenced=lambda exc: isinstance(exc, Fenced),
            high_water=high,
            low_water=low,
        )

    async def process(self, event: Any, partition: int, cancel: CancelToken) -> None:
        self.started.append(event)
        self.tokens[event] = cancel
        self.running += 1
        self.most_running = max(self.most_running, self.running)
        try:
            step = self.behaviour.get(event)
            if step is not None:
                result = step()
                if asyncio.iscoroutine(result):
                    await result
        finally:
            self.running -= 1

    def send(self, partition: int, *offsets: int) -> None:
        for offset in offsets:
            assert self.chains.dispatch((partition, offset), partition, offset)


async def test_acks_follow_offset_order_and_a_busy_partition_holds_no_other() -> None:
    h = Harness()
    gate = asyncio.Event()
    h.behaviour[(0, 0)] = gate.wait
    h.send(0, 0, 1, 2)
    h.send(1, 0, 1)
    await loop_until(lambda: len(h.acked) == 2)
    assert h.acked == [(1, 0), (1, 1)]  # partition 1 went on while 0 waits
    assert (0, 1) not in h.started  # one record at a time per partition
    gate.set()
    await loop_until(lambda: len(h.acked) == 5)
    assert [e for e in h.acked if e[0] == 0] == [(0, 0), (0, 1), (0, 2)]
    await h.chains.drain(h.chains.held(), 1.0)


async def test_runs_in_flight_never_exceed_the_bound() -> None:
    h = Harness(max_inflight=2)
    gate = asyncio.Event()
    for p in range(5):
        h.behaviour[(p, 0)] = gate.wait
        h.send(p, 0)
    await loop_until(lambda: h.running == 2)
    for _ in range(20):  # loop turns in which a wrong start would happen: an absence
        await asyncio.sleep(0)  # cannot be waited on
    assert h.most_running == 2 and h.chains.in_flight == 2
    gate.set()
    await loop_until(lambda: len(h.acked) == 5)
    assert h.most_running == 2
    await h.chains.drain(h.chains.held(), 1.0)


async def test_a_failing_record_is_retried_in_place_and_acked_once() -> None:
    h = Harness()
    failures = iter([ConnectionError("database down"), ConnectionError("still down")])

    def flaky() -> None:
        exc = next(failures, None)
        if exc is not None:
            raise exc

    h.behaviour[(0, 0)] = flaky
    h.send(0, 0, 1)
    await loop_until(lambda: len(h.acked) == 2, timeout=10)
    assert h.acked == [(0, 0), (0, 1)]
    assert h.started == [(0, 0), (0, 0), (0, 0), (0, 1)]
    await h.chains.drain(h.chains.held(), 1.0)


async def test_a_fenced_record_closes_its_chain_unacked() -> None:
    h = Harness()

    def lost() -> None:
        raise Fenced("partition 0 moved")

    h.behaviour[(0, 1)] = lost
    h.send(0, 0, 1, 2)
    await loop_until(lambda: h.chains.chains[0].closed)
    assert h.acked == [(0, 0)]
    assert (0, 2) not in h.started
    assert not h.chains.dispatch((0, 3), 0, 3)  # refused: never acked by this worker
    await h.chains.drain([0], 1.0)


async def test_drain_waits_for_running_work_and_drops_the_queue_unacked() -> None:
    h = Harness()
    gate = asyncio.Event()
    h.behaviour[(0, 0)] = gate.wait
    h.send(0, 0, 1, 2)
    await loop_until(lambda: h.running == 1)
    drained = asyncio.create_task(h.chains.drain([0], 5.0))
    await loop_until(lambda: h.chains.held() == [], what="the drain to take the chain")
    gate.set()
    counts = await drained
    assert counts == {"partitions": 1, "running": 1, "cut_off": 0}
    assert h.acked == [(0, 0)]  # the running record finished in time; the rest is not ours
    assert h.started == [(0, 0)]
    assert h.chains.held() == []


async def test_work_past_the_ceiling_is_cut_off_and_never_acked() -> None:
    h = Harness()
    cut: list[bool] = []

    async def long_run() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cut.append(True)
            raise

    h.behaviour[(0, 0)] = long_run
    h.send(0, 0)
    h.send(1, 0)
    await loop_until(lambda: (1, 0) in h.acked and h.running == 1)
    counts = await h.chains.drain([0, 1], 0.05)
    assert counts == {"partitions": 2, "running": 1, "cut_off": 1}
    assert cut == [True]
    assert h.tokens[(0, 0)].cancelled and h.tokens[(0, 0)].reason == "handoff ceiling"
    assert h.acked == [(1, 0)]
    assert h.chains.in_flight == 0


async def test_a_backlog_pauses_its_partition_until_it_drains_below_low_water() -> None:
    h = Harness(high=4, low=1)
    gate = asyncio.Event()
    h.behaviour[(0, 0)] = gate.wait
    h.send(0, *range(6))
    await loop_until(lambda: h.running == 1)
    assert h.paused and set(h.paused) == {0}
    assert h.resumed == []
    gate.set()
    await loop_until(lambda: len(h.acked) == 6)
    assert h.resumed == [0]
    await h.chains.drain([0], 1.0)
