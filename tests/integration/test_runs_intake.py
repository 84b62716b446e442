"""The runs topic's group member (topics/kafka/intake.py) against the real broker.

Two members of one group on the runs topic, each with hooks that record what they were
told and when: a join moves only what the newcomer needs and the first member never
loses the rest; a moved partition is committed in the revoke hook before the newcomer
is given it; calls from the event loop complete while the member's thread polls (they
waited forever behind it when made from the loop's thread); a partition assigned again
carries a new assignment number.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from confluent_kafka import Producer

from koda_runtime.kafka import producer_config
from koda_runtime.settings import Settings
from koda_runtime.topics.catalogue import RUNS
from koda_runtime.topics.kafka.intake import Fetched, RunsIntake
from koda_runtime.topics.kafka.offsets import GroupOffsetReader
from tests.support import async_wait_until


async def until(condition: Callable[[], object], *, timeout: float, what: str) -> None:
    async def check() -> object:
        return condition()

    await async_wait_until(check, timeout=timeout, what=what)


@dataclass
class Recorder:
    """Hooks that log each call with its time; the revoke hook commits what it read."""

    name: str
    events: list[tuple[str, float, list[int]]] = field(default_factory=list)
    fetched: list[Fetched] = field(default_factory=list)
    intake: RunsIntake | None = None
    held: set[int] = field(default_factory=set)

    def deliver(self, batch: list[Fetched]) -> None:
        self.fetched.extend(batch)

    async def assigned(self, partitions: list[int]) -> None:
        self.held.update(partitions)
        self.events.append(("assigned", time.monotonic(), partitions))

    async def revoked(self, partitions: list[int]) -> None:
        assert self.intake is not None
        ends: dict[int, int] = {}
        for item in self.fetched:
            if item.partition in partitions:
                ends[item.partition] = max(ends.get(item.partition, 0), item.offset + 1)
        await asyncio.sleep(1.0)  # a drain: the newcomer must not get them meanwhile
        assert await self.intake.commit(ends)
        self.held.difference_update(partitions)
        self.events.append(("revoked", time.monotonic(), partitions))

    async def lost(self, partitions: list[int]) -> None:
        self.held.difference_update(partitions)
        self.events.append(("lost", time.monotonic(), partitions))

    def moved(self, kind: str) -> list[int]:
        return sorted(p for k, _, ps in self.events if k == kind for p in ps)

    def at(self, kind: str) -> float:
        return next(t for k, t, ps in self.events if k == kind and ps)


def member(settings: Settings, group: str, name: str) -> tuple[RunsIntake, Recorder]:
    rec = Recorder(name)
    intake = RunsIntake(settings, settings.names.topic(RUNS), group, deliver=rec.deliver, hooks=rec)
    rec.intake = intake
    return intake, rec


def fill(settings: Settings, partitions: int) -> None:
    producer = Producer(producer_config(settings, "test"))
    for p in range(partitions):
        for i in range(3):
            producer.produce(settings.names.topic(RUNS), value=f"{p}:{i}".encode(), partition=p)
    assert producer.flush(30) == 0


async def test_a_join_moves_only_what_the_newcomer_needs_after_its_commit(
    kafka_topics: Settings,
) -> None:
    env = kafka_topics
    group = env.names.group("intake-join")
    n = env.partitions
    fill(env, n)
    first, a = member(env, group, "a")
    second, b = member(env, group, "b")
    first.start()
    try:
        await until(lambda: len(a.held) == n, timeout=60, what="a holds all")
        await until(
            lambda: len({f.partition for f in a.fetched}) == n, timeout=30, what="a read all"
        )
        # A call from the loop completes while the member's thread is polling.
        started = time.monotonic()
        positions = await asyncio.wait_for(first.positions(list(range(n))), 5)
        assert time.monotonic() - started < 2
        assert positions == dict.fromkeys(range(n), 3)
        generations = {p: first.generation(p) for p in range(n)}

        second.start()
        await until(lambda: len(b.held) > 0, timeout=60, what="b assigned")
        await until(lambda: len(a.held) + len(b.held) == n, timeout=30, what="settled")
        moved = a.moved("revoked")
        # Sticky and minimal: a gave up only what b got, about half, and kept the rest.
        assert moved == b.moved("assigned") == sorted(b.held)
        assert abs(len(moved) - n // 2) <= 1, moved
        assert a.held == set(range(n)) - set(moved)
        assert a.moved("assigned") == list(range(n))  # never re-assigned what it kept
        assert all(first.generation(p) == generations[p] for p in a.held)
        # b got its partitions only after a's revoke hook, drain and commit, returned.
        assert b.at("assigned") >= a.at("revoked")
        reader = GroupOffsetReader(env, "test", env.names.topic(RUNS), group)
        try:
            committed = await reader.run(reader.committed, moved)
        finally:
            await reader.aclose()
        assert committed == dict.fromkeys(moved, 3)
        # b reads the moved partitions from the commit: nothing again, nothing skipped.
        fill(env, n)
        await until(
            lambda: (
                {(f.partition, f.offset) for f in b.fetched}
                == {(p, 3 + i) for p in moved for i in range(3)}
            ),
            timeout=30,
            what="b reads past the commit",
        )
    finally:
        await second.stop()
        await first.stop()
    # b left: a gets the partitions back, under new assignment numbers.
    assert set(b.moved("revoked")) == set(moved)


async def test_a_partition_assigned_again_has_a_new_assignment_number(
    kafka_topics: Settings,
) -> None:
    env = kafka_topics
    group = env.names.group("intake-again")
    n = env.partitions
    first, a = member(env, group, "a")
    first.start()
    try:
        await until(lambda: len(a.held) == n, timeout=60, what="a holds all")
        before = {p: first.generation(p) for p in range(n)}
        second, b = member(env, group, "b")
        second.start()
        await until(lambda: len(b.held) > 0, timeout=60, what="b assigned")
        await second.stop()
        await until(lambda: len(a.held) == n, timeout=60, what="a holds all again")
        back = set(b.moved("assigned"))
        assert back
        for p in range(n):
            now = first.generation(p)
            assert (now != before[p]) if p in back else (now == before[p]), p
    finally:
        await first.stop()


async def test_a_member_the_group_gives_nothing_still_counts_as_joined(
    kafka_topics: Settings,
) -> None:
    """More members than partitions: librdkafka never calls back the idle one, whose
    readiness must not wait for an assignment forever."""
    env = kafka_topics
    group = env.names.group("intake-idle")
    joined: list[str] = []
    members = []
    for i in range(env.partitions + 1):
        rec = Recorder(f"m{i}")
        intake = RunsIntake(
            env,
            env.names.topic(RUNS),
            group,
            deliver=rec.deliver,
            hooks=rec,
            on_joined=functools.partial(joined.append, rec.name),
        )
        rec.intake = intake
        members.append((intake, rec))
        intake.start()
    try:
        await until(
            lambda: (
                sum(len(r.held) for _, r in members) == env.partitions
                and len(joined) == len(members)
            ),
            timeout=90,
            what="every member joined",
        )
        idle = [r.name for _, r in members if not r.held]
        assert len(idle) == 1 and idle[0] in joined
        assert sorted(joined) == sorted(r.name for _, r in members)
    finally:
        await asyncio.gather(*(m.stop() for m, _ in members))


async def test_a_partition_paused_when_it_left_is_fetched_when_it_comes_back(
    kafka_topics: Settings,
) -> None:
    """librdkafka keeps an application pause on a partition across its revocation and a
    later assignment to the same member, while the worker's chain for it starts afresh
    (unpaused): nothing would ever resume it, and its runs would wait for good."""
    env = kafka_topics
    group = env.names.group("intake-paused")
    n = env.partitions
    first, a = member(env, group, "a")
    first.start()
    try:
        await until(lambda: len(a.held) == n, timeout=60, what="a holds all")
        for p in range(n):
            first.pause(p)  # every chain at its high water when the group changes
        second, b = member(env, group, "b")
        second.start()
        await until(lambda: len(b.held) > 0, timeout=60, what="b assigned")
        for p in b.held:
            first.pause(p)  # a chain's pause arriving after its partition left: dropped
        await asyncio.wait_for(first.positions([]), 5)  # the thread ran the calls
        await second.stop()
        await until(lambda: len(a.held) == n, timeout=60, what="a holds all again")
        back = sorted(b.moved("assigned"))
        assert back
        fill(env, n)
        await until(
            lambda: set(back) <= {f.partition for f in a.fetched},
            timeout=30,
            what=f"a reads the partitions that came back {back}",
        )
        # What it kept stays paused: its chain still holds a backlog.
        assert not {f.partition for f in a.fetched} - set(back)
    finally:
        await first.stop()


async def test_a_record_is_handed_over_when_it_arrives_not_when_the_poll_times_out(
    kafka_topics: Settings,
) -> None:
    """A lone record on a quiet topic reaches the loop at once. A batch consume waits
    out its whole timeout unless the batch fills, which held every run of a quiet
    partition up to the poll timeout before it started; with a 30 s poll the gap is
    plain."""
    env = kafka_topics
    group = env.names.group("intake-prompt")
    rec = Recorder("a")
    intake = RunsIntake(
        env, env.names.topic(RUNS), group, deliver=rec.deliver, hooks=rec, poll_s=30.0
    )
    rec.intake = intake
    intake.start()
    try:
        await until(lambda: len(rec.held) == env.partitions, timeout=60, what="a holds all")
        producer = Producer(producer_config(env, "test"))
        producer.produce(env.names.topic(RUNS), value=b"lone", partition=0)
        assert producer.flush(30) == 0
        sent = time.monotonic()
        await until(
            lambda: any(f.value == b"lone" for f in rec.fetched), timeout=25, what="the record"
        )
        assert time.monotonic() - sent < 25  # well inside the poll's 30 s
    finally:
        await intake.stop()
