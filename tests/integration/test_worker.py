"""The run pipeline's guarantees, against the real broker, database and worker processes."""

from __future__ import annotations

import json
from decimal import Decimal

import pytest
from sqlalchemy import text

from koda_runtime.processors.handlers.demo import demo_tokens
from koda_runtime.topics.catalogue import (
    RUN_CHUNKS,
    RUN_EVENTS,
    RUNS,
    RUNS_DLQ,
    WORKER_GROUP,
    partition_for_key,
)
from tests.fixtures.runs import committed_offsets, read_topic, wait_terminal
from tests.support import wait_until


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_runs_reach_done_with_contiguous_chunks_and_events(env, submitter, workers, loop) -> None:
    # KODA_EVENT_LOOP: the default (uvloop) and the standard loop both run the whole path.
    w = workers.start("w1", KODA_EVENT_LOOP=loop)
    inputs = [{"text": f"hello {i}", "demo": {"tokens": 7, "delay_ms": 1}} for i in range(6)]
    ids = [submitter.submit(f"user-{i % 3}", inp) for i, inp in enumerate(inputs)]
    wait_terminal(submitter, ids, 60, w)
    assert f"event=worker_event_loop loop={loop}" in w.log()
    assert set(submitter.statuses(ids).values()) == {"done"}
    for run_id, inp in zip(ids, inputs, strict=True):
        rows = submitter.messages(run_id)
        assert [r.seq for r in rows] == list(range(len(rows)))
        assert [r.kind for r in rows] == ["chunk"] * 7 + ["done"]
        assert submitter.output(run_id) == "".join(demo_tokens(inp))
    # Postgres first, then the topic: every row is on the chunk topic under <run_id>:<seq>.
    chunks = read_topic(env, env.names.topic(RUN_CHUNKS))
    keys = {m.key().decode() for m in chunks}
    for run_id in ids:
        assert {f"{run_id}:{i:010d}" for i in range(8)} <= keys
        user_partition = {m.partition() for m in chunks if m.key().decode().startswith(run_id)}
        run_row = submitter.query("SELECT user_id FROM runs WHERE id = :r", r=run_id)[0]
        assert user_partition == {partition_for_key(run_row.user_id.encode(), env.partitions)}
    events = [json.loads(m.value()) for m in read_topic(env, env.names.topic(RUN_EVENTS))]
    assert sum(1 for e in events if e.get("to") == "done") == len(ids)
    usage = submitter.query(
        "SELECT count(*) AS n, sum(cost_usd) AS c FROM usage WHERE run_id = ANY(:ids)", ids=ids
    )
    assert usage[0].n == len(ids) and usage[0].c > 0
    # The usage events carry the cost priced in the run's own transaction.
    rows = submitter.query(
        "SELECT run_id, call_index, cost_usd FROM usage WHERE run_id = ANY(:ids)", ids=ids
    )
    on_topic = {
        (e["run_id"], e["call_index"]): Decimal(e["cost_usd"])
        for e in events
        if e["event"] == "usage" and e["run_id"] in ids
    }
    assert on_topic == {(r.run_id, r.call_index): r.cost_usd for r in rows}


def test_per_user_order_with_two_workers(env, submitter, workers) -> None:
    # A tiny high-water mark makes the chains pause and resume their partitions.
    ws = [
        workers.start("w1", KODA_CHAIN_HIGH_WATER="4"),
        workers.start("w2", KODA_CHAIN_HIGH_WATER="4"),
    ]
    ids_by_user: dict[str, list[str]] = {}
    for i in range(10):
        for u in range(20):
            user = f"order-user-{u}"
            inp = {"text": f"{user} run {i}", "demo": {"tokens": 3, "delay_ms": 5}}
            ids_by_user.setdefault(user, []).append(submitter.submit(user, inp))
    all_ids = [r for ids in ids_by_user.values() for r in ids]
    wait_terminal(submitter, all_ids, 180, *ws)
    assert set(submitter.statuses(all_ids).values()) == {"done"}
    for user, ids in ids_by_user.items():
        rows = submitter.query(
            "SELECT id, started_at, finished_at FROM runs WHERE user_id = :u ORDER BY started_at",
            u=user,
        )
        assert [r.id for r in rows] == ids, f"{user}: runs started out of submission order"
        for prev, nxt in zip(rows, rows[1:], strict=False):
            assert prev.finished_at <= nxt.started_at, f"{user}: runs overlapped"


def test_a_long_run_does_not_delay_other_partitions(env, submitter, workers) -> None:
    w = workers.start("w1")
    slow_user = "slow-user"
    slow_p = partition_for_key(slow_user.encode(), env.partitions)
    others = [
        u
        for u in (f"fast-{i}" for i in range(40))
        if partition_for_key(u.encode(), env.partitions) != slow_p
    ][:10]
    # 12 s: longer than the fast runs may take (10 s), so they cannot have waited for it.
    slow = submitter.submit(slow_user, {"text": "slow", "demo": {"tokens": 12, "delay_ms": 1000}})
    wait_until(
        lambda: submitter.statuses([slow])[slow] == "streaming",
        timeout=60,
        what="slow run streaming",
    )
    fast = [submitter.submit(u, {"text": u, "demo": {"tokens": 3, "delay_ms": 1}}) for u in others]
    wait_terminal(submitter, fast, 10, w)
    assert submitter.statuses([slow])[slow] == "streaming"  # still running: not waited for
    wait_terminal(submitter, [slow], 60, w)


def test_redelivery_into_a_fresh_group_changes_nothing(env, submitter, workers) -> None:
    w = workers.start("w1")
    ids = [
        submitter.submit(f"redo-{i}", {"text": str(i), "demo": {"tokens": 4, "delay_ms": 1}})
        for i in range(8)
    ]
    wait_terminal(submitter, ids, 60, w)
    before_rows = submitter.query("SELECT id, status, attempt, finished_at FROM runs ORDER BY id")
    before_msgs = submitter.query("SELECT count(*) AS n FROM messages")[0].n
    events_topic = env.names.topic(RUN_EVENTS)
    before_events = len(read_topic(env, events_topic))
    assert w.stop() == 0
    # A fresh consumer group replays the runs topic from offset 0.
    w2 = workers.start("w2", KODA_WORKER_GROUP="workers-replay")
    group = env.names.group("workers-replay")
    runs_topic = env.names.topic(RUNS)
    total = sum(1 for _ in read_topic(env, runs_topic))
    wait_until(
        lambda: sum(max(o, 0) for o in committed_offsets(env, group, runs_topic).values()) >= total,
        timeout=60,
        what="replay group committed the whole topic",
    )
    assert w2.alive()
    assert (
        submitter.query("SELECT id, status, attempt, finished_at FROM runs ORDER BY id")
        == before_rows
    )
    assert submitter.query("SELECT count(*) AS n FROM messages")[0].n == before_msgs
    assert len(read_topic(env, events_topic)) == before_events


POISON = [
    (b"p-user", b"not json at all \xff\xfe", None, "undecodable"),
    (
        b"p-user",
        b'{"run_id": "x", "user_id": "p-user", "session_id": "s"}',
        [("schema", b"run.requested/9")],
        "unknown_schema_version",
    ),
    (b"p-user", b'{"run_id": "x", "session_id": "s"}', None, "invalid"),
    (b"p-user", b"x" * (1024 * 1024), None, "oversized"),
    (None, b'{"run_id": "x", "user_id": "p-user", "session_id": "s"}', None, "null_key"),
]


def test_poison_records_go_to_the_dlq_and_the_worker_carries_on(env, submitter, workers) -> None:
    w = workers.start("w1")
    before = submitter.submit("p-user", {"text": "before", "demo": {"tokens": 2, "delay_ms": 1}})
    for key, value, headers, _ in POISON:
        submitter.produce_raw(key, value, headers)
    after = submitter.submit("p-user", {"text": "after", "demo": {"tokens": 2, "delay_ms": 1}})
    wait_terminal(submitter, [before, after], 60, w)
    assert set(submitter.statuses([before, after]).values()) == {"done"}
    dlq_topic = env.names.topic(RUNS_DLQ)
    dead = wait_until(
        lambda: len(read_topic(env, dlq_topic)) >= len(POISON) and read_topic(env, dlq_topic),
        timeout=30,
        what="dead letters",
    )
    reasons = sorted(json.loads(m.value())["reason"] for m in dead)
    assert reasons == sorted(r for *_, r in POISON)
    letter = json.loads(dead[0].value())
    assert {"original_value", "topic", "partition", "offset", "attempts", "reason", "error"} <= set(
        letter
    )
    assert letter["topic"] == env.names.topic(RUNS)
    assert w.alive() and "Restarting" not in w.log() and "MaxRestartsExceeded" not in w.log()


def test_retries_then_success_and_exhaustion(env, submitter, workers) -> None:
    w = workers.start("w1")
    flaky = submitter.submit(
        "retry-user", {"text": "flaky", "demo": {"tokens": 6, "delay_ms": 1, "fail_attempts": 2}}
    )
    broken = submitter.submit(
        "retry-user", {"text": "broken", "demo": {"tokens": 6, "delay_ms": 1, "fail_attempts": 99}}
    )
    after = submitter.submit("retry-user", {"text": "after", "demo": {"tokens": 2, "delay_ms": 1}})
    wait_terminal(submitter, [flaky, broken, after], 60, w)
    rows = {
        r.id: r
        for r in submitter.query(
            "SELECT id, status, attempt, error FROM runs WHERE id = ANY(:i)",
            i=[flaky, broken, after],
        )
    }
    assert (rows[flaky].status, rows[flaky].attempt) == ("done", 3)
    assert (rows[broken].status, rows[broken].attempt) == ("failed", 3)
    assert "fail_attempts" in rows[broken].error
    assert rows[after].status == "done"  # the partition moved on
    kinds = [m.kind for m in submitter.messages(flaky)]
    assert kinds.count("reset") == 2 and kinds[-1] == "done"
    assert [m.seq for m in submitter.messages(flaky)] == list(range(len(kinds)))
    assert submitter.output(flaky) == "".join(demo_tokens({"text": "flaky", "demo": {"tokens": 6}}))
    assert submitter.messages(broken)[-1].kind == "error"
    dead = [json.loads(m.value()) for m in read_topic(env, env.names.topic(RUNS_DLQ))]
    assert [(d["reason"], d["attempts"]) for d in dead] == [("handler_failed", 3)]


def test_kill_9_mid_run_hands_the_run_to_another_worker(env, submitter, workers) -> None:
    w1 = workers.start("w1")
    user = "kill-user"
    inp = {"text": "survive", "demo": {"tokens": 30, "delay_ms": 100}}
    run_id = submitter.submit(user, inp)
    wait_until(lambda: len(submitter.messages(run_id)) >= 5, timeout=60, what="run streaming")
    partition = partition_for_key(user.encode(), env.partitions)
    w1.kill()
    group, runs_topic = env.names.group(WORKER_GROUP), env.names.topic(RUNS)
    assert committed_offsets(env, group, runs_topic)[partition] < 1  # the run was not committed
    w2 = workers.start("w2")
    wait_terminal(submitter, [run_id], 90, w2)
    rows = submitter.messages(run_id)
    assert [r.seq for r in rows] == list(range(len(rows)))  # 0..n exactly once
    kinds = [r.kind for r in rows]
    assert kinds.count("reset") == 1 and kinds[-1] == "done"
    reset_at = kinds.index("reset")
    assert {r.attempt for r in rows[:reset_at]} == {1}
    assert {r.attempt for r in rows[reset_at:]} == {2}
    assert submitter.output(run_id) == "".join(demo_tokens(inp))
    run = submitter.query("SELECT status, attempt, worker_id FROM runs WHERE id = :r", r=run_id)[0]
    assert (run.status, run.attempt, run.worker_id) == ("done", 2, "w2")
    wait_until(
        lambda: committed_offsets(env, group, runs_topic)[partition] == 1,
        timeout=30,
        what="successor committed after finishing",
    )


def test_a_run_whose_trigger_is_late_still_runs_before_the_users_later_runs(
    env, submitter, workers
) -> None:
    w = workers.start("w1")
    user = "late-trigger-user"
    first = submitter.submit(
        user, {"text": "first", "demo": {"tokens": 2, "delay_ms": 1}}, publish=False
    )
    second = submitter.submit(user, {"text": "second", "demo": {"tokens": 2, "delay_ms": 1}})
    wait_terminal(submitter, [first, second], 60, w)
    rows = submitter.query("SELECT id FROM runs WHERE user_id = :u ORDER BY started_at", u=user)
    assert [r.id for r in rows] == [first, second]
    submitter.publish(first, user)  # the late trigger finally arrives: a harmless duplicate
    after = submitter.submit(user, {"text": "after", "demo": {"tokens": 1, "delay_ms": 1}})
    wait_terminal(submitter, [after], 60, w)
    assert submitter.query("SELECT attempt FROM runs WHERE id = :r", r=first)[0].attempt == 1


def test_an_older_run_a_dead_worker_left_running_runs_before_the_users_later_run(
    env, submitter, workers
) -> None:
    """A worker ran a user's older run as a predecessor (its trigger was late), then died
    mid-run: the run is ``running`` and its trigger is still not on the topic. The
    partition's next owner, handed the user's later run, resumes the older one first;
    waiting for the late trigger would run the two out of order."""
    user = "orphaned-predecessor-user"
    first = submitter.submit(
        user, {"text": "first", "demo": {"tokens": 3, "delay_ms": 1}}, publish=False
    )
    with submitter.engine.begin() as conn:  # what the dead owner's claim left behind
        conn.execute(
            text(
                "UPDATE runs SET status = 'running', attempt = 1, started_at = now(),"
                " worker_id = 'dead-worker' WHERE id = :r"
            ),
            {"r": first},
        )
    second = submitter.submit(user, {"text": "second", "demo": {"tokens": 2, "delay_ms": 1}})
    w = workers.start("w1")
    wait_terminal(submitter, [first, second], 60, w)
    rows = {
        r.id: r
        for r in submitter.query(
            "SELECT id, status, attempt, started_at, finished_at FROM runs WHERE id = ANY(:ids)",
            ids=[first, second],
        )
    }
    assert rows[first].status == "done" and rows[first].attempt == 2  # resumed, not rerun anew
    assert rows[first].finished_at <= rows[second].started_at
    assert submitter.output(first) == "".join(
        demo_tokens({"text": "first", "demo": {"tokens": 3, "delay_ms": 1}})
    )


def test_a_run_decided_elsewhere_mid_stream_never_stalls_its_partition(
    env, submitter, workers
) -> None:
    # A write of a run finds it no longer owned while this worker still holds its
    # partition: here the row is ended from outside (as a cancel, or a finish whose
    # commit was acknowledged too late to be seen, would leave it). That is no lost
    # partition: closing its chains would refuse every later record of the partition
    # for good (a chaos run stalled on it). The record is read again instead, the run
    # is found ended and acked, and the partition goes on.
    w1 = workers.start("w1")
    partition = partition_for_key(b"moved-a", env.partitions)
    other = next(
        f"moved-b{i}"
        for i in range(10_000)
        if partition_for_key(f"moved-b{i}".encode(), env.partitions) == partition
    )
    slow = submitter.submit("moved-a", {"text": "long", "demo": {"tokens": 400, "delay_ms": 50}})
    wait_until(lambda: len(submitter.messages(slow)) >= 3, timeout=60, what="the run streaming")
    with submitter.engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE runs SET status = 'failed', error = 'ended elsewhere',"
                " finished_at = now() WHERE id = :r"
            ),
            {"r": slow},
        )
    wait_until(
        lambda: "chunk write fenced out" in w1.log(),
        timeout=60,
        what="the worker meeting the run's new row",
    )
    after = submitter.submit(other, {"text": "next", "demo": {"tokens": 3, "delay_ms": 1}})
    wait_terminal(submitter, [after], 30, w1)
    assert submitter.statuses([slow, after]) == {slow: "failed", after: "done"}
    assert "run fenced out on a partition still held" in w1.log()
    assert "partition lost" not in w1.log()
    group, runs_topic = env.names.group(WORKER_GROUP), env.names.topic(RUNS)
    wait_until(
        lambda: committed_offsets(env, group, runs_topic)[partition] == 2,
        timeout=30,
        what="both records committed",
    )
