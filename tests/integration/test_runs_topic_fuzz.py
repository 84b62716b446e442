"""Generated records on the runs topic: none stalls a partition, each bad one is one dead
letter with its reason.

Hypothesis draws batches of records and each batch goes straight onto the runs
partition of a known user (the partition koda's partitioner gives the user's key,
whatever key the record itself carries), through every compression codec:

* values: random bytes and text, JSON of wrong shapes and types, other koda records,
  nesting past and within :data:`MAX_JSON_DEPTH`, wrong schema versions and names, huge
  strings up to the topic's ``max.message.bytes`` (read from the broker), invalid
  UTF-8, UTF-16 and UTF-32, byte order marks, NUL and lone surrogates in ids, no value;
* keys: none, empty, binary, another user's, huge;
* headers: none, many, large, binary, a ``schema`` header that is wrong, empty or null.

Each record carries the reasons it may be dead-lettered for (its faults; a record
without any is a valid trigger of an unknown run, or of a run already done, which
must leave no letter at all). After each batch the user submits a normal run, which
must reach ``done`` within 30 s; once the workers' committed offset has passed it
(every record before it has ended), each record must have exactly one dead letter
with one of its reasons, its original sizes and a prefix of its bytes, and no other
letter may appear. The worker must never retry a record in place, skip one or crash.

Shrinking is off (each example costs a real run); a failure prints the batch and a
``@reproduce_failure`` blob that replays it.
"""

from __future__ import annotations

import hashlib
import json
import random
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    Producer,
    TopicPartition,
)
from confluent_kafka.admin import ConfigResource, ResourceType  # type: ignore[attr-defined]
from hypothesis import HealthCheck, Phase, example, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from koda_runtime.kafka import consumer_config, producer_config
from koda_runtime.settings import Settings
from koda_runtime.topics.admin import admin_client
from koda_runtime.topics.catalogue import RUNS, RUNS_DLQ, WORKER_GROUP
from koda_runtime.topics.records.codec import (
    DEAD_LETTER_MAX_BYTES,
    MAX_JSON_DEPTH,
    MAX_RUN_HEADERS_BYTES,
    MAX_RUN_KEY_BYTES,
    MAX_RUN_RECORD_BYTES,
    RUN_CHUNK,
    RUN_REQUESTED,
    FinalRecord,
    RunRequested,
    chunk_value,
    dead_letter_value,
    event_value,
    headers_for,
)
from koda_runtime.topics.records.dead_letters import DeadLetter, decode_dead_letter
from tests.fixtures.processes import WorkerProcess
from tests.fixtures.runs import Submitter, committed_offsets, users_by_partition
from tests.support import wait_until

FAST = {"text": "after the batch", "demo": {"tokens": 2, "delay_ms": 1}}
# What a record batch adds to its records on the wire (batch header, varints, a few
# bytes per header): a record's key, value and headers stay this far under the limit.
FRAMING = 16 * 1024
CODECS = ("none", "gzip", "snappy", "lz4", "zstd")
RUN_S = 30.0  # a normal run after a batch must be done within this
BATCHES = 24  # generated batches, besides the explicit one

Headers = Sequence[tuple[str, bytes | None]] | None


def _size(data: bytes | None) -> str:
    return "none" if data is None else f"{len(data)}B"


@dataclass(frozen=True)
class Fuzzed:
    """One generated runs-topic record and what it may be dead-lettered for."""

    what: str
    key: bytes | None
    value: bytes | None
    headers: Headers
    faults: frozenset[str] = frozenset()  # empty: a valid trigger
    finished: bool = False  # the trigger of a run already done: no letter at all
    codec: str = "lz4"

    @property
    def reasons(self) -> frozenset[str]:
        """The reasons its one dead letter may carry; empty: it must have none."""
        if self.faults:
            return self.faults
        return frozenset() if self.finished else frozenset({"unknown_run"})

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self))  # how Hypothesis prints it: sizes, not megabytes

    def __repr__(self) -> str:
        hs = "none" if self.headers is None else f"{len(self.headers)}"
        head = (self.value or b"")[:40]
        return (
            f"Fuzzed({self.what}; key={_size(self.key)} value={_size(self.value)} {head!r}"
            f" headers={hs} codec={self.codec} reasons={sorted(self.reasons)})"
        )


def headers_bytes(headers: Headers) -> int:
    return sum(len(n.encode()) + len(v or b"") for n, v in headers or [])


def filled(size: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(size)  # noqa: S311 - test data


def fresh(draw: st.DrawFn) -> str:
    """A run id no run has."""
    return f"fuzz-{draw(st.uuids()).hex}"


def trigger(user: str, run_id: str) -> dict[str, Any]:
    return {"run_id": run_id, "user_id": user, "session_id": f"s-{user}", "created_at": ""}


def dumps(obj: Any) -> bytes:
    try:
        return json.dumps(obj, ensure_ascii=False).encode()
    except UnicodeEncodeError:  # a lone surrogate: only an escape can carry it
        return json.dumps(obj).encode()


# --- values -------------------------------------------------------------------------

UNDECODABLE = frozenset({"undecodable", "invalid", "too_deep"})
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
wrong_types = json_values.filter(lambda v: v is not None and not isinstance(v, str))
odd_ids = st.text(min_size=1, max_size=200) | st.sampled_from(
    ["\x00", "a\x00b", "\ud800", "x\udfff", "\U0001f600" * 200, " ", "\u202e"]
)
BAD_UTF8 = [b"\xff", b"\xc0\x80", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xe2\x82", b"\x80"]
ENCODINGS = ["utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-8-sig", "latin-1"]


VALUE_KINDS = [
    "valid",
    "finished",
    "odd_run_id",
    "bytes",
    "text",
    "json",
    "missing_field",
    "wrong_type",
    "bad_length",
    "other_record",
    "deep",
    "shallow",
    "huge",
    "encoding",
    "bad_utf8",
    "null",
    "empty",
]
# Characters a JSON string holds as they are (no escape changes the size).
pad_chars = st.characters(codec="utf-8", exclude_categories=("Cc", "Cs"), exclude_characters='"\\')


def oversize(faults: set[str], value: bytes) -> frozenset[str]:
    """``faults``, and ``oversized`` when ``value`` is over the worker's limit."""
    return frozenset(faults | ({"oversized"} if len(value) > MAX_RUN_RECORD_BYTES else set()))


@st.composite
def values(
    draw: st.DrawFn, user: str, finished: str, budget: int
) -> tuple[str, bytes | None, frozenset[str], bool]:
    """``(what, value, faults, finished)`` of a value at most ``budget`` bytes long."""
    kind = draw(st.sampled_from(VALUE_KINDS))
    run_id = fresh(draw)
    valid = dumps(trigger(user, run_id))
    if kind == "valid":
        return kind, valid, frozenset(), False
    if kind == "finished":
        return kind, RunRequested(finished, user, f"s-{user}", "").encode(), frozenset(), True
    if kind == "odd_run_id":  # NUL, lone surrogates, astral characters: no such run
        return kind, dumps(trigger(user, draw(odd_ids))), frozenset(), False
    if kind == "bytes":
        return kind, draw(st.binary(max_size=600)), UNDECODABLE, False
    if kind == "text":
        return kind, draw(st.text(max_size=300)).encode(), UNDECODABLE, False
    if kind == "json":  # anything but a trigger object
        obj = draw(json_values.filter(lambda v: not isinstance(v, dict) or "run_id" not in v))
        return kind, dumps(obj), frozenset({"invalid"}), False
    if kind == "missing_field":
        obj = trigger(user, run_id)
        del obj[draw(st.sampled_from(["run_id", "user_id", "session_id"]))]
        return kind, dumps(obj), frozenset({"invalid"}), False
    if kind == "wrong_type":
        name = draw(st.sampled_from(["run_id", "user_id", "session_id", "schedule_id"]))
        obj = {**trigger(user, run_id), name: draw(wrong_types)}
        return f"{kind} {name}", dumps(obj), frozenset({"invalid"}), False
    if kind == "bad_length":  # an empty id, or one over its 200 characters
        name = draw(st.sampled_from(["run_id", "session_id", "schedule_id"]))
        size = draw(st.sampled_from([0, 201, 5000, MAX_RUN_RECORD_BYTES]))
        value = dumps({**trigger(user, run_id), name: "r" * size})
        return f"{kind} {name} {size}", value, oversize({"invalid"}, value), False
    if kind == "other_record":  # koda's other records, under the run.requested header
        value = draw(st.sampled_from(other_records(user, run_id)))
        return kind, value, frozenset({"invalid"}), False
    if kind == "deep":  # past the depth limit: bare, inside a trigger, or never closed
        depth = draw(st.integers(MAX_JSON_DEPTH + 1, 150_000))
        shape = draw(st.sampled_from(["list", "object", "open", "inside"]))
        value = {
            "list": lambda: b"[" * depth + b"]" * depth,
            "object": lambda: b'{"a":' * depth + b"1" + b"}" * depth,
            "open": lambda: b"[" * depth,
            "inside": lambda: valid[:-1] + b',"x":' + b"[" * depth + b"]" * depth + b"}",
        }[shape]()[:budget]
        return f"{kind} {shape} {depth}", value, oversize({"too_deep"}, value), False
    if kind == "shallow":  # within the limit inside a trigger: a valid record
        depth = draw(st.integers(1, MAX_JSON_DEPTH - 1))
        value = valid[:-1] + b',"x":' + b"[" * depth + b"]" * depth + b"}"
        return f"{kind} {depth}", value, frozenset(), False
    if kind == "huge":  # a long string: under the worker's limit, over it, up to the topic's
        low = MAX_RUN_RECORD_BYTES - 4096
        size = draw(
            st.sampled_from([low, MAX_RUN_RECORD_BYTES + 1, budget]) | st.integers(low, budget)
        )
        chars = draw(st.text(pad_chars, min_size=1, max_size=4))
        head = valid[:-1] + b',"pad":"'
        room = max(0, size - len(head) - 2)
        value = head + (chars * (room // len(chars.encode()))).encode() + b'"}'
        return f"{kind} {len(value)}B", value, oversize(set(), value), False
    if kind == "encoding":
        encoding = draw(st.sampled_from(ENCODINGS))
        obj = {**trigger(user, run_id), "session_id": f"s-{user}-é"}
        text = json.dumps(obj, ensure_ascii=False)
        return f"{kind} {encoding}", text.encode(encoding), frozenset({"undecodable"}), False
    if kind == "bad_utf8":
        bad = draw(st.sampled_from(BAD_UTF8))
        value = valid.replace(b'"s-', b'"s-' + bad, 1)
        return f"{kind} {bad!r}", value, frozenset({"undecodable"}), False
    if kind == "null":
        return kind, None, frozenset({"null_value"}), False
    return kind, b"", frozenset({"undecodable"}), False


def other_records(user: str, run_id: str) -> list[bytes]:
    return [
        chunk_value(run_id, 0, "chunk", "hi", 1),
        event_value(run_id, "transition", to="done", attempt=1),
        FinalRecord(run_id, 1, "done", "{}", "hi", 1).encode(),
        dead_letter_value(
            key=user.encode(),
            value=b"x",
            headers=[],
            topic="t",
            partition=0,
            offset=0,
            attempts=0,
            reason="r",
            error="e",
        ),
    ]


# --- keys and headers -----------------------------------------------------------------

KEY_KINDS = ["user", "none", "empty", "binary", "other", "huge"]
HEADER_KINDS = [
    "standard",
    "none",
    "version",
    "schema",
    "binary_schema",
    "null_schema",
    "many",
    "large",
]
# librdkafka sends a header name as a C string (cut at its first NUL): none here.
header_names = st.text(
    st.characters(codec="utf-8", exclude_characters="\x00"), min_size=1, max_size=20
).filter(lambda n: n != "schema")


@st.composite
def keys(draw: st.DrawFn, user: str, other: str) -> tuple[str, bytes | None, frozenset[str]]:
    own = user.encode()
    kind = draw(st.sampled_from(KEY_KINDS))
    if kind == "user":
        return kind, own, frozenset()
    if kind == "none":
        return kind, None, frozenset({"null_key"})
    if kind == "empty":
        return kind, b"", frozenset({"key_mismatch"})
    if kind == "binary":
        key = draw(st.binary(min_size=1, max_size=MAX_RUN_KEY_BYTES).filter(lambda k: k != own))
        return kind, key, frozenset({"key_mismatch"})
    if kind == "other":
        return kind, other.encode(), frozenset({"key_mismatch"})
    over = MAX_RUN_KEY_BYTES + 1
    size = draw(st.sampled_from([over, 900_000]) | st.integers(over, 900_000))
    return f"huge {size}", filled(size, draw(st.integers(0, 2**32))), frozenset({"oversized_key"})


@st.composite
def header_sets(draw: st.DrawFn, budget: int) -> tuple[str, Headers, frozenset[str]]:
    """``(what, headers, faults)``: headers of at most about ``budget`` bytes."""
    standard: list[tuple[str, bytes | None]] = list(headers_for(RUN_REQUESTED))
    kind = draw(st.sampled_from(HEADER_KINDS))
    if kind == "standard":
        return kind, standard, frozenset()
    if kind == "none":
        return kind, draw(st.sampled_from([None, []])), frozenset()
    if kind == "version":
        version = draw(st.integers(-3, 10**6).map(str) | st.text(max_size=10)).encode()
        schema = b"run.requested/" + (version if version != b"1" else b"2")
        return kind, [("schema", schema)], frozenset({"unknown_schema_version"})
    if kind == "schema":
        name = draw(
            st.sampled_from([RUN_CHUNK, "", "run.requested ", "RUN.REQUESTED"])
            | st.text(max_size=30).filter(lambda n: n.partition("/")[0] != RUN_REQUESTED)
        )
        return kind, [("schema", f"{name}/1".encode())], frozenset({"unknown_schema"})
    if kind == "binary_schema":
        raw = draw(st.binary(max_size=64).filter(lambda b: b != b"run.requested/1"))
        return kind, [("schema", raw)], frozenset({"unknown_schema", "unknown_schema_version"})
    if kind == "null_schema":  # a schema header without a value is no schema header
        return kind, [("schema", None), *standard[1:]], frozenset()
    if kind == "many":
        pairs = st.tuples(header_names, st.none() | st.binary(max_size=60))
        extra = draw(st.lists(pairs, min_size=1, max_size=300))
    else:
        count = draw(st.integers(1, 60))
        size = min(draw(st.integers(1, 64 * 1024)), budget // count)
        seed = draw(st.integers(0, 2**32))
        extra = [(f"h{i}", filled(size, seed + i)) for i in range(count)]
    headers = standard + extra
    size = headers_bytes(headers)
    faults = {"oversized_headers"} if size > MAX_RUN_HEADERS_BYTES else set()
    return f"{kind} {len(headers)} of {size}B", headers, frozenset(faults)


@st.composite
def records(draw: st.DrawFn, user: str, other: str, finished: str, limit: int) -> Fuzzed:
    """One record whose key, value and headers together fit the topic's ``limit``: the
    key first, headers in at most half of what is left, the value in the rest.

    Mostly one part is generated and the others are a trigger's own (the user's key,
    the standard headers), so the letter's reason tells that part's handling; some
    records get all three generated."""
    varied = draw(st.sampled_from(["value", "value", "value", "key", "headers", "all"]))
    if varied in ("key", "all"):
        key_what, key, key_faults = draw(keys(user, other))
    else:
        key_what, key, key_faults = "user", user.encode(), frozenset()
    room = limit - FRAMING - len(key or b"")
    if varied in ("headers", "all"):
        head_what, headers, head_faults = draw(header_sets(room // 2))
    else:
        head_what, headers, head_faults = "standard", list(headers_for(RUN_REQUESTED)), frozenset()
    budget = room - headers_bytes(headers) - 8 * len(headers or [])
    what, value, value_faults, finished_run = draw(values(user, finished, budget))
    faults = key_faults | head_faults | value_faults
    return Fuzzed(
        f"value {what} | key {key_what} | headers {head_what}",
        key,
        value,
        headers,
        faults,
        finished_run and not faults,
        draw(st.sampled_from(CODECS)),
    )


# --- the broker side ------------------------------------------------------------------


@dataclass
class Letters:
    """The DLQ read incrementally; every letter seen, by the runs record it stands for."""

    settings: Settings
    consumer: Consumer = field(init=False)
    seen: dict[tuple[int, int], list[tuple[Message, DeadLetter]]] = field(default_factory=dict)
    next_offset: int = 0

    def __post_init__(self) -> None:
        self.topic = self.settings.names.topic(RUNS_DLQ)
        conf = consumer_config(self.settings, "fuzz-dlq", None) | {"group.id": "unused"}
        self.consumer = Consumer(conf)
        self.consumer.assign([TopicPartition(self.topic, 0, OFFSET_BEGINNING)])

    def read_new(self) -> list[tuple[Message, DeadLetter]]:
        """The letters written since the last call (up to the end as of this one)."""
        _, high = self.consumer.get_watermark_offsets(TopicPartition(self.topic, 0), timeout=10)
        out: list[tuple[Message, DeadLetter]] = []

        def caught_up() -> bool:
            while self.next_offset < high:
                msg = self.consumer.poll(0.2)
                if msg is None:
                    return False
                err = msg.error()
                assert err is None or err.code() == KafkaError._PARTITION_EOF, err
                if err is not None:
                    continue
                self.next_offset = (msg.offset() or 0) + 1
                letter = decode_dead_letter(msg.value())
                out.append((msg, letter))
                self.seen.setdefault((letter.partition, letter.offset), []).append((msg, letter))
            return True

        wait_until(caught_up, timeout=30, interval=0, what=f"the DLQ read to offset {high}")
        return out

    def close(self) -> None:
        self.consumer.close()


class Fuzz:
    """Puts batches on the broker and checks what became of them."""

    def __init__(self, env: Settings, sub: Submitter, worker: WorkerProcess) -> None:
        self.env = env
        self.sub = sub
        self.worker = worker
        self.topic = env.names.topic(RUNS)
        self.group = env.names.group(WORKER_GROUP)
        self.producers: dict[str, Producer] = {}
        self.letters = Letters(env)
        self.expected: dict[tuple[int, int], Fuzzed] = {}
        self.batches = 0

    def producer(self, codec: str) -> Producer:
        if codec not in self.producers:
            conf = producer_config(self.env, f"fuzz-{codec}") | {
                "compression.type": codec,
                "message.max.bytes": 3 << 20,
                "linger.ms": 0,
            }
            self.producers[codec] = Producer(conf)
        return self.producers[codec]

    def put(
        self, partition: int, key: bytes | None, value: bytes | None, headers: Headers, codec: str
    ) -> int:
        """Produce one record onto ``partition``; its offset."""
        got: list[Any] = []
        producer = self.producer(codec)
        pairs: list[tuple[str, str | bytes | None]] | None = (
            None if headers is None else list(headers)
        )
        producer.produce(
            self.topic,
            key=key,
            value=value,
            headers=pairs,
            partition=partition,
            on_delivery=lambda err, msg: got.append((err, msg)),
        )
        assert producer.flush(30) == 0, "a record was not delivered in 30 s"
        ((err, msg),) = got
        assert err is None, f"the broker refused a generated record: {err}"
        return int(msg.offset())

    def log_tail(self) -> str:
        return self.worker.log()[-4000:]

    def check_batch(self, partition: int, user: str, batch: list[Fuzzed]) -> None:
        self.batches += 1
        placed = [(self.put(partition, r.key, r.value, r.headers, r.codec), r) for r in batch]
        for offset, r in placed:
            self.expected[(partition, offset)] = r
        # The user's next run, behind the batch on the same partition.
        run_id = self.sub.submit(user, FAST, publish=False)
        trigger_at = self.put(
            partition,
            user.encode(),
            RunRequested(run_id, user, f"s-{user}", "").encode(),
            list(headers_for(RUN_REQUESTED)),
            "lz4",
        )
        try:
            wait_until(
                lambda: self.sub.all_terminal([run_id]), timeout=RUN_S, what="the user's run"
            )
        except AssertionError:
            raise AssertionError(
                f"the run after batch {batch} never ended: partition {partition} stalled\n"
                f"{self.log_tail()}"
            ) from None
        assert self.sub.statuses([run_id]) == {run_id: "done"}
        # Every record before the run has ended once the committed offset is past it.
        try:
            wait_until(
                lambda: (
                    committed_offsets(self.env, self.group, self.topic).get(partition, -1)
                    > trigger_at
                ),
                timeout=RUN_S,
                interval=0.25,
                what=f"the workers' commit past offset {trigger_at}",
            )
        except AssertionError:
            raise AssertionError(f"batch {batch} never ended\n{self.log_tail()}") from None
        new = self.letters.read_new()
        for msg, letter in new:
            where = (letter.partition, letter.offset)
            assert letter.topic == self.topic and where in self.expected, (
                f"a dead letter of no generated record: {letter.reason} at {where}: "
                f"{letter.error}\n{self.log_tail()}"
            )
            self.check_letter(msg, letter, self.expected[where])
        for offset, r in placed:
            got = self.letters.seen.get((partition, offset), [])
            if not r.reasons:
                assert got == [], (
                    f"{r} is a valid trigger of a finished run, yet dead-lettered: {got[0][1]}"
                )
            else:
                reasons = [letter.reason for _, letter in got]
                assert len(got) == 1, f"{r}: {len(got)} dead letters {reasons}\n{self.log_tail()}"
                assert reasons[0] in r.reasons, (
                    f"{r}: dead-lettered {reasons[0]}: {got[0][1].error}"
                )

    def check_letter(self, msg: Message, letter: DeadLetter, r: Fuzzed) -> None:
        """The letter keeps where the record was, why, its sizes and a prefix of its bytes."""
        size = len(msg.value() or b"") + len(msg.key() or b"")
        assert size <= DEAD_LETTER_MAX_BYTES, (r, size)
        assert letter.error and letter.attempts == 0, (r, letter.error)
        assert letter.key_size == (None if r.key is None else len(r.key)), r
        assert letter.original_size == len(r.value or b""), r
        assert letter.headers_count == len(r.headers or []), r
        assert letter.headers_size == headers_bytes(r.headers), r
        sha = None if r.value is None else hashlib.sha256(r.value).hexdigest()
        assert letter.original_sha256 == sha, r
        assert r.value is None or letter.value is None or r.value.startswith(letter.value), r
        assert r.key is None or (letter.key is not None and r.key.startswith(letter.key)), r
        if not letter.truncated:  # whole: replayable as it was
            assert (letter.key, letter.value) == (r.key, r.value), r
            assert letter.headers == list(r.headers or []), r

    def check_all(self) -> None:
        """Exactly one letter per record that needs one, none for the rest, over all batches."""
        self.letters.read_new()
        twice = {w: len(got) for w, got in self.letters.seen.items() if len(got) > 1}
        assert not twice, f"dead-lettered more than once: {twice}"
        wanted = {w for w, r in self.expected.items() if r.reasons}
        assert set(self.letters.seen) == wanted
        log = self.worker.log()
        assert self.worker.alive(), log[-4000:]
        for bad in ("will retry", "record_skipped", "Traceback", "Crashed", "RecursionError"):
            assert bad not in log, f"{bad!r} in the worker's log:\n{log[-4000:]}"

    def close(self) -> None:
        for p in self.producers.values():
            p.flush(10)
        self.letters.close()


def topic_limit(env: Settings) -> int:
    """The runs topic's ``max.message.bytes`` as the broker has it."""
    admin = admin_client(env)
    res = ConfigResource(ResourceType.TOPIC, env.names.topic(RUNS))

    def described() -> int | None:
        try:  # a topic created a moment ago may not be described yet
            configs = admin.describe_configs([res])[res].result(30)
        except KafkaException:
            return None
        return int(configs["max.message.bytes"].value)

    return wait_until(described, what="the runs topic's max.message.bytes")


def test_generated_records_never_stall_a_partition_and_are_dead_lettered_once(
    env: Settings,
) -> None:
    limit = topic_limit(env)
    users = users_by_partition("fuzz-" + uuid.uuid4().hex[:6], env.partitions)
    sub = Submitter(env)
    worker = WorkerProcess(env, "fuzz").start()
    fuzz = Fuzz(env, sub, worker)
    try:
        # A finished run per user (the worker holds its partitions from here on).
        finished = {p: sub.submit(u, FAST) for p, u in users.items()}
        wait_until(lambda: sub.all_terminal(list(finished.values())), timeout=90, what="warm-up")

        @st.composite
        def batches(draw: st.DrawFn) -> tuple[int, list[Fuzzed]]:
            partition = draw(st.sampled_from(sorted(users)))
            user, other = users[partition], users[(partition + 1) % len(users)]
            recs = records(user, other, finished[partition], limit)
            return partition, draw(st.lists(recs, min_size=1, max_size=8))

        p0 = sorted(users)[0]
        u0 = users[p0]
        valid = RunRequested("no-such-run", u0, f"s-{u0}", "").encode()
        deep = b"[" * 5000 + b"]" * 5000
        nested = valid[:-1] + b',"x":' + deep + b"}"
        std = list(headers_for(RUN_REQUESTED))
        known = [  # issue 34's records that stalled a partition for good, and the limits
            Fuzzed("5,000 deep", u0.encode(), nested, std, frozenset({"too_deep"})),
            Fuzzed("900 KB key", b"k" * 900_000, valid, std, frozenset({"oversized_key"})),
            Fuzzed(
                "50 headers of 20 KB",
                u0.encode(),
                valid,
                [(f"h{i}", b"v" * 20_000) for i in range(50)],
                frozenset({"oversized_headers"}),
            ),
            Fuzzed(
                "at the topic's limit",
                u0.encode(),
                b"v" * (limit - FRAMING),
                std,
                frozenset({"oversized"}),
            ),
            Fuzzed("no key, no value", None, None, None, frozenset({"null_key", "null_value"})),
        ]

        @hypothesis_settings(
            max_examples=BATCHES,
            deadline=None,
            database=None,
            phases=(Phase.explicit, Phase.generate),
            print_blob=True,
            suppress_health_check=list(HealthCheck),
        )
        @given(batch=batches())
        @example(batch=(p0, known))
        def one(batch: tuple[int, list[Fuzzed]]) -> None:
            partition, recs = batch
            fuzz.check_batch(partition, users[partition], recs)

        one()
        assert fuzz.batches == BATCHES + 1
        fuzz.check_all()
    finally:
        fuzz.close()
        worker.stop()
        sub.close()
