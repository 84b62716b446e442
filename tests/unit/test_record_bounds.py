"""Bad records meet bounds, never loops: the decoders raise RecordError only (nesting,
sizes, encodings), a dead letter always fits the producer (key, headers and value cut,
their sizes kept), the emitter falls back to a bare letter and then skips, the executor
dead-letters a record that keeps failing before its claim after its tries, and the
chunk-log fold and the gateway's live feed pass over bad chunk records.

The same records on the real broker and Postgres: tests/integration/test_record_bounds.py.
"""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import pytest
from aiokafka.errors import KafkaConnectionError, KafkaTimeoutError, MessageSizeTooLargeError
from faust.exceptions import ProducerSendError

from koda_runtime.errors import RecordError
from koda_runtime.lifecycle.handler import CancelToken
from koda_runtime.lifecycle.states import RunStatus
from koda_runtime.metrics import DEAD_LETTERS, RECORDS_SKIPPED
from koda_runtime.naming import AppEnv
from koda_runtime.processors.emitter import Emitter, refused
from koda_runtime.processors.groupcommit import GroupWriter
from koda_runtime.processors.runner import Record, RecordTries, RunExecutor
from koda_runtime.settings import Settings
from koda_runtime.topics.chunklog import ChunkLog
from koda_runtime.topics.records.codec import (
    DEAD_LETTER_MAX_BYTES,
    MAX_DEAD_LETTER_HEADERS,
    MAX_DEAD_LETTER_KEY,
    MAX_DEAD_LETTER_ORIGINAL,
    MAX_JSON_DEPTH,
    MAX_RUN_HEADERS_BYTES,
    MAX_RUN_KEY_BYTES,
    RUN_CHUNK,
    RUN_REQUESTED,
    RunRequested,
    chunk_value,
    dead_letter_key,
    dead_letter_value,
    decode_chunk_value,
    decode_final_value,
    decode_keyed_chunk,
    decode_run_requested,
    headers_for,
    json_depth_exceeds,
)
from koda_runtime.topics.records.dead_letters import decode_dead_letter
from tests.unit.worker_fakes import TOPIC, FakeOutput, FakeStore, ScriptedHandler

USER = b"alice"
GOOD = RunRequested("r1", "alice", "s", "").encode()
HEADERS = headers_for(RUN_REQUESTED)


def nested(depth: int) -> bytes:
    """A JSON object whose one field nests ``depth`` arrays (the reviewer's 10 KB value)."""
    return b'{"run_id":"r1","user_id":"alice","session_id":"s","x":' + (
        b"[" * depth + b"]" * depth + b"}"
    )


# --- the decoders ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "value", "headers", "reason"),
    [
        pytest.param(USER, nested(5000), HEADERS, "too_deep", id="nested 5,000 deep"),
        pytest.param(USER, b"[" * 5000, HEADERS, "too_deep", id="5,000 openers, unclosed"),
        pytest.param(USER, nested(MAX_JSON_DEPTH), HEADERS, "too_deep", id="one level over"),
        pytest.param(USER, b"\xff\xfe{}", HEADERS, "undecodable", id="not UTF-8"),
        pytest.param(USER, b"\xed\xa0\x80", HEADERS, "undecodable", id="a lone surrogate"),
        pytest.param(USER, b"{\"a\": 1" + b"2" * 5000 + b"}", HEADERS, "undecodable", id="digits"),
        pytest.param(USER, b"NaN-ish {", HEADERS, "undecodable", id="not JSON"),
        pytest.param(USER, b'"a string"', HEADERS, "invalid", id="not an object"),
        pytest.param(b"k" * 900_000, GOOD, HEADERS, "oversized_key", id="a 900 KB key"),
        pytest.param(
            USER,
            GOOD,
            [(f"h{i}", b"v" * 20_000) for i in range(50)],
            "oversized_headers",
            id="50 headers of 20 KB",
        ),
        pytest.param(USER, GOOD, [("schema",)], "undecodable", id="a header with no value"),
        pytest.param(USER, GOOD, [("schema", b"\xff\xfe")], "unknown_schema", id="binary schema"),
    ],
)  # fmt: skip
def test_every_bad_runs_record_is_a_record_error_with_its_reason(
    key: bytes, value: bytes, headers: Any, reason: str
) -> None:
    with pytest.raises(RecordError) as caught:
        decode_run_requested(key, value, headers)
    assert caught.value.reason == reason, caught.value
    assert caught.value.detail


def test_what_is_within_the_bounds_still_decodes() -> None:
    deep_ok = nested(MAX_JSON_DEPTH - 1)  # the object itself is one level
    assert decode_run_requested(USER, deep_ok, HEADERS).run_id == "r1"
    # Brackets inside strings are text, not nesting.
    text = json.dumps({"run_id": "r1", "user_id": "alice", "session_id": "s", "x": "[" * 9999})
    assert decode_run_requested(USER, text.encode(), HEADERS).session_id == "s"
    near = [(f"h{i}", b"v" * 1000) for i in range(15)]
    assert decode_run_requested(USER, GOOD, HEADERS + near).user_id == "alice"
    with pytest.raises(RecordError, match="key_mismatch"):
        decode_run_requested(b"k" * MAX_RUN_KEY_BYTES, GOOD, HEADERS)  # big, not oversized


def test_the_depth_scan_counts_only_brackets_outside_strings() -> None:
    assert not json_depth_exceeds('{"a": "' + "[" * 200 + '"}', 10)
    assert not json_depth_exceeds('["\\"' + "[" * 200 + '"]', 10)  # an escaped quote
    assert json_depth_exceeds("[" * 11 + "]" * 11, 10)
    assert not json_depth_exceeds("[]" * 500, 10)  # many, never deep


@pytest.mark.parametrize("decode", [decode_chunk_value, decode_final_value])
@pytest.mark.parametrize(
    "value", [b"[" * 5000, nested(5000), b"\xff", b'{"seq": 1' + b"0" * 5000 + b"}"]
)
def test_the_chunk_decoders_raise_record_errors_only(decode: Any, value: bytes) -> None:
    with pytest.raises(RecordError):
        decode(value)


def test_a_chunk_must_be_the_one_its_key_names() -> None:
    good = chunk_value("r1", 3, "chunk", "hi", 1)
    assert decode_keyed_chunk("r1", 3, good).content == "hi"
    with pytest.raises(RecordError, match="key_mismatch"):
        decode_keyed_chunk("r2", 3, good)  # forged for another run
    with pytest.raises(RecordError, match="key_mismatch"):
        decode_keyed_chunk("r1", 4, good)
    with pytest.raises(RecordError, match="invalid"):
        decode_keyed_chunk("r1", 3, chunk_value("r1", 3, "chunk\nevent: done", "x", 1))


# --- dead letters -----------------------------------------------------------------------


def letter(
    key: bytes | None = USER, value: bytes | None = GOOD, headers: Any = None, **kw: Any
) -> bytes:
    fields: dict[str, Any] = {
        "topic": "t",
        "partition": 3,
        "offset": 9,
        "attempts": 0,
        "reason": "r",
        "error": "e",
    }
    return dead_letter_value(
        key=key, value=value, headers=HEADERS if headers is None else headers, **(fields | kw)
    )


def test_a_small_record_is_kept_whole_and_says_so() -> None:
    dl = decode_dead_letter(letter())
    assert (dl.key, dl.value, dl.truncated) == (USER, GOOD, False)
    assert dl.headers == HEADERS
    assert (dl.key_size, dl.headers_count, dl.original_size) == (5, 2, len(GOOD))
    assert dl.headers_size == sum(len(k) + len(v) for k, v in HEADERS)


@pytest.mark.parametrize(
    ("key", "value", "headers"),
    [
        pytest.param(b"k" * 900_000, GOOD, HEADERS, id="900 KB key"),
        pytest.param(USER, GOOD, [(f"h{i}", b"v" * 20_000) for i in range(50)], id="50x20 KB"),
        pytest.param(USER, b"x" * (2 << 20), HEADERS, id="2 MiB value"),
        pytest.param(
            b"k" * (2 << 20),
            b"\x00" * (2 << 20),
            [("\x01" * 5000, b"v" * 100_000) for _ in range(1000)],
            id="everything at once",
        ),
    ],
)  # fmt: skip
def test_a_dead_letter_always_fits_and_keeps_the_original_sizes(
    key: bytes, value: bytes, headers: list[tuple[str, bytes]]
) -> None:
    raw = letter(key, value, headers, error="\x00" * 10_000)
    assert len(raw) + len(dead_letter_key(key) or b"") <= DEAD_LETTER_MAX_BYTES
    dl = decode_dead_letter(raw)
    assert dl.truncated
    assert dl.key_size == len(key) and dl.original_size == len(value)
    assert dl.headers_count == len(headers)
    assert dl.headers_size == sum(len(k.encode()) + len(v) for k, v in headers)
    assert dl.key == key[:MAX_DEAD_LETTER_KEY] and dl.value == value[:MAX_DEAD_LETTER_ORIGINAL]
    kept = sum(len(k.encode()) + len(v or b"") for k, v in dl.headers)
    assert kept <= MAX_DEAD_LETTER_HEADERS
    assert len(dl.error) == 2000


def test_a_bare_letter_keeps_no_original_bytes_but_their_sizes() -> None:
    dl = decode_dead_letter(letter(value=b"x" * 100, bare=True))
    assert (dl.value, dl.headers, dl.truncated) == (None, [], True)
    assert (dl.original_size, dl.headers_count, dl.key) == (100, 2, USER)


# --- the emitter: refused letters ---------------------------------------------------------


class Broker:
    """A fake ``producer.send``: refuses letters over ``limit`` bytes, the way ``fail``
    says (raised at send, or on the delivery future)."""

    def __init__(self, limit: int, fail: str = "send", error: type[Exception] | None = None):
        self.limit = limit
        self.fail = fail
        self.error = error
        self.sent: list[bytes] = []

    async def __call__(self, **record: Any) -> Any:
        import asyncio

        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        if self.error is not None:
            raise self.error("no broker")
        if len(record["value"]) > self.limit:
            exc = MessageSizeTooLargeError("too large")
            if self.fail == "send":
                raise ProducerSendError(f"Error while sending: {exc!r}") from exc
            fut.set_exception(exc)
            return fut
        self.sent.append(record["value"])
        fut.set_result(None)
        return fut


def emitter(broker: Broker) -> Emitter:
    return Emitter(Settings(app_env=AppEnv.DEV), broker)


def big_record() -> Record:
    return Record(TOPIC, 4, 11, USER, b"x" * 300_000, HEADERS)


def counted(metric: Any, reason: str) -> float:
    return float(metric.labels(reason=reason)._value.get())


@pytest.mark.parametrize("fail", ["send", "future"])
async def test_a_refused_letter_is_sent_again_bare(fail: str) -> None:
    broker = Broker(limit=10_000, fail=fail)
    before = counted(DEAD_LETTERS, "bounds-bare")
    await emitter(broker).dead_letter(big_record(), attempts=0, reason="bounds-bare", error="e")
    (sent,) = broker.sent
    dl = decode_dead_letter(sent)
    assert dl.value is None and dl.original_size == 300_000 and dl.reason == "bounds-bare"
    assert counted(DEAD_LETTERS, "bounds-bare") == before + 1


async def test_a_letter_refused_even_bare_is_skipped_logged_and_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    broker = Broker(limit=10)
    before = counted(RECORDS_SKIPPED, "dead_letter_refused")
    await emitter(broker).dead_letter(big_record(), attempts=0, reason="r", error="e")
    assert broker.sent == []
    assert counted(RECORDS_SKIPPED, "dead_letter_refused") == before + 1
    skipped = [r for r in caplog.records if "event=record_skipped" in r.getMessage()]
    assert len(skipped) == 1 and "partition=4 offset=11" in skipped[0].getMessage()


@pytest.mark.parametrize("error", [KafkaTimeoutError, KafkaConnectionError, ConnectionError])
async def test_an_unreachable_broker_is_not_a_refusal(error: type[Exception]) -> None:
    broker = Broker(limit=10**9, error=error)
    before = counted(RECORDS_SKIPPED, "dead_letter_refused")
    with pytest.raises(error):
        await emitter(broker).dead_letter(big_record(), attempts=0, reason="r", error="e")
    assert counted(RECORDS_SKIPPED, "dead_letter_refused") == before
    assert not refused(ProducerSendError("x"))
    assert not refused(OSError(10, "errno 10 is not a Kafka error code"))


# --- the executor: failures before the claim --------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def rec(offset: int = 7) -> Record:
    return Record(TOPIC, 0, offset, USER, GOOD, HEADERS)


def test_tries_count_only_with_growing_spacing() -> None:
    clock = Clock()
    tries = RecordTries(5, spacing_s=8.0, clock=clock)
    # A burst of failures within seconds is one try, however many.
    for _ in range(100):
        assert tries.failed(rec()) is None
        clock.now += 0.05
    # The tries count at 8, 16, 32 and 64 s apart: 120 s after the first failure.
    for gap in (8, 16, 32):
        clock.now += gap
        assert tries.failed(rec()) is None
    clock.now += 63
    assert tries.failed(rec()) is None
    clock.now += 1
    tally = tries.failed(rec())
    assert tally is not None and tally.tries == 5 and tally.failures == 105
    assert tally.last - tally.first >= 120
    assert tries.failed(rec()) is tally  # stays due until forgotten
    tries.forget(rec())
    assert tries.failed(rec()) is None and len(tries) == 1
    assert tries.failed(rec(8)) is None and len(tries) == 2  # per record


def test_one_try_dead_letters_at_the_first_failure() -> None:
    assert RecordTries(1, clock=Clock()).failed(rec()) is not None


SETTINGS = Settings(
    app_env=AppEnv.DEV,
    max_attempts=2,
    retry_base_s=0.001,
    chunk_batch_ms=0,
    worker_id="w-unit",
    record_tries=3,
)


@pytest.fixture
async def world() -> AsyncIterator[tuple[RunExecutor, FakeStore, FakeOutput, Clock]]:
    store = FakeStore()
    out = FakeOutput(store)
    writer = GroupWriter(store, fault=SETTINGS.test_fault)
    executor = RunExecutor(SETTINGS, store, out, ScriptedHandler(["a"], ["b"]), writer)
    clock = Clock()
    executor.tries = RecordTries(SETTINGS.record_tries, spacing_s=8.0, clock=clock)
    yield executor, store, out, clock
    await executor.writer.close()


async def test_a_record_failing_before_its_claim_is_dead_lettered_after_its_tries(
    world: tuple[RunExecutor, FakeStore, FakeOutput, Clock],
) -> None:
    executor, store, out, clock = world
    store.add("r1", "alice")

    async def lost(run_id: str) -> None:
        raise ConnectionResetError("the database went away")

    store.load_run = lost  # type: ignore[method-assign]
    fence = store.own(0)
    for step in (0.0, 8.0):  # tries 1 and 2: raised for the chain to retry
        clock.now += step
        with pytest.raises(ConnectionResetError):
            await executor.process(rec(), fence, CancelToken())
    assert out.letters() == []
    clock.now += 16.0
    await executor.process(rec(), fence, CancelToken())  # the third try: dead letter, ack
    (dl,) = out.letters()
    assert (dl["reason"], dl["attempts"], dl["offset"]) == ("failed_before_claim", 0, 7)
    assert "3 tries counted" in dl["error"]
    assert "ConnectionResetError: the database went away" in dl["error"]
    assert len(executor.tries) == 0
    assert store.runs["r1"].status is RunStatus.PENDING  # never claimed, never run


async def test_an_outage_of_seconds_dead_letters_nothing(
    world: tuple[RunExecutor, FakeStore, FakeOutput, Clock],
) -> None:
    executor, store, out, clock = world
    store.add("r1", "alice")
    real = store.load_run

    async def lost(run_id: str) -> None:
        raise ConnectionResetError("the database went away")

    store.load_run = lost  # type: ignore[method-assign]
    fence = store.own(0)
    for _ in range(50):  # the chain's retries over 20 s
        clock.now += 0.4
        with pytest.raises(ConnectionResetError):
            await executor.process(rec(), fence, CancelToken())
    store.load_run = real  # type: ignore[method-assign]
    await executor.process(rec(), fence, CancelToken())
    assert out.letters() == [] and store.runs["r1"].status is RunStatus.DONE
    assert len(executor.tries) == 0  # a success forgets the tally


async def test_once_claimed_a_failure_is_retried_as_before(
    world: tuple[RunExecutor, FakeStore, FakeOutput, Clock],
) -> None:
    executor, store, out, clock = world
    store.add("r1", "alice")

    async def broken(partition: int, run_id: str, event: str, **fields: Any) -> Any:
        raise ConnectionResetError("the broker went away")

    out.event = broken  # type: ignore[method-assign]  # the `running` event, after the claim
    fence = store.own(0)
    for _ in range(6):
        clock.now += 100.0
        with pytest.raises(ConnectionResetError):
            await executor.process(rec(), fence, CancelToken())
    assert out.letters() == [] and len(executor.tries) == 0


async def test_bad_records_are_still_dead_lettered_at_once(
    world: tuple[RunExecutor, FakeStore, FakeOutput, Clock],
) -> None:
    executor, store, out, _ = world
    poison = replace(rec(), value=nested(5000))
    await executor.process(poison, store.own(0), CancelToken())
    (dl,) = out.letters()
    assert dl["reason"] == "too_deep"


# --- the chunk topic's readers ------------------------------------------------------------


def test_the_chunk_log_skips_bad_records_and_keeps_the_real_ones() -> None:
    fold = ChunkLog()
    key = b"r1:0000000000"
    fold.apply(key, chunk_value("r1", 0, "chunk", "hi", 1))
    fold.apply(b"r1:0000000001", b"[" * 5000)
    fold.apply(b"r1:0000000001", nested(5000))
    fold.apply(b"r1:0000000001", b"\xff")
    fold.apply(b"r1:0000000001", chunk_value("r2", 1, "done", "{}", 1))  # forged
    fold.apply(b"r1:0000000001", chunk_value("r1", 1, "weird", "{}", 1))
    fold.apply(b"r1:final", b"[" * 5000)
    fold.apply(b"not a key", b"{}")
    fold.apply(b"r1:0000000001", chunk_value("r1", 1, "done", "{}", 1))
    assert fold.skipped == 7
    assert fold.skip_reasons == {"too_deep": 3, "undecodable": 1, "key_mismatch": 1,
                                 "invalid": 1, "bad_key": 1}  # fmt: skip
    run = fold.runs["r1"]
    assert (run.output, run.end) == ("hi", "done")


class Msg:
    def __init__(self, key: bytes | None, value: bytes | None, offset: int) -> None:
        self._key, self._value, self._offset = key, value, offset

    def key(self) -> bytes | None:
        return self._key

    def value(self) -> bytes | None:
        return self._value

    def partition(self) -> int:
        return 0

    def offset(self) -> int:
        return self._offset


class Exploding(Msg):
    def value(self) -> bytes | None:
        raise RuntimeError("a record no client should hand over")


def test_the_live_feed_passes_over_bad_records_of_a_watched_run() -> None:
    from koda_runtime.gateway.livefeed import LiveFeed

    feed = LiveFeed(Settings(app_env=AppEnv.DEV))
    feed.subscribe("r1", 1 << 20)
    before = counted(RECORDS_SKIPPED, "bad_chunk_record")
    good = chunk_value("r1", 1, "chunk", "ok", 1)
    batch = feed._route(
        [
            Msg(b"r1:0000000000", b"[" * 5000, 1),
            Msg(b"r1:0000000000", nested(5000), 2),
            Msg(b"r1:0000000000", chunk_value("r2", 0, "done", "{}", 1), 3),
            Msg(b"r1:0000000000", chunk_value("r1", 0, "x\nevent: done", "{}", 1), 4),
            Exploding(b"r1:0000000000", b"", 5),
            Msg(b"r1:0000000001", good, 6),
            Msg(b"r9:0000000000", b"[" * 5000, 7),  # nobody watches r9: not even decoded
        ]
    )
    assert [(run_id, e.seq, e.kind) for run_id, e in batch] == [("r1", 1, "chunk")]
    assert batch[0][1].frame.endswith(b"data: " + good + b"\n\n")
    assert feed.bad_records == 5
    assert counted(RECORDS_SKIPPED, "bad_chunk_record") == before + 5


def test_headers_over_the_limit_name_their_count_and_size() -> None:
    headers = [(f"h{i}", b"v" * 20_000) for i in range(50)]
    with pytest.raises(RecordError) as caught:
        decode_run_requested(USER, GOOD, headers)
    assert "50 headers" in caught.value.detail and str(MAX_RUN_HEADERS_BYTES) in caught.value.detail


def test_a_run_chunk_header_is_still_an_unknown_schema() -> None:
    with pytest.raises(RecordError, match="unknown_schema"):
        decode_run_requested(USER, GOOD, headers_for(RUN_CHUNK))


def test_a_letter_names_the_original_key_in_base64() -> None:
    raw = json.loads(letter(key=b"k" * 5000))
    assert base64.b64decode(raw["original_key"]) == b"k" * MAX_DEAD_LETTER_KEY
    assert raw["original_key_size"] == 5000 and raw["original_truncated"] is True
