"""Records that once stalled a partition for good, on the real broker and Postgres.

Each bad record is put straight onto the runs partition of a known user, and that
user's next run must still reach ``done``:

* 10 KB of JSON nested 5,000 deep (a RecursionError in the parser), a valid value under
  a 900 KB key, a valid value with 50 headers of 20 KB (dead letters of 2.1 and 1.3 MB,
  over the producer's request size): each ends in the DLQ exactly once, with its reason
  and its original sizes.
* A record that keeps failing before its run is claimed (the worker's
  ``fail-before-claim`` fault, as a lost database connection would) is dead-lettered
  ``failed_before_claim`` after ``KODA_RECORD_TRIES``, not retried for ever; replayed
  once the fault is gone, its run is done.
* A dead letter the broker refuses whatever its size (the DLQ topic's
  ``max.message.bytes`` shrunk to 200 bytes) is skipped with an error log naming the
  partition and offset; the partition goes on.

The bounds in isolation: tests/unit/test_record_bounds.py.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from confluent_kafka.admin import (  # type: ignore[attr-defined]
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    ResourceType,
)

from koda_runtime.settings import Settings
from koda_runtime.topics.admin import admin_client
from koda_runtime.topics.catalogue import RUNS, RUNS_DLQ, partition_for_key
from koda_runtime.topics.dlq import replay_dead_letters
from koda_runtime.topics.records.codec import (
    DEAD_LETTER_MAX_BYTES,
    RUN_REQUESTED,
    RunRequested,
    headers_for,
)
from koda_runtime.topics.records.dead_letters import decode_dead_letter
from tests.fixtures.processes import WorkerProcess
from tests.fixtures.runs import Submitter, read_topic
from tests.support import wait_until

FAST = {"text": "after the poison", "demo": {"tokens": 2, "delay_ms": 1}}


def put(sub: Submitter, user: str, key: bytes, value: bytes, headers: Any) -> int:
    """Produce one record onto ``user``'s runs partition whatever its key; its partition."""
    partition = partition_for_key(user.encode(), sub.settings.partitions)
    sub.producer.produce(sub.topic, key=key, value=value, headers=headers, partition=partition)
    assert sub.producer.flush(30) == 0
    return partition


def letters(env: Settings) -> list[Any]:
    return read_topic(env, env.names.topic(RUNS_DLQ))


def done(sub: Submitter, run_id: str, worker: WorkerProcess, timeout: float = 60) -> None:
    try:
        wait_until(lambda: sub.all_terminal([run_id]), timeout=timeout, what="the user's run")
    except AssertionError:
        raise AssertionError(f"run {run_id} never ended\n{worker.log()[-4000:]}") from None
    assert sub.statuses([run_id]) == {run_id: "done"}


def test_three_records_that_stalled_a_partition_are_dead_lettered_once_each(
    env: Settings,
) -> None:
    sub = Submitter(env)
    worker = WorkerProcess(env, "bounds").start()
    user = "bounds-" + uuid.uuid4().hex[:6]
    valid = RunRequested("no-such-run", user, f"s-{user}", "").encode()
    inner = b"[" * 5000 + b"]" * 5000
    deep = b'{"run_id":"r","user_id":"' + user.encode() + b'","session_id":"s","x":' + inner + b"}"
    cases = [
        ("too_deep", user.encode(), deep, list(headers_for(RUN_REQUESTED))),
        ("oversized_key", b"k" * 900_000, valid, list(headers_for(RUN_REQUESTED))),
        ("oversized_headers", user.encode(), valid, [(f"h{i}", b"v" * 20_000) for i in range(50)]),
    ]
    try:
        first = sub.submit(user, FAST)
        done(sub, first, worker)
        for reason, key, value, headers in cases:
            put(sub, user, key, value, headers)
            after = sub.submit(user, FAST)
            done(sub, after, worker)  # the user's chain went past the poison
            got: list[Any] = []

            def arrived(reason: str = reason, got: list[Any] = got) -> bool:
                got[:] = [decode_dead_letter(m.value()) for m in letters(env)]
                return any(dl.reason == reason for dl in got)

            wait_until(arrived, timeout=30, what=f"the {reason} dead letter")
        # Nothing was retried into a second letter.
        time.sleep(3)
        msgs = letters(env)
        assert sorted(decode_dead_letter(m.value()).reason for m in msgs) == sorted(
            r for r, *_ in cases
        ), worker.log()[-3000:]
        partition = partition_for_key(user.encode(), env.partitions)
        by_reason = {decode_dead_letter(m.value()).reason: m for m in msgs}
        for reason, key, value, headers in cases:
            msg = by_reason[reason]
            size = len(msg.value()) + len(msg.key() or b"")
            assert size <= DEAD_LETTER_MAX_BYTES, (reason, size)
            dl = decode_dead_letter(msg.value())
            assert (dl.topic, dl.partition) == (env.names.topic(RUNS), partition)
            assert dl.error and dl.offset >= 0 and dl.attempts == 0
            assert (dl.key_size, dl.original_size) == (len(key), len(value))
            assert dl.headers_count == len(headers)
        assert (
            by_reason["too_deep"].value()
            and decode_dead_letter(by_reason["too_deep"].value()).value == deep
        )  # 10 KB: kept whole, replayable
        assert decode_dead_letter(by_reason["oversized_key"].value()).truncated
        assert "50 headers" in decode_dead_letter(by_reason["oversized_headers"].value()).error
        log = worker.log()
        assert worker.alive(), log[-3000:]
        assert "will retry" not in log, log[-3000:]  # no record was retried in place
        for bad in ("Traceback", "Crashed", "RecursionError"):
            assert bad not in log, log[-3000:]
    finally:
        worker.stop()
        sub.close()


def test_a_record_failing_before_its_claim_is_dead_lettered_after_its_tries(
    env: Settings,
) -> None:
    sub = Submitter(env)
    faulty = WorkerProcess(
        env, "pre-claim", {"KODA_TEST_FAULT": "fail-before-claim", "KODA_RECORD_TRIES": "2"}
    ).start()
    user = "fault-" + uuid.uuid4().hex[:6]
    try:
        started = time.monotonic()
        stuck = sub.submit(user, FAST)
        other = sub.submit("healthy-" + uuid.uuid4().hex[:6], FAST)
        done(sub, other, faulty)  # the fault touches only fault-* users

        def letter() -> Any:
            msgs = letters(env)
            return msgs[0] if msgs else None

        msg = wait_until(letter, timeout=90, what="the failed_before_claim letter")
        waited = time.monotonic() - started
        dl = decode_dead_letter(msg.value())
        assert dl.reason == "failed_before_claim", dl
        assert "2 tries counted" in dl.error and "ConnectionResetError" in dl.error, dl.error
        assert "connection to the database was lost" in dl.error
        assert waited >= 8, waited  # the second try counts 8 s after the first
        assert not dl.truncated and dl.value is not None
        assert sub.statuses([stuck]) == {stuck: "pending"}  # never claimed
        log = faulty.log()
        assert log.count("record failed, will retry") >= 2, log[-3000:]
        # Not retried any more: no second letter, no new failure of that record.
        failures = log.count("record failed, will retry")
        time.sleep(12)
        assert len(letters(env)) == 1
        assert faulty.log().count("record failed, will retry") == failures
    finally:
        faulty.stop()
    healthy = WorkerProcess(env, "healed").start()
    try:
        report = replay_dead_letters(env, reasons=["failed_before_claim"])
        assert report.replayed == 1, report
        done(sub, stuck, healthy)
    finally:
        healthy.stop()
        sub.close()


def test_a_dead_letter_the_broker_refuses_is_skipped_and_the_partition_goes_on(
    env: Settings,
) -> None:
    dlq = env.names.topic(RUNS_DLQ)
    admin = admin_client(env)
    entry = ConfigEntry("max.message.bytes", "200", incremental_operation=AlterConfigOpType.SET)
    futures = admin.incremental_alter_configs(
        [ConfigResource(ResourceType.TOPIC, dlq, incremental_configs=[entry])]
    )
    for fut in futures.values():
        fut.result(30)
    sub = Submitter(env)
    worker = WorkerProcess(env, "refused").start()
    user = "refused-" + uuid.uuid4().hex[:6]
    try:
        first = sub.submit(user, FAST)
        done(sub, first, worker)
        partition = put(sub, user, user.encode(), b"\x00\xff garbage", None)
        after = sub.submit(user, FAST)
        done(sub, after, worker)

        def skipped() -> str | None:
            lines = [ln for ln in worker.log().splitlines() if "event=record_skipped" in ln]
            return lines[0] if lines else None

        line = wait_until(skipped, timeout=30, what="the record_skipped log line")
        assert f"partition={partition} " in line and "offset=" in line, line
        assert "dead_letter_reason=undecodable" in line, line
        assert letters(env) == []
        log = worker.log()
        assert log.count("event=record_skipped") == 1, log[-3000:]
        assert "will retry" not in log, log[-3000:]
        assert worker.alive(), log[-3000:]
    finally:
        worker.stop()
        sub.close()
