"""Users never wait for strangers, against the real broker and real workers.

Records of different users on one runs partition run side by side; one user's runs run
one after another in offset order; a partition's committed offset never passes a run
that has not ended, through a kill -9 and a SIGTERM of a worker holding hundreds of
runs of many users.

Order is read from Postgres: ``started_at`` is a run's first claim and ``finished_at``
its end, both written by the database's clock, so for a user's runs in submission
order ``finished_at(r[k-1]) <= started_at(r[k])`` is the rule, whoever ran them.
"""

from __future__ import annotations

import signal
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import pytest
from confluent_kafka import Consumer, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient

from koda_runtime.kafka import consumer_config
from koda_runtime.settings import Settings
from koda_runtime.topics.catalogue import RUNS, RUNS_DLQ, partition_for_key
from koda_runtime.topics.records.codec import (
    RUN_REQUESTED,
    RunRequested,
    decode_run_requested,
    headers_for,
)
from koda_runtime.topics.records.dead_letters import decode_dead_letter
from tests.fixtures.processes import WorkerPool
from tests.fixtures.runs import (
    Submitter,
    committed_offsets,
    group_settled,
    read_topic,
    wait_terminal,
)
from tests.support import wait_until

TERMINAL = ("done", "failed", "cancelled")
TERMINAL_KINDS = ("done", "error", "cancelled")


@pytest.fixture
def workers(env: Settings) -> Iterator[WorkerPool]:
    """The plugin's pool, killed at the end: some tests leave a worker mid-run."""
    with WorkerPool(env, kill_at_end=True) as pool:
        yield pool


def committed_metadata(env: Settings, group: str, topic: str, partition: int) -> str:
    """The metadata of ``group``'s commit on ``partition`` ('' when none)."""
    consumer = Consumer(consumer_config(env, "test-metadata", group))
    try:
        (tp,) = consumer.committed([TopicPartition(topic, partition)], timeout=10)
        return tp.metadata or ""
    finally:
        consumer.close()


def settle(env: Settings, members: int) -> None:
    admin = AdminClient({"bootstrap.servers": env.kafka_bootstrap})
    group = env.names.group(env.worker_group)

    def settled() -> bool:
        try:
            return group_settled(admin, group, members)[0]
        except KafkaException:
            return False  # the coordinator is still loading the group

    wait_until(
        settled,
        timeout=60,
        what=f"{members} workers holding partitions",
    )


def users_on_one_partition(env: Settings, prefix: str, count: int) -> list[str]:
    """``count`` users whose runs all go to one partition."""
    target = partition_for_key(f"{prefix}-0".encode(), env.partitions)
    found: list[str] = []
    i = 0
    while len(found) < count:
        user = f"{prefix}-{i}"
        if partition_for_key(user.encode(), env.partitions) == target:
            found.append(user)
        i += 1
    return found


def rows(sub: Submitter, ids: list[str]) -> dict[str, Any]:
    got = sub.query(
        "SELECT id, user_id, status, attempt, created_at, started_at, first_chunk_at,"
        " finished_at FROM runs WHERE id = ANY(:ids)",
        ids=ids,
    )
    return {r.id: r for r in got}


def order_violations(sub: Submitter, by_user: dict[str, list[str]]) -> list[str]:
    """Each user's runs (in submission order) must start in that order, each after the
    one before it ended."""
    found = []
    every = [r for ids in by_user.values() for r in ids]
    table = rows(sub, every)
    for user, ids in by_user.items():
        for before, after in zip(ids, ids[1:], strict=False):
            a, b = table[before], table[after]
            if a.finished_at is None or b.started_at is None or a.finished_at > b.started_at:
                found.append(
                    f"{user}: {after} started {b.started_at} before {before} ended {a.finished_at}"
                )
    return found


def seconds(a: datetime, b: datetime) -> float:
    return (b - a).total_seconds()


def test_a_short_run_never_waits_behind_another_users_long_run(env, submitter, workers) -> None:
    workers.start("a")
    settle(env, 1)
    slow, quick = users_on_one_partition(env, "lane", 2)
    long_run = submitter.submit(
        slow, {"text": "a minute", "demo": {"tokens": 60, "delay_ms": 1000}}
    )
    wait_until(
        lambda: rows(submitter, [long_run])[long_run].status == "streaming",
        timeout=30,
        what="the long run streaming",
    )
    short_run = submitter.submit(quick, {"text": "short", "demo": {"tokens": 3, "delay_ms": 10}})
    wait_terminal(submitter, [short_run], 30.0)
    got = rows(submitter, [long_run, short_run])
    b = got[short_run]
    waited = seconds(b.created_at, b.first_chunk_at)
    print(f"short run's first chunk {waited * 1000:.0f} ms after its submission")
    assert got[long_run].status == "streaming"  # still a minute to go: nobody waited for it
    assert b.status == "done"
    assert waited < 1.0, waited


def test_200_users_each_start_at_once_on_two_workers(env, submitter, workers) -> None:
    workers.start("a")
    workers.start("b")
    settle(env, 2)
    inp = {"text": "five seconds", "demo": {"tokens": 10, "delay_ms": 500}}
    # One burst, as the 200 users arrive at once: submitted one by one, a slow
    # machine's submissions alone would stretch the span being measured.
    ids = submitter.submit_many([(f"crowd-{i}", inp) for i in range(200)])
    wait_terminal(submitter, ids, 90.0)
    got = list(rows(submitter, ids).values())
    waits = sorted(seconds(r.created_at, r.started_at) for r in got)
    first = sorted(seconds(r.created_at, r.first_chunk_at) for r in got)
    span = seconds(min(r.created_at for r in got), max(r.finished_at for r in got))
    print(
        f"200 runs on 8 partitions: queue wait p50 {waits[100]:.3f} s max {waits[-1]:.3f} s;"
        f" first chunk p50 {first[100]:.3f} s p99 {first[197]:.3f} s; last done after {span:.1f} s"
    )
    assert {r.status for r in got} == {"done"}
    assert waits[-1] < 1.0, waits[-10:]
    assert span < 10.0, span


def test_one_users_ten_runs_keep_their_order_among_a_hundred_others(
    env, submitter, workers
) -> None:
    workers.start("a")
    workers.start("b")
    settle(env, 2)
    inp = {"text": "some words", "demo": {"tokens": 4, "delay_ms": 100}}
    by_user: dict[str, list[str]] = defaultdict(list)
    for k in range(10):
        by_user["ten"].append(submitter.submit("ten", {**inp, "text": f"turn {k}"}))
    partition = partition_for_key(b"ten", env.partitions)
    others = [f"other-{i}" for i in range(100)]
    for u in others:
        by_user[u].append(submitter.submit(u, inp))
    for k in range(10, 13):  # and some more behind the crowd
        by_user["ten"].append(submitter.submit("ten", {**inp, "text": f"turn {k}"}))
    every = [r for ids in by_user.values() for r in ids]
    wait_terminal(submitter, every, 90.0)
    sharing = [u for u in others if partition_for_key(u.encode(), env.partitions) == partition]
    assert len(sharing) >= 5  # the ten runs' partition was shared
    assert order_violations(submitter, by_user) == []
    table = rows(submitter, every)
    starts = [table[r].started_at for r in by_user["ten"]]
    assert starts == sorted(starts)
    # The crowd on the same partition did not wait for the ten: some of them started
    # before the user's last run did.
    last = table[by_user["ten"][-1]].started_at
    assert any(table[by_user[u][0]].started_at < last for u in sharing)


@dataclass
class CommitWatch:
    """Samples, every 0.2 s, the group's committed offsets and then the runs that have
    ended; a committed offset must never lie past a record whose run had not ended."""

    env: Settings
    sub: Submitter
    samples: list[tuple[dict[int, int], set[str]]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        group = self.env.names.group(self.env.worker_group)
        topic = self.env.names.topic(RUNS)
        while not self.stop.wait(0.2):
            offsets = committed_offsets(self.env, group, topic)
            ended = {
                r.id
                for r in self.sub.query(
                    "SELECT id FROM runs WHERE status = ANY(:t)", t=list(TERMINAL)
                )
            }
            self.samples.append((offsets, ended))

    def records(self) -> dict[tuple[int, int], str]:
        """The runs topic's records: (partition, offset) -> run id."""
        by_offset: dict[tuple[int, int], str] = {}
        for msg in read_topic(self.env, self.env.names.topic(RUNS)):
            req = decode_run_requested(msg.key(), msg.value(), msg.headers())
            by_offset[(msg.partition(), msg.offset())] = req.run_id
        return by_offset

    def caught_up(self, by_offset: dict[tuple[int, int], str]) -> bool:
        """Whether the latest sample has every partition committed past its last record."""
        if not self.samples:
            return False
        offsets, _ = self.samples[-1]
        return all(offsets.get(p, -1) > o for p, o in by_offset)

    def violations(self, by_offset: dict[tuple[int, int], str]) -> list[str]:
        found = []
        for offsets, ended in self.samples:
            for (p, o), run_id in by_offset.items():
                if o < offsets.get(p, -1) and run_id not in ended:
                    found.append(f"partition {p} committed {offsets[p]} past offset {o} ({run_id})")
        return found


def many_users_in_flight(env: Settings, sub: Submitter) -> dict[str, list[str]]:
    """Two runs (about 8 s apiece) for each of 416 users, submitted in one burst, the
    users spread evenly over the partitions: a worker holding half of them has about
    200 users' runs streaming at once, whichever half it holds."""
    inp = {"demo": {"tokens": 10, "delay_ms": 800}}
    quota = -(-416 // env.partitions)
    per: dict[int, list[str]] = defaultdict(list)
    i = 0
    while sum(len(v) for v in per.values()) < quota * env.partitions:
        user = f"many-{i}"
        p = partition_for_key(user.encode(), env.partitions)
        if len(per[p]) < quota:
            per[p].append(user)
        i += 1
    users = [u for p in sorted(per) for u in per[p]]
    turns = [(u, {**inp, "text": f"{u} turn {k}"}) for k in range(2) for u in users]
    by_user: dict[str, list[str]] = defaultdict(list)
    for (user, _), run_id in zip(turns, sub.submit_many(turns), strict=True):
        by_user[user].append(run_id)
    return by_user


@pytest.mark.parametrize("how", ["kill", "sigterm"])
def test_a_worker_stopped_with_hundreds_of_runs_in_flight_loses_none(
    env, submitter, workers, how
) -> None:
    a = workers.start("a")
    b = workers.start("b")
    settle(env, 2)
    watch = CommitWatch(env, submitter)
    sampler = threading.Thread(target=watch.run, daemon=True)
    sampler.start()
    try:
        by_user = many_users_in_flight(env, submitter)
        every = [r for ids in by_user.values() for r in ids]

        def on_a() -> int:
            return len(
                submitter.query(
                    "SELECT id FROM runs WHERE worker_id = 'a' AND status = 'streaming'"
                    " AND id = ANY(:ids)",
                    ids=every,
                )
            )

        wait_until(lambda: on_a() >= 150, timeout=60, what="a streaming many runs")
        held = on_a()
        if how == "kill":
            a.kill()
        else:
            a.signal(signal.SIGTERM)
            assert a.proc is not None and a.proc.wait(60) == 0, a.log()[-3000:]
        wait_terminal(submitter, every, 120.0, b)
        records = watch.records()
        # Every run ended: the survivor's commits reach each partition's end, sampled.
        wait_until(lambda: watch.caught_up(records), timeout=30, what="commits at the end")
    finally:
        watch.stop.set()
        sampler.join(10)
    print(f"{how}: a held {held} runs streaming; {len(watch.samples)} commit samples")
    table = rows(submitter, every)
    assert {r.status for r in table.values()} == {"done"}
    assert order_violations(submitter, by_user) == []
    assert watch.violations(records) == []
    assert len(watch.samples) > 10
    # Each run ended once: one terminal message, its last, and its answer whole.
    for run_id in every:
        kinds = [m.kind for m in submitter.messages(run_id)]
        assert kinds.count("done") == 1 and kinds[-1] == "done", (run_id, kinds)
        assert sum(k in TERMINAL_KINDS for k in kinds) == 1, (run_id, kinds)


def test_the_model_cap_keeps_runs_pending_until_a_model_slot_frees(env, submitter, workers) -> None:
    workers.start("a", KODA_MODEL_CONCURRENCY="2")
    settle(env, 1)
    users = users_on_one_partition(env, "capped", 6)
    inp = {"text": "two seconds", "demo": {"tokens": 10, "delay_ms": 200}}
    ids = [submitter.submit(u, inp) for u in users]
    most_active, saw_pending_beside_streaming = 0, False
    deadline = time.monotonic() + 60
    while not submitter.all_terminal(ids) and time.monotonic() < deadline:
        states = list(submitter.statuses(ids).values())
        active = sum(s in ("running", "streaming") for s in states)
        most_active = max(most_active, active)
        saw_pending_beside_streaming |= active > 0 and "pending" in states
        time.sleep(0.05)
    assert submitter.all_terminal(ids)
    assert {r.status for r in rows(submitter, ids).values()} == {"done"}
    assert most_active == 2  # two at a time, never more, though six users could run
    assert saw_pending_beside_streaming  # the others waited as pending, not running


def test_what_ended_above_the_low_water_mark_is_not_met_again_after_a_handoff(
    env, submitter, workers
) -> None:
    """User A's long run holds its partition's committed offset low; a record of user B
    above it is dead-lettered and one of user C ends. After a handoff the next owner
    reads on from A's offset, resumes A's run, and meets neither B's nor C's record
    again: the commit's metadata named them. Without it B's letter would be written
    twice."""
    a = workers.start("a", KODA_HANDOFF_CEILING="1")
    settle(env, 1)
    slow, poison, quick = users_on_one_partition(env, "above", 3)
    long_run = submitter.submit(slow, {"text": "long", "demo": {"tokens": 40, "delay_ms": 250}})
    wait_until(
        lambda: rows(submitter, [long_run])[long_run].status == "streaming",
        timeout=30,
        what="the long run streaming",
    )
    missing = str(uuid.uuid4())
    submitter.produce_raw(
        poison.encode(),
        RunRequested(missing, poison, f"s-{poison}", "").encode(),
        list(headers_for(RUN_REQUESTED)),
    )
    short_run = submitter.submit(quick, {"text": "short", "demo": {"tokens": 2, "delay_ms": 1}})
    wait_terminal(submitter, [short_run], 30.0)
    dlq = env.names.topic(RUNS_DLQ)

    def letters() -> list[str]:
        found = []
        for msg in read_topic(env, dlq, timeout=10):
            letter = decode_dead_letter(msg.value())
            if letter.value and missing.encode() in letter.value:
                found.append(letter.reason)
        return found

    wait_until(lambda: letters() == ["unknown_run"], timeout=30, what="one dead letter")
    group, topic = env.names.group(env.worker_group), env.names.topic(RUNS)
    partition = partition_for_key(slow.encode(), env.partitions)
    wait_until(
        lambda: bool(committed_metadata(env, group, topic, partition)),
        timeout=15,
        what="a commit naming the records that ended above the long run",
    )
    b = workers.start("b", KODA_HANDOFF_CEILING="1")
    a.signal(signal.SIGTERM)  # a's drain cuts A's run at the ceiling; b takes over
    assert a.proc is not None and a.proc.wait(60) == 0, a.log()[-3000:]
    wait_terminal(submitter, [long_run], 60.0, b)
    got = rows(submitter, [long_run, short_run])
    assert got[long_run].status == "done" and got[long_run].attempt >= 2  # resumed by b
    assert got[short_run].attempt == 1
    end = read_topic(env, topic)
    last = max(m.offset() for m in end if m.partition() == partition)
    wait_until(
        lambda: committed_offsets(env, group, topic).get(partition, -1) > last,
        timeout=30,
        what="b to commit past every record of the partition",
    )
    assert letters() == ["unknown_run"]  # not written a second time
