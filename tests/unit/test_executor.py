"""The worker's executor (processors/runner.py) over in-memory ports: the rules it
applies and the order of its writes, deliveries and acks, with no services.

The same guarantees are proved on the real Kafka and Postgres by
tests/integration/test_worker.py, test_retry_budget.py, test_chunk_topic_repair.py and
tests/e2e/test_handoff.py; here each rule is provoked directly and fast."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from koda_runtime.lifecycle.attempts import MAX_CLAIMS_PER_ATTEMPT
from koda_runtime.lifecycle.handler import CancelToken, RunFailed, Status, Usage
from koda_runtime.lifecycle.ledger import Outcome
from koda_runtime.lifecycle.states import RunStatus
from koda_runtime.naming import AppEnv
from koda_runtime.processors.fences import FencedOut
from koda_runtime.processors.groupcommit import GroupWriter
from koda_runtime.processors.runner import Record, RunExecutor
from koda_runtime.schemas.runs.worker import ChunkWrite
from koda_runtime.settings import Settings
from koda_runtime.topics.records.codec import (
    RUN_REQUESTED,
    RunRequested,
    decode_run_requested,
    headers_for,
)
from tests.support import loop_until
from tests.unit.worker_fakes import TOPIC, FakeOutput, FakeStore, ScriptedHandler

SETTINGS = Settings(
    app_env=AppEnv.DEV,
    max_attempts=3,
    retry_base_s=0.001,
    chunk_batch_size=2,
    chunk_batch_ms=0,
    worker_id="w-unit",
)


def record(run_id: str, user_id: str = "u", offset: int = 7) -> Record:
    value = RunRequested(run_id, user_id, "s", "2026-01-01T00:00:00Z").encode()
    return Record(TOPIC, 0, offset, user_id.encode(), value, headers_for(RUN_REQUESTED))


class World:
    made: list[World] = []

    def __init__(self, handler: ScriptedHandler, *, hold: bool = False, **settings: Any) -> None:
        self.store = FakeStore()
        self.out = FakeOutput(self.store, hold=hold)
        self.handler = handler
        config = SETTINGS if not settings else _with(SETTINGS, **settings)
        writer = GroupWriter(self.store, fault=config.test_fault)
        self.executor = RunExecutor(config, self.store, self.out, handler, writer)
        self.fence = self.store.own(0)
        World.made.append(self)

    async def run(self, run_id: str, **kw: Any) -> None:
        await self.executor.process(record(run_id, **kw), self.fence, CancelToken())

    async def marked(self, run_id: str, seq: int) -> None:
        """Until the run's published mark (written by a coming group) is in."""
        row = self.store.runs[run_id]
        await loop_until(lambda: row.published_seq == seq)


@pytest.fixture(autouse=True)
async def _close_writers() -> AsyncIterator[None]:
    yield
    for w in World.made:
        await w.executor.writer.close()
    World.made.clear()


def _with(settings: Settings, **fields: Any) -> Settings:
    from dataclasses import replace

    return replace(settings, **fields)


async def test_a_run_streams_then_ends_done_and_is_marked_whole() -> None:
    w = World(ScriptedHandler(["a", "b", "c", Usage("m", 3, 3)]))
    w.store.add("r1")
    await w.run("r1")
    row = w.store.runs["r1"]
    assert (row.status, row.attempt) == (RunStatus.DONE, 1)
    assert w.store.kinds("r1") == ["chunk", "chunk", "chunk", "done"]
    assert w.out.of("r1") == [
        "transition:running",
        "chunk",
        "chunk",  # a full batch of two
        "chunk",
        "done",  # the last chunk rides the finish
        "transition:done",
        "usage:",
    ]
    # The ledger row of the call, written by the finish.
    assert [c.outcome for c in w.store.ledger.values()] == [Outcome.OK]
    # Once every delivery is in, the run is known whole on the chunk topic.
    await w.marked("r1", 3)


async def test_a_failed_attempt_is_retried_and_the_retry_starts_with_a_reset() -> None:
    w = World(ScriptedHandler(["a", RuntimeError("flaky")], ["x", "y"]))
    w.store.add("r1")
    await w.run("r1")
    row = w.store.runs["r1"]
    assert (row.status, row.attempt, row.failures) == (RunStatus.DONE, 2, 1)
    assert w.store.kinds("r1") == ["chunk", "reset", "chunk", "chunk", "done"]
    reset = w.store.messages_of["r1"][1]
    assert json.loads(reset.content) == {"attempt": 2} and reset.attempt == 2
    assert w.out.letters() == []


async def test_retries_exhausted_dead_letter_the_record_and_fail_the_run() -> None:
    w = World(ScriptedHandler(["a", RuntimeError("boom")]))
    w.store.add("r1")
    await w.run("r1")
    row = w.store.runs["r1"]
    assert (row.status, row.failures, row.attempt) == (RunStatus.FAILED, 3, 3)
    assert row.error == "RuntimeError: boom"
    (letter,) = w.out.letters()
    assert (letter["reason"], letter["attempts"], letter["offset"]) == ("handler_failed", 3, 7)
    assert w.store.kinds("r1") == ["chunk", "reset", "chunk", "reset", "chunk", "error"]
    end = w.store.messages_of["r1"][5]
    assert json.loads(end.content) == {"error": "RuntimeError: boom", "attempts": 3}
    assert w.out.of("r1")[-1] == "transition:failed"


async def test_a_final_failure_is_not_retried() -> None:
    w = World(ScriptedHandler(["a", RunFailed("too many tool turns")], ["never"]))
    w.store.add("r1")
    await w.run("r1")
    assert (w.store.runs["r1"].status, w.store.runs["r1"].attempt) == (RunStatus.FAILED, 1)
    assert [ctx.attempt for ctx in w.handler.contexts] == [1]
    # Not poison: replaying the record would fail the same way, so no dead letter.
    assert w.out.letters() == []
    assert w.store.kinds("r1")[-1] == "error"


async def test_a_run_claimed_too_often_is_given_up_without_running() -> None:
    w = World(ScriptedHandler(["never"]))
    bound = SETTINGS.max_attempts * MAX_CLAIMS_PER_ATTEMPT
    w.store.add("r1", status=RunStatus.STREAMING, attempt=bound)
    await w.run("r1")
    assert w.store.runs["r1"].status is RunStatus.FAILED
    assert w.handler.contexts == []
    (letter,) = w.out.letters()
    assert letter["error"].startswith(f"claimed {bound} times without finishing")


async def test_the_record_is_acked_only_after_every_delivery() -> None:
    w = World(ScriptedHandler(["a", "b", "c"]), hold=True)
    w.store.add("r1")
    task = asyncio.create_task(w.run("r1"))

    await loop_until(lambda: w.store.runs["r1"].status is RunStatus.DONE)
    for _ in range(20):  # loop turns in which a wrong start would happen: an absence
        await asyncio.sleep(0)  # cannot be waited on
    assert not task.done(), "returned (acked) before its records were delivered"
    assert w.store.runs["r1"].published_seq is None
    w.out.hold = False
    w.out.deliver()
    await asyncio.wait_for(task, 5)
    await w.marked("r1", 3)


async def test_a_run_cut_off_writes_no_end_and_bills_its_calls_cancelled() -> None:
    stuck = asyncio.Event()
    w = World(ScriptedHandler(["a", "b", Usage("m", 5, 2), "c", stuck.wait]))
    w.store.add("r1")
    task = asyncio.create_task(w.run("r1"))

    def usage_events() -> list[int]:
        return [s.fields["call_index"] for s in w.out.sent if s.what == "usage"]

    # The call's usage came before "c": the batch writing "c" wrote its row, ok.
    await loop_until(lambda: usage_events() == [0])
    assert len(w.store.messages_of["r1"]) == 3
    assert [c.outcome for c in w.store.ledger.values()] == [Outcome.OK]
    task.cancel()  # the handoff ceiling
    with pytest.raises(asyncio.CancelledError):
        await task
    row = w.store.runs["r1"]
    assert row.status is RunStatus.STREAMING  # the successor resumes it
    assert "done" not in w.store.kinds("r1")
    calls = sorted(w.store.ledger.values(), key=lambda c: c.call_index)
    assert [(c.outcome, c.usage.estimated) for c in calls] == [
        (Outcome.OK, False),  # written by the batch, once
        (Outcome.CANCELLED, True),  # "c" streamed after the last usage record
    ]
    assert usage_events() == [0, 1]  # one event per row written


async def test_a_reported_call_is_billed_ok_by_the_next_batch_and_a_cut_one_at_the_end() -> None:
    w = World(
        ScriptedHandler(
            [
                "a",
                Usage("m", 1, 1),
                "b",
                Usage("m", 2, 3, estimated=True),
                "c",
                RuntimeError("cut"),
            ],
            ["x", Usage("m", 4, 4)],
        )
    )
    w.store.add("r1")
    await w.run("r1")
    assert w.store.runs["r1"].status is RunStatus.DONE
    got = sorted(
        (c.attempt, c.call_index, c.outcome, c.usage.estimated) for c in w.store.ledger.values()
    )
    assert got == [
        (1, 0, Outcome.OK, False),  # written with "b", before the attempt failed
        (1, 1, Outcome.FAILED, True),  # the handler said the call was cut: the end's
        (1, 2, Outcome.FAILED, True),  # "c", streamed after the last usage record
        (2, 0, Outcome.OK, False),  # came last: written by the finish
    ]
    # The call of attempt 1 went with the batch of "b", not with the failure.
    batches = [w_ for group in w.store.groups for w_ in group if isinstance(w_, ChunkWrite)]
    carried = [([c.content for c in b.chunks], [c.call_index for c in b.ledger]) for b in batches]
    assert carried[:3] == [(["a"], []), (["b"], [0]), (["c"], [])]


async def test_a_call_no_output_follows_is_billed_alone_within_the_window() -> None:
    stuck = asyncio.Event()
    w = World(ScriptedHandler(["a", Usage("m", 5, 2), stuck.wait]))  # then a slow tool
    w.store.add("r1")
    task = asyncio.create_task(w.run("r1"))

    await loop_until(lambda: len(w.store.ledger) == 1)
    (call,) = w.store.ledger.values()
    assert (call.attempt, call.call_index, call.outcome) == (1, 0, Outcome.OK)
    assert w.store.kinds("r1") == ["chunk"]  # a batch of the call alone: no chunk
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert list(w.store.ledger.values()) == [call]  # the cut had nothing left to bill


async def test_a_runs_first_output_is_written_at_once_and_the_rest_waits_for_the_window() -> None:
    more = asyncio.Event()
    w = World(
        ScriptedHandler(["a", more.wait, "b", "c", more.wait, "d"]),
        chunk_batch_size=32,
        chunk_batch_ms=60_000,
    )
    w.store.add("r1")
    task = asyncio.create_task(w.run("r1"))
    # Written while the handler waits, long before a minute's window ends.
    await loop_until(lambda: w.store.kinds("r1") == ["chunk"])
    assert w.store.runs["r1"].status is RunStatus.STREAMING
    more.set()
    await task
    batches = [w_ for group in w.store.groups for w_ in group if isinstance(w_, ChunkWrite)]
    assert [[c.content for c in b.chunks] for b in batches] == [["a"]]  # b-d: the finish's
    assert w.store.kinds("r1") == ["chunk", "chunk", "chunk", "chunk", "done"]


async def test_a_partition_lost_mid_run_fences_the_run_out() -> None:
    async def lose_the_partition() -> None:
        await loop_until(lambda: len(w.store.messages_of["r1"]) >= 2)
        w.store.own(0)

    w = World(ScriptedHandler(["a", "b", lose_the_partition, "c", "d"]))
    w.store.add("r1")
    with pytest.raises(FencedOut, match="fenced out"):
        await w.run("r1")
    assert w.store.runs["r1"].status is RunStatus.STREAMING
    assert w.store.kinds("r1") == ["chunk", "chunk"]  # nothing after the epoch moved


async def test_a_claim_that_finds_the_run_ended_is_no_fencing() -> None:
    w = World(ScriptedHandler(["never"]))
    w.store.add("r1", status=RunStatus.DONE, published_seq=0)
    await w.run("r1")
    assert w.handler.contexts == [] and w.out.sent == []


async def test_a_stale_fence_cannot_claim() -> None:
    w = World(ScriptedHandler(["never"]))
    w.store.add("r1")
    stale = w.fence
    w.store.own(0)
    with pytest.raises(FencedOut, match="claim fenced out"):
        await w.executor.process(record("r1"), stale, CancelToken())
    assert w.store.runs["r1"].status is RunStatus.PENDING


async def test_unfinished_older_runs_of_the_user_run_first() -> None:
    w = World(ScriptedHandler([RuntimeError("boom")]), max_attempts=1)
    w.store.add("older")
    w.store.add("other-user", user_id="v")
    w.store.add("newer")
    await w.run("newer", offset=42)
    assert w.store.runs["older"].status is RunStatus.FAILED
    assert w.store.runs["newer"].status is RunStatus.FAILED
    assert w.store.runs["other-user"].status is RunStatus.PENDING
    first, second = w.out.letters()
    # The predecessor's letter carries a trigger for the predecessor itself, at no
    # offset (no record of it was read); the record in hand keeps its own offset.
    assert first["offset"] == -1
    older = decode_run_requested(first["key"], first["value"], first["headers"])
    assert (older.run_id, older.user_id) == ("older", "u")
    assert (second["offset"], second["value"]) == (42, record("newer", offset=42).value)
    assert [c.run_id for c in w.handler.contexts] == ["older", "newer"]


async def test_a_cancel_requested_before_the_claim_ends_the_run_without_running_it() -> None:
    w = World(ScriptedHandler(["never"]))
    w.store.add("r1", cancel_requested=True, cancel_reason="user")
    await w.run("r1")
    assert w.store.runs["r1"].status is RunStatus.CANCELLED
    assert w.handler.contexts == []
    end = w.store.messages_of["r1"][0]
    assert json.loads(end.content) == {"status": "cancelled", "reason": "user"}
    transition = [s for s in w.out.sent if s.what == "transition"][-1]
    assert transition.fields == {"to": "cancelled", "attempt": 1, "reason": "user"}


async def test_a_merge_seen_only_by_the_finish_runs_the_attempt_again() -> None:
    w = World(ScriptedHandler(["old", lambda: _merge(w.store)], ["new"]))
    w.store.add("r1", input={"text": "first"})
    await w.run("r1")
    row = w.store.runs["r1"]
    assert (row.status, row.attempt) == (RunStatus.DONE, 2)
    # The refused finish gave its done event's seq back: seqs stay contiguous.
    assert sorted(w.store.messages_of["r1"]) == [0, 1, 2, 3]
    assert w.store.kinds("r1") == ["chunk", "reset", "chunk", "done"]
    assert w.handler.contexts[1].input == {"text": "merged"}


def _merge(store: FakeStore) -> None:
    row = store.runs["r1"]
    row.input, row.input_version = {"text": "merged"}, row.input_version + 1


async def test_a_database_failure_reaches_the_chain_and_the_record_can_run_again() -> None:
    w = World(ScriptedHandler(["a", "b"]))
    w.store.add("r1")
    w.store.fail_next_group = ConnectionError("lost")
    with pytest.raises(ConnectionError):  # the chain retries the record in place
        await w.run("r1")
    assert (w.store.runs["r1"].status, w.store.runs["r1"].attempt) == (RunStatus.PENDING, 0)
    await w.run("r1")
    assert w.store.runs["r1"].status is RunStatus.DONE
    assert w.store.kinds("r1") == ["chunk", "chunk", "done"]


async def test_a_status_item_is_a_status_chunk_in_order_and_not_output() -> None:
    """A fallback model's announcement: a `status` event between the answer's chunks."""
    note = json.dumps({"model": "m-b", "fallback": True})
    w = World(ScriptedHandler([Status(note), "a", "b", Usage("m-b", 2, 2)]))
    w.store.add("r1")
    await w.run("r1")
    assert w.store.kinds("r1") == ["status", "chunk", "chunk", "done"]
    assert w.store.messages_of["r1"][0].content == note
    assert w.store.runs["r1"].status is RunStatus.DONE


async def test_a_billed_call_counts_its_tokens_and_cost_by_model() -> None:
    from koda_runtime.metrics import REGISTRY

    def value(name: str, **labels: str) -> float:
        return REGISTRY.get_sample_value(name, labels) or 0.0

    before = (
        value("koda_model_tokens_total", model="m-metrics", direction="in"),
        value("koda_model_tokens_total", model="m-metrics", direction="out"),
        value("koda_model_cost_usd_total", model="m-metrics"),
    )
    w = World(ScriptedHandler(["a", Usage("m-metrics", 30, 4)]))
    w.store.add("r1")
    await w.run("r1")
    after = (
        value("koda_model_tokens_total", model="m-metrics", direction="in"),
        value("koda_model_tokens_total", model="m-metrics", direction="out"),
        value("koda_model_cost_usd_total", model="m-metrics"),
    )
    # The fake ledger prices every call at 0.001 USD.
    assert [a - b for a, b in zip(after, before, strict=True)] == pytest.approx([30, 4, 0.001])
