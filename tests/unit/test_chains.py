"""The key chains (processors/chains.py), with a scripted process function: order and
acks per user key, users of one partition side by side, the in-flight bound, flow
control (per partition and worker-wide), retry in place, fencing and the drain
ceiling. Records sent without a key share one chain, as one user's would."""

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

    def __init__(
        self, *, max_inflight: int = 4, high: int = 64, low: int = 16, backlog: int | None = None
    ) -> None:
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
            max_backlog=backlog,
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

    def send(self, partition: int, *offsets: int, key: bytes | None = None) -> None:
        for offset in offsets:
            assert self.chains.dispatch((partition, offset), partition, offset, key)


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
    await loop_until(lambda: h.chains.parts[0].closed)
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


async def test_users_of_one_partition_run_side_by_side_and_each_in_offset_order() -> None:
    h = Harness(max_inflight=8)
    gate = asyncio.Event()
    h.behaviour[(0, 0)] = gate.wait  # user a's long run
    h.send(0, 0, key=b"a")
    h.send(0, 1, key=b"b")
    h.send(0, 2, key=b"a")  # a's second run waits for its first
    h.send(0, 3, key=b"c")
    h.send(0, 4, key=b"b")
    await loop_until(lambda: len(h.acked) == 3)
    assert sorted(h.acked) == [(0, 1), (0, 3), (0, 4)]  # b and c never waited for a
    assert h.acked.index((0, 1)) < h.acked.index((0, 4))  # b's own order
    assert (0, 2) not in h.started
    gate.set()
    await loop_until(lambda: len(h.acked) == 5)
    assert h.started.index((0, 0)) < h.started.index((0, 2))
    assert h.acked[3:] == [(0, 0), (0, 2)]
    assert h.chains.parts[0].chains == {}  # a chain ends with its queue
    await h.chains.drain(h.chains.held(), 1.0)


async def test_a_user_whose_record_keeps_failing_holds_only_its_own_chain() -> None:
    h = Harness()
    failures = iter([ConnectionError("down")] * 3)

    def flaky() -> None:
        exc = next(failures, None)
        if exc is not None:
            raise exc

    h.behaviour[(0, 0)] = flaky
    h.send(0, 0, key=b"a")
    h.send(0, 1, key=b"a")
    h.send(0, 2, key=b"b")
    await loop_until(lambda: (0, 2) in h.acked)
    assert (0, 1) not in h.started  # a's order holds while its head is retried
    await loop_until(lambda: len(h.acked) == 3, timeout=10)
    assert [e for e in h.acked if e != (0, 2)] == [(0, 0), (0, 1)]
    await h.chains.drain(h.chains.held(), 1.0)


async def test_a_fenced_record_closes_every_chain_of_its_partition() -> None:
    h = Harness()
    gate = asyncio.Event()

    def lost() -> None:
        raise Fenced("partition 0 moved")

    h.behaviour[(0, 0)] = gate.wait
    h.behaviour[(0, 1)] = lost
    h.send(0, 0, key=b"a")
    h.send(0, 1, key=b"b")
    h.send(0, 2, key=b"b")
    h.send(1, 0, key=b"a")
    await loop_until(lambda: h.chains.parts[0].closed)
    gate.set()  # a's run ends after the fence: its ack would be the next owner's
    await loop_until(lambda: (1, 0) in h.acked)
    for _ in range(20):
        await asyncio.sleep(0)
    assert h.acked == [(1, 0)]
    assert (0, 2) not in h.started
    assert not h.chains.dispatch((0, 3), 0, 3, b"c")
    await h.chains.drain([0, 1], 1.0)


async def test_drain_takes_only_its_partitions_and_never_waits_for_unstarted_chains() -> None:
    h = Harness(max_inflight=1)
    gate = asyncio.Event()
    h.behaviour[(0, 0)] = gate.wait
    h.send(0, 0, key=b"a")
    h.send(0, 1, key=b"b")  # waits for the only slot
    h.send(1, 0, key=b"c")  # another partition, waiting for the slot too
    await loop_until(lambda: h.running == 1)
    drained = asyncio.create_task(h.chains.drain([0], 5.0))
    await loop_until(lambda: h.chains.held() == [1])
    gate.set()
    counts = await drained
    assert counts == {"partitions": 1, "running": 1, "cut_off": 0}
    await loop_until(lambda: (1, 0) in h.acked)
    assert h.acked == [(0, 0), (1, 0)]
    assert (0, 1) not in h.started
    assert h.chains.not_started == 0
    await h.chains.drain(h.chains.held(), 1.0)


async def test_the_worker_wide_backlog_pauses_every_partition_until_half_of_it_starts() -> None:
    h = Harness(max_inflight=1, high=100, low=50, backlog=4)
    gate = asyncio.Event()
    h.behaviour[(0, 0)] = gate.wait
    h.send(0, 0, key=b"a")
    await loop_until(lambda: h.running == 1)
    h.send(0, 1, key=b"b")
    h.send(1, 0, key=b"c")
    h.send(2, 0, key=b"d")
    assert h.paused == []
    h.send(2, 1, key=b"e")  # the fourth record not started
    assert set(h.paused) == {0, 1, 2}
    assert h.chains.full
    gate.set()
    await loop_until(lambda: len(h.acked) == 5)
    assert set(h.resumed) == {0, 1, 2}
    assert not h.chains.full and h.chains.not_started == 0
    await h.chains.drain(h.chains.held(), 1.0)


async def test_queue_age_is_the_oldest_unstarted_record_of_each_partition() -> None:
    now = [1000.0]
    h = Harness(max_inflight=1)
    h.chains._clock = lambda: now[0]  # noqa: SLF001 - a scripted clock
    gate = asyncio.Event()
    h.behaviour[(0, 0)] = gate.wait
    assert h.chains.dispatch((0, 0), 0, 0, b"a", 990.0)
    await loop_until(lambda: h.running == 1)
    assert h.chains.dispatch((0, 1), 0, 1, b"b", 995.0)
    assert h.chains.dispatch((0, 2), 0, 2, b"a", 992.0)
    assert h.chains.queue_ages() == {0: 8.0}  # offset 2: 992; offset 0 has started
    gate.set()
    await loop_until(lambda: len(h.acked) == 3)
    assert h.chains.queue_ages() == {0: 0.0}
    await h.chains.drain(h.chains.held(), 1.0)
