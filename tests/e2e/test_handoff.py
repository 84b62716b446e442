"""Graceful handoff against the real broker: SIGTERM drain, rebalance ceiling, fencing."""

from __future__ import annotations

import json
import re
import signal
import time
from collections.abc import Iterator

import pytest

from koda_runtime.processors.handlers.demo import demo_tokens
from koda_runtime.settings import Settings
from koda_runtime.topics.catalogue import RUN_CHUNKS, RUNS, partition_for_key
from tests.fixtures.processes import WorkerPool
from tests.fixtures.runs import Submitter, committed_offsets, read_topic, users_by_partition
from tests.support import wait_until


@pytest.fixture
def workers(env: Settings) -> Iterator[WorkerPool]:
    """The plugin's pool, but killed at the end: these tests leave workers mid-handoff."""
    with WorkerPool(env, kill_at_end=True) as pool:
        yield pool


def users_on_distinct_partitions(prefix: str, count: int, partitions: int) -> list[str]:
    return list(users_by_partition(prefix, partitions, count).values())


def run_row(sub: Submitter, run_id: str):
    return sub.query(
        "SELECT status, attempt, worker_id, started_at, finished_at FROM runs WHERE id = :r",
        r=run_id,
    )[0]


def test_sigterm_finishes_in_flight_runs_then_hands_over(env, submitter, workers) -> None:
    a = workers.start("a")
    wait_until(lambda: set(owners(submitter).values()) == {"a"}, timeout=60, what="a assigned")
    b = workers.start("b")
    wait_until(
        lambda: set(owners(submitter).values()) == {"a", "b"} and "assigned partitions" in b.log(),
        timeout=60,
        what="b joined",
    )
    # Runs on partitions a holds once the group has settled: a long run in flight on
    # each and a short one queued behind it. Queued on a, the short ones cannot have
    # run before the SIGTERM (however fast a is); a drops them unacked and b runs them.
    held = {p for p, w in owners(submitter).items() if w == "a"}
    a_users = [
        u
        for u in users_on_distinct_partitions("term", env.partitions, env.partitions)
        if partition_for_key(u.encode(), env.partitions) in held
    ][:3]
    long_inp = {"text": "three seconds", "demo": {"tokens": 15, "delay_ms": 200}}
    in_flight = [submitter.submit(u, long_inp) for u in a_users]
    wait_until(
        lambda: all(run_row(submitter, r).status == "streaming" for r in in_flight),
        timeout=60,
        what="runs streaming on a",
    )
    nxt = [
        submitter.submit(u, {"text": "next", "demo": {"tokens": 2, "delay_ms": 1}}) for u in a_users
    ]
    a.signal(signal.SIGTERM)
    a.signal(signal.SIGTERM)  # a second signal must not start a second drain
    assert a.proc is not None and a.proc.wait(40) == 0, a.log()[-3000:]
    for run_id in in_flight:
        row = run_row(submitter, run_id)
        assert (row.status, row.attempt, row.worker_id) == ("done", 1, "a")
        assert "reset" not in [m.kind for m in submitter.messages(run_id)]
        assert submitter.output(run_id) == "".join(demo_tokens(long_inp))
    wait_until(lambda: submitter.all_terminal(nxt), timeout=60, what="next runs on b")
    assert {run_row(submitter, r).worker_id for r in nxt} == {"b"}
    assert {run_row(submitter, r).attempt for r in nxt} == {1}  # never started twice
    assert a.log().count("drain=") >= 1
    assert (
        len(re.findall(r"revoked partitions=\[[0-9, ]+\] drain=\{'partitions': [1-9]", a.log()))
        == 1
    )


def test_rebalance_with_20_second_runs_is_bounded_by_the_ceiling(env, submitter, workers) -> None:
    """A join moves half of a's partitions to b: their 20 s runs are drained up to the
    ceiling, cut and resumed by b; the runs on the partitions a keeps go on untouched.

    The runs outlast the bound below (ceiling + 15 s): a rebalance that waited for them
    instead of cutting them off at the ceiling would take longer than it allows."""
    ceiling = 2.0
    extra = {"KODA_HANDOFF_CEILING": str(ceiling)}
    a = workers.start("a", **extra)
    users = users_on_distinct_partitions("long", env.partitions, env.partitions)
    long_inp = {"text": "twenty seconds", "demo": {"tokens": 20, "delay_ms": 1000}}
    long_runs = {
        partition_for_key(u.encode(), env.partitions): submitter.submit(u, long_inp) for u in users
    }
    wait_until(
        lambda: all(run_row(submitter, r).status == "streaming" for r in long_runs.values()),
        timeout=60,
        what="long runs streaming",
    )
    joined_at = time.monotonic()
    b = workers.start("b", **extra)
    # A rebalance waits for in-flight work at most the ceiling, not for the 20 s runs.
    quick_users = users_on_distinct_partitions("quick", env.partitions, env.partitions)
    quick = [
        submitter.submit(u, {"text": "q", "demo": {"tokens": 1, "delay_ms": 1}})
        for u in quick_users
        if u not in users
    ]
    wait_until(lambda: "assigned partitions" in b.log(), timeout=60, what="b assigned")
    assigned_after = time.monotonic() - joined_at
    assert assigned_after < ceiling + 15, f"rebalance took {assigned_after:.1f}s"
    wait_until(
        lambda: submitter.all_terminal(list(long_runs.values())), timeout=120, what="long runs"
    )
    owner = owners(submitter)
    moved = {p for p in long_runs if owner[p] == "b"}
    assert moved and len(moved) < len(long_runs), owner  # the group split the partitions
    for partition, run_id in long_runs.items():
        row = run_row(submitter, run_id)
        kinds = [m.kind for m in submitter.messages(run_id)]
        if partition in moved:
            assert (row.status, row.attempt, row.worker_id) == ("done", 2, "b")  # cut, resumed
            assert kinds.count("reset") == 1 and kinds[-1] == "done"
        else:
            assert (row.status, row.attempt, row.worker_id) == ("done", 1, "a")  # never paused
            assert "reset" not in kinds and kinds[-1] == "done"
        assert [m.seq for m in submitter.messages(run_id)] == list(range(len(kinds)))
        assert submitter.output(run_id) == "".join(demo_tokens(long_inp))
    wait_until(lambda: submitter.all_terminal(quick), timeout=60, what="quick runs done")
    assert f"cut_off': {len(moved)}" in a.log()


def owners(sub: Submitter) -> dict[int, str]:
    rows = sub.query("SELECT partition, worker_id FROM partition_epochs")
    return {r.partition: r.worker_id for r in rows}


def test_a_frozen_worker_that_wakes_up_writes_nothing(env, submitter, workers) -> None:
    a = workers.start("a")
    workers.start("b")
    wait_until(
        lambda: (
            set(owners(submitter).values()) == {"a", "b"}
            and len(owners(submitter)) == env.partitions
        ),
        timeout=60,
        what="both workers hold partitions",
    )
    held_by_a = {p for p, w in owners(submitter).items() if w == "a"}
    user = next(
        u
        for u in (f"frozen-{i}" for i in range(1000))
        if partition_for_key(u.encode(), env.partitions) in held_by_a
    )
    # 3 s: still streaming when a freezes (after its first chunks) and when it wakes up.
    inp = {"text": "fence me", "demo": {"tokens": 60, "delay_ms": 50}}
    run_id = submitter.submit(user, inp)
    wait_until(lambda: len(submitter.messages(run_id)) >= 5, timeout=60, what="run streaming on a")
    a.signal(signal.SIGSTOP)
    # a's session times out; b takes the partition and resumes the run. The claim waited
    # for any write a had in flight, so this count is final if fencing holds.
    wait_until(
        lambda: run_row(submitter, run_id).attempt == 2, timeout=60, what="b claimed the run"
    )
    stopped_rows = len([m for m in submitter.messages(run_id) if m.attempt == 1])
    a.signal(signal.SIGCONT)
    wait_until(lambda: submitter.all_terminal([run_id]), timeout=90, what="run done on b")
    wait_until(
        lambda: "fenced out" in a.log() or "partition lost" in a.log(),
        timeout=30,
        what="a noticed it was fenced",
    )
    rows = submitter.messages(run_id)
    assert len([m for m in rows if m.attempt == 1]) == stopped_rows  # nothing written after freeze
    assert [m.seq for m in rows] == list(range(len(rows)))
    assert run_row(submitter, run_id).worker_id == "b"
    assert submitter.output(run_id) == "".join(demo_tokens(inp))
    # On the topic, attempt-1 chunks are exactly those in Postgres: a emitted nothing after waking.
    chunks = [
        json.loads(m.value())
        for m in read_topic(env, env.names.topic(RUN_CHUNKS))
        if m.key().decode().startswith(run_id)
    ]
    assert sorted({c["seq"] for c in chunks if c["attempt"] == 1}) == list(range(stopped_rows))
    assert a.alive()


def end_offsets(env: Settings) -> dict[int, int]:
    from confluent_kafka import Consumer, TopicPartition

    from koda_runtime.kafka import consumer_config

    topic = env.names.topic(RUNS)
    consumer = Consumer(consumer_config(env, "test-ends", env.names.group("ends-probe")))
    try:
        return {
            p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
            for p in range(env.partitions)
        }
    finally:
        consumer.close()


def test_rebalances_before_anything_is_committed_lose_no_run(env, submitter, workers) -> None:
    # One run per user, so no later run of the same user can pull a skipped one along
    # (the predecessor rule), and no sweeper: a record skipped by the consumer would
    # leave its run pending for good. One run at a time per worker keeps most
    # partitions with fetched records and nothing committed while the group changes.
    one_at_a_time = {"KODA_MAX_INFLIGHT": "1"}
    a = workers.start("a", **one_at_a_time)
    wait_until(lambda: "assigned partitions" in a.log(), timeout=60, what="a assigned")
    inp = {"text": "short", "demo": {"tokens": 4, "delay_ms": 50}}
    runs = [submitter.submit(f"once-{i}", inp) for i in range(48)]
    b = workers.start("b", **one_at_a_time)
    workers.start("c", **one_at_a_time)
    wait_until(lambda: "assigned partitions" in b.log(), timeout=60, what="b assigned")
    b.signal(signal.SIGTERM)
    wait_until(lambda: submitter.all_terminal(runs), timeout=120, what="every run terminal")
    rows = submitter.query("SELECT status, attempt FROM runs WHERE id = ANY(:ids)", ids=runs)
    assert {(r.status, r.attempt) for r in rows} == {("done", 1)}
    group = env.names.group(env.worker_group)
    ends = end_offsets(env)
    wait_until(
        lambda: committed_offsets(env, group, env.names.topic(RUNS)) == ends,
        timeout=30,
        what=f"commits reach the end offsets {ends}",
    )
