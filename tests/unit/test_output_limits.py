"""Output Kafka or Postgres would refuse, and the limits on an admitted run, as pure rules
and over the executor's in-memory ports (tests/unit/worker_fakes.py).

The same rules on the real broker and database: tests/integration/test_run_limits.py."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import replace
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import psycopg
import pytest
import sqlalchemy.exc
from aiokafka.errors import KafkaConnectionError, MessageSizeTooLargeError

from koda_runtime.lifecycle.attempts import claim_bound
from koda_runtime.lifecycle.chunks import (
    MAX_CHUNK_BYTES,
    Chunk,
    ChunkKind,
    SeqCounter,
    split_content,
    storable,
)
from koda_runtime.lifecycle.handler import CancelToken, RunFailed, ToolActivity, Usage
from koda_runtime.lifecycle.ledger import Exceeded, Period
from koda_runtime.lifecycle.states import RunStatus
from koda_runtime.naming import AppEnv
from koda_runtime.processors.groupcommit import GroupWriter
from koda_runtime.processors.runner import Record, RunExecutor
from koda_runtime.processors.streaming import ChunkBatcher, refusal
from koda_runtime.schemas.runs.worker import Batched, GroupResult, GroupWrite
from koda_runtime.settings import Settings
from koda_runtime.topics.records.codec import RUN_REQUESTED, RunRequested, headers_for
from tests.support import loop_until
from tests.unit.worker_fakes import TOPIC, FakeOutput, FakeStore, ScriptedHandler

SETTINGS = Settings(
    app_env=AppEnv.DEV,
    max_attempts=3,
    retry_base_s=0.001,
    chunk_batch_size=4,
    chunk_batch_ms=0,
    worker_id="w-limits",
)

# -- cleaning and splitting ---------------------------------------------------------


def test_nul_and_surrogates_become_the_replacement_character() -> None:
    assert storable("a\x00b\ud800c\udfffd") == "a\ufffdb\ufffdc\ufffdd"
    clean = "plain, é, 日本, \U0001f600"
    assert storable(clean) == clean
    storable("x\x00\ud83d").encode()  # what comes out always encodes


@pytest.mark.parametrize("char", ["a", "é", "日", "\U0001f600"])
def test_a_long_text_is_cut_between_code_points_within_the_cap(char: str) -> None:
    text = char * 50_000
    pieces = split_content(text, 1000)
    assert "".join(pieces) == text
    assert all(0 < len(p.encode()) <= 1000 for p in pieces)
    assert len(pieces) == -(-len(text.encode()) // (1000 - 1000 % len(char.encode())))


def test_a_text_within_the_cap_stays_one_piece() -> None:
    assert split_content("x" * MAX_CHUNK_BYTES) == ["x" * MAX_CHUNK_BYTES]
    assert split_content("") == [""]
    with pytest.raises(ValueError, match="limit"):
        split_content("abc", 3)


def test_a_seq_counter_rewinds_to_a_seq_it_handed_out_only() -> None:
    seq = SeqCounter(5)
    for _ in range(3):
        seq.take()
    seq.rewind(6)
    assert seq.take() == 6
    with pytest.raises(ValueError, match="rewind"):
        seq.rewind(9)


def _batcher() -> ChunkBatcher:
    unused: Any = None  # add() and take() touch neither the writer nor the emitter
    return ChunkBatcher(unused, unused, unused, "r", 1, SeqCounter(3), [], 32)


def test_an_oversize_text_chunk_is_written_as_consecutive_chunks_of_its_kind() -> None:
    b = _batcher()
    text = "ab" * (MAX_CHUNK_BYTES + 10)
    b.add(ChunkKind.CHUNK, text)
    b.add(ChunkKind.CHUNK, "!")
    taken = b.take()
    assert [c.seq for c in taken] == [3, 4, 5, 6]
    assert {c.kind for c in taken} == {ChunkKind.CHUNK}
    assert "".join(c.content for c in taken) == text + "!"
    assert max(len(c.content.encode()) for c in taken) == MAX_CHUNK_BYTES


def test_a_tool_event_over_the_cap_fails_the_run_naming_the_cap() -> None:
    b = _batcher()
    with pytest.raises(RunFailed, match=f"tool event of .* over the cap of {MAX_CHUNK_BYTES}"):
        b.add(ChunkKind.TOOL, '{"arguments": "' + "x" * MAX_CHUNK_BYTES + '"}')
    assert b.take() == [] and b.seq.next == 3  # nothing taken, no seq used


# -- what counts as a refusal of the data itself -------------------------------------


def _wrapped(exc: BaseException) -> BaseException:
    """``exc`` as the cause of another error, as Faust's ProducerSendError wraps."""
    try:
        try:
            raise exc
        except BaseException as inner:
            raise RuntimeError("send failed") from inner
    except RuntimeError as outer:
        return outer


@pytest.mark.parametrize(
    "exc, name",
    [
        (psycopg.errors.NumericValueOutOfRange("integer out of range"), "NumericValueOutOfRange"),
        (psycopg.DataError("PostgreSQL text fields cannot contain NUL (0x00) bytes"), "DataError"),
        (
            sqlalchemy.exc.DataError("INSERT", {}, psycopg.DataError("bad value")),
            "DataError",
        ),
        (UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates not allowed"), "UnicodeEncode"),
        (MessageSizeTooLargeError("2000100 bytes"), "MessageSizeTooLargeError"),
        (_wrapped(MessageSizeTooLargeError("too large")), "MessageSizeTooLargeError"),
    ],
)
def test_data_errors_and_record_refusals_are_refusals_naming_their_type(
    exc: BaseException, name: str
) -> None:
    found = refusal(exc)
    assert found is not None and found.startswith(name)


@pytest.mark.parametrize(
    "exc",
    [
        psycopg.OperationalError("the connection was lost"),
        KafkaConnectionError("broker down"),
        ConnectionResetError("reset"),
        _wrapped(TimeoutError("no answer")),
    ],
)
def test_an_outage_is_no_refusal(exc: BaseException) -> None:
    assert refusal(exc) is None


# -- the executor over in-memory ports -----------------------------------------------


def record(run_id: str, user_id: str = "u") -> Record:
    value = RunRequested(run_id, user_id, "s", "2026-01-01T00:00:00Z").encode()
    return Record(TOPIC, 0, 7, user_id.encode(), value, headers_for(RUN_REQUESTED))


class World:
    def __init__(
        self,
        handler: ScriptedHandler,
        *,
        store: FakeStore | None = None,
        out: FakeOutput | None = None,
        **settings: Any,
    ) -> None:
        self.store = store or FakeStore()
        self.out = out or FakeOutput(self.store)
        self.handler = handler
        config = replace(SETTINGS, **settings)
        writer = GroupWriter(self.store, fault=config.test_fault)
        self.executor = RunExecutor(config, self.store, self.out, handler, writer)
        self.fence = self.store.own(0)
        # The marks that a run is whole on the chunk topic, as the executor asks for them.
        self.marks: list[tuple[str, int]] = []
        self.executor.writer.published = lambda run_id, seq: self.marks.append((run_id, seq))  # type: ignore[method-assign]

    async def run(self, run_id: str) -> None:
        try:
            await self.executor.process(record(run_id), self.fence, CancelToken())
        finally:
            await self.executor.writer.close()

    def seqs(self, run_id: str) -> list[int]:
        return sorted(self.store.messages_of[run_id])


async def _forever() -> None:
    await asyncio.Event().wait()


async def test_an_attempt_past_its_deadline_ends_the_run_failed_saying_deadline() -> None:
    w = World(ScriptedHandler(["a", "b", _forever]), max_run_s=1.0)
    w.store.add("r1")
    await w.run("r1")
    row = w.store.runs["r1"]
    assert (row.status, row.attempt) == (RunStatus.FAILED, 1)
    assert row.error is not None and row.error.startswith("deadline:"), row.error
    assert "KODA_MAX_RUN_S" in row.error
    assert w.store.kinds("r1") == ["chunk", "chunk", "error"]
    assert w.out.letters() == []  # a limit is no poison record


async def test_output_past_the_cap_ends_the_run_failed_keeping_what_came_before() -> None:
    w = World(ScriptedHandler(["x" * 600, "y" * 300, "z" * 600, "never"]), max_output_bytes=1024)
    w.store.add("r1")
    await w.run("r1")
    row = w.store.runs["r1"]
    assert (row.status, row.attempt) == (RunStatus.FAILED, 1)
    assert row.error is not None and row.error.startswith("output_bytes:"), row.error
    assert "1500 bytes" in row.error and "1024" in row.error
    contents = [c.content for c in (await w.store.messages("r1")) if c.kind is ChunkKind.CHUNK]
    assert contents == ["x" * 600, "y" * 300]


async def test_dirty_output_is_stored_clean_and_an_oversize_chunk_split() -> None:
    big = "é" * MAX_CHUNK_BYTES  # two bytes each: two chunks
    w = World(ScriptedHandler(["a\x00b", "c\ud800", big, Usage("m\x00odel", 1, 2)]))
    w.store.add("r1")
    await w.run("r1")
    row = w.store.runs["r1"]
    assert row.status is RunStatus.DONE
    chunks = [c for c in await w.store.messages("r1") if c.kind is ChunkKind.CHUNK]
    assert "".join(c.content for c in chunks) == "a\ufffdbc\ufffd" + big
    assert [len(c.content.encode()) for c in chunks[2:]] == [MAX_CHUNK_BYTES] * 2
    assert w.seqs("r1") == list(range(5))
    assert [c.usage.model for c in w.store.ledger.values()] == ["m\ufffdodel"]
    assert w.marks == [("r1", 4)]


async def test_a_batch_postgres_refuses_fails_the_run_at_once_seqs_gap_free() -> None:
    store = FakeStore()

    async def refuse_next() -> None:  # once "a" is stored
        await loop_until(lambda: store.messages_of["r1"])
        store.fail_next_group = psycopg.errors.NumericValueOutOfRange("integer out of range")

    w = World(ScriptedHandler(["a", refuse_next, "b", "c", _forever]), store=store)
    store.add("r1")
    await w.run("r1")
    row = store.runs["r1"]
    assert (row.status, row.attempt, row.failures) == (RunStatus.FAILED, 1, 1)
    assert row.error is not None
    assert row.error.startswith("Postgres refused the run's output: NumericValueOutOfRange")
    assert store.kinds("r1") == ["chunk", "error"]  # "b" was refused, its seq reused
    assert w.seqs("r1") == [0, 1]


async def test_a_finish_postgres_refuses_ends_the_run_failed_not_rerun() -> None:
    store = FakeStore()

    async def refuse_next() -> None:  # once "a" is stored: the next group is the finish
        await loop_until(lambda: store.messages_of["r1"])
        store.fail_next_group = psycopg.DataError("PostgreSQL text fields cannot contain NUL")

    w = World(ScriptedHandler(["a", refuse_next, Usage("m", 1, 1)]), store=store)
    store.add("r1")
    await w.run("r1")
    row = store.runs["r1"]
    assert (row.status, row.attempt) == (RunStatus.FAILED, 1)
    assert row.error is not None and "refused the run's finish: DataError" in row.error
    assert store.kinds("r1") == ["chunk", "error"] and w.seqs("r1") == [0, 1]


class RefusingOutput(FakeOutput):
    """Refuses any chunk holding ``TOO_BIG``, as the producer refuses a record over its
    request size."""

    TOO_BIG = "<too big>"

    async def chunks(self, partition: int, chunks: Sequence[Chunk]) -> list[asyncio.Future[Any]]:
        if any(self.TOO_BIG in c.content for c in chunks):
            raise MessageSizeTooLargeError("the message is 2000100 bytes when serialized")
        return await super().chunks(partition, chunks)


async def test_a_batch_kafka_refuses_fails_the_run_and_it_is_never_marked_whole() -> None:
    store = FakeStore()
    w = World(
        ScriptedHandler(["a", RefusingOutput.TOO_BIG, "c"]),
        store=store,
        out=RefusingOutput(store),
    )
    store.add("r1")
    await w.run("r1")
    row = store.runs["r1"]
    assert (row.status, row.attempt) == (RunStatus.FAILED, 1)
    assert row.error is not None
    assert row.error.startswith("Kafka refused the run's output: MessageSizeTooLargeError")
    # A completeness pass would find its hole; the worker never says the topic has it all.
    assert w.marks == []
    assert w.out.of("r1")[-2:] == ["error", "transition:failed"]


async def test_a_run_given_up_at_its_claim_sends_nothing_again() -> None:
    store = FakeStore()
    bound = claim_bound(SETTINGS.max_attempts)
    store.add("r1", status=RunStatus.STREAMING, attempt=bound, fence=0)
    store.messages_of["r1"][0] = Chunk("r1", 0, ChunkKind.CHUNK, "old", bound)
    w = World(ScriptedHandler(["never"]), store=store)
    await w.run("r1")
    row = store.runs["r1"]
    assert row.status is RunStatus.FAILED
    assert row.error is not None and f"claimed {bound} times" in row.error
    # The earlier message was not produced again: only the error event of this claim.
    assert [k for k in w.out.of("r1") if not k.startswith("transition")] == ["error"]
    assert w.marks == []  # the completeness pass's to finish
    assert w.handler.contexts == []  # the handler never ran


class BudgetStore(FakeStore):
    """Says the user's day budget is spent as soon as a batch carries a ledger row."""

    async def write_group(self, writes: Sequence[GroupWrite]) -> list[GroupResult]:
        results = await super().write_group(writes)
        spent = Exceeded(Period.DAY, Decimal("0.001"), Decimal("0.001"), datetime.now(UTC))
        return [
            Batched(r, r.ledger, spent) if isinstance(r, Batched) and r.ledger else r
            for r in results
        ]


async def test_a_call_that_spends_the_budget_stops_the_run_after_it() -> None:
    store = BudgetStore()
    w = World(
        ScriptedHandler(["a", Usage("m", 10, 1), ToolActivity('{"call": 1}'), _forever]),
        store=store,
    )
    store.add("r1")
    await w.run("r1")
    row = store.runs["r1"]
    assert (row.status, row.attempt) == (RunStatus.FAILED, 1)
    assert row.error is not None and row.error.startswith("budget_exceeded: the user's day budget")
    assert [(c.call_index, c.usage.model) for c in store.ledger.values()] == [(0, "m")]


async def test_the_run_context_carries_the_output_token_limit() -> None:
    w = World(ScriptedHandler(["a"]), max_output_tokens=123)
    w.store.add("r1")
    await w.run("r1")
    assert [c.max_output_tokens for c in w.handler.contexts] == [123]
    off = World(ScriptedHandler(["a"]), max_output_tokens=0)
    off.store.add("r2")
    await off.run("r2")
    assert [c.max_output_tokens for c in off.handler.contexts] == [None]
