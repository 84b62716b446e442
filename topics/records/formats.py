"""The specs of every record koda writes (:mod:`.specs` says what reads them).

``topic`` is the catalogue base name (``<env>.koda.<topic>`` on the broker; see
topics/catalogue.py); ``key`` says what the record key holds. Adding a field: add it
here, write it in the encoder, run ``koda schemas write`` and commit the JSON files.
"""

from __future__ import annotations

from koda_runtime.lifecycle.chunks import ChunkKind
from koda_runtime.lifecycle.handler import CALL_KINDS
from koda_runtime.lifecycle.ledger import Outcome
from koda_runtime.lifecycle.states import RunStatus
from koda_runtime.topics.records.specs import Field, RecordSpec, Variant

_TERMINAL_KINDS = tuple(k.value for k in ChunkKind if k.terminal)


def _id(name: str, description: str) -> Field:
    """A non-empty string of at most 200 characters (what the decoders insist on)."""
    return Field(name, "string", description, min_length=1, max_length=200)


def _count(name: str, description: str) -> Field:
    return Field(name, "integer", description, minimum=0)


def _run_id() -> Field:
    return _id("run_id", "The run's id (UUIDv7: time-ordered).")


def _at(what: str) -> Field:
    return Field("at", "string", what, format="date-time")


RUN_REQUESTED = RecordSpec(
    name="run.requested",
    version=1,
    description=(
        "The trigger a worker acts on: run this run. Postgres holds the run itself; the "
        "record may be delivered more than once (the sweeper republishes runs whose "
        "publish failed, a worker republishes a pending predecessor), and a worker skips "
        "runs already terminal."
    ),
    topic="runs",
    key="user_id (UTF-8), so a user's runs share a partition and keep their order",
    fields=(
        _run_id(),
        _id("user_id", "The user who submitted the run."),
        _id("session_id", "The run's session."),
        Field(
            "created_at",
            "string",
            "When the gateway admitted the run (ISO 8601, UTC); empty when a worker or a "
            "tool republished the trigger.",
            required=False,
            checked=False,
        ),
        Field(
            "schedule_id",
            "string",
            "The schedule that fired the run; absent when a person submitted it.",
            required=False,
            min_length=1,
            max_length=200,
        ),
        Field(
            "scheduled_for",
            "string",
            "The scheduled UTC minute the run was fired for (ISO 8601); absent when a "
            "person submitted it.",
            required=False,
            format="date-time",
        ),
    ),
)

RUN_CHUNK = RecordSpec(
    name="run.chunk",
    version=1,
    description=(
        "One output event of a run. seq is contiguous from 0 and never resets; a retry "
        "first emits `reset` so readers drop the partial answer. The same bytes are the "
        "`data:` of the SSE frame. Compaction (koda chunks compact) later replaces a "
        "run's chunk records with one run.final record and a tombstone per chunk key."
    ),
    topic="run-chunks",
    key="<run_id>:<seq>, seq zero-padded to 10 digits; a null value is a tombstone",
    fields=(
        _run_id(),
        _count("seq", "Position in the run's output, from 0."),
        Field(
            "kind",
            "string",
            "chunk (text), reset (drop earlier text), status, tool (a model's tool call "
            "or its result, JSON: call_id, name, then arguments or result), "
            "approval_required (a tool call waiting for a person: call_id, name, arguments, "
            "step), or a terminal kind: done, error, cancelled.",
            enum=tuple(k.value for k in ChunkKind),
        ),
        Field("content", "string", "Text for `chunk`; JSON text for the other kinds."),
        _count("attempt", "The attempt (claim) that wrote it, from 1."),
    ),
)

RUN_FINAL = RecordSpec(
    name="run.final",
    version=1,
    description=(
        "A compacted run's whole output, written before the tombstones of its chunk "
        "records. A tombstone under the same key means the run was purged from the topic."
    ),
    topic="run-chunks",
    key="<run_id>:final; a null value is a tombstone",
    fields=(
        _run_id(),
        Field("kind", "string", "Always `final`.", const="final", checked=False),
        _count("last_seq", "The seq of the run's terminal event."),
        Field("end", "string", "The terminal kind.", enum=_TERMINAL_KINDS),
        Field("end_content", "string", "The terminal event's content (JSON text)."),
        Field("content", "string", "The run's answer: the chunk text after the last reset."),
        _count("attempt", "The attempt of the terminal event."),
    ),
)

RUN_EVENT = RecordSpec(
    name="run.event",
    version=1,
    description=(
        "What happened to a run, for the warehouse: status transitions and usage "
        "(one record per model call). Written after the fact is durable in Postgres."
    ),
    topic="run-events",
    key="run_id (UTF-8); the run's partition, so a run's events are in order",
    fields=(
        _run_id(),
        Field("event", "string", "Which variant this record is.", enum=("transition", "usage")),
        _at("When the worker wrote the record (ISO 8601, UTC)."),
    ),
    discriminator="event",
    variants=(
        Variant(
            "transition",
            "The run moved to status `to` (running at each claim; waiting for a person's "
            "approval; done, failed or cancelled at the end).",
            (
                Field(
                    "to",
                    "string",
                    "The new status.",
                    enum=tuple(s.value for s in RunStatus),
                ),
                _count("attempt", "The claim count after this move."),
                Field(
                    "worker_id",
                    "string",
                    "The claiming worker; only on `running`.",
                    required=False,
                ),
                Field(
                    "reason",
                    "string",
                    "Why: `merged` on a `running` that reruns the run on its merged input; "
                    "the cancel request's reason on `cancelled`.",
                    required=False,
                ),
                Field(
                    "input_version",
                    "integer",
                    "The input version the rerun uses (how many messages were merged); only "
                    "with reason `merged`.",
                    required=False,
                    minimum=0,
                ),
            ),
        ),
        Variant(
            "usage",
            "One model call's token counts and its cost as priced from Postgres `prices`.",
            (
                _count("call_index", "The call's position in its attempt, from 0."),
                Field("model", "string", "The model's name (the price table's key)."),
                _count("prompt_tokens", "Input tokens."),
                _count("completion_tokens", "Output tokens."),
                Field(
                    "cost_usd",
                    "string",
                    "The call's cost in USD as a decimal string, priced by the worker in the "
                    "run's transaction. Absent from records of older workers: price their "
                    "tokens from the price table in force at `at`.",
                    required=False,
                ),
                Field(
                    "user_id",
                    "string",
                    "The user whose budget the call counts against (the ledger's `user_id`). "
                    "Absent from records of older workers.",
                    required=False,
                    min_length=1,
                    max_length=200,
                ),
                Field(
                    "attempt",
                    "integer",
                    "The attempt (claim) that made the call, from 1; with `run_id` and "
                    "`call_index` the ledger row's key. Absent from records of older workers.",
                    required=False,
                    minimum=0,
                ),
                Field(
                    "kind",
                    "string",
                    "chat or embedding. Absent from records of older workers (chat).",
                    required=False,
                    enum=CALL_KINDS,
                ),
                Field(
                    "outcome",
                    "string",
                    "How the call's attempt ended: ok, failed (the handler failed) or "
                    "cancelled (cut off). Absent from records of older workers (ok: they "
                    "recorded only finished runs' calls).",
                    required=False,
                    enum=tuple(o.value for o in Outcome),
                ),
                Field(
                    "estimated",
                    "boolean",
                    "The stream was cut before the model reported usage: the counts are "
                    "what was streamed. Absent from records of older workers (false).",
                    required=False,
                ),
                Field(
                    "price_id",
                    "integer",
                    "The Postgres `prices.id` the cost was computed from; null when the "
                    "model had no price (cost 0).",
                    required=False,
                    nullable=True,
                    minimum=0,
                ),
            ),
        ),
    ),
)

_B64 = "base64 of the original record's"
DEAD_LETTER = RecordSpec(
    name="run.dead-letter",
    version=1,
    description=(
        "A runs-topic record the worker gave up on: the original bytes and headers, where "
        "they came from and why. `koda dlq replay` republishes the original."
    ),
    topic="runs-dlq",
    key="the original record's key (bytes as they were)",
    fields=(
        Field(
            "original_key",
            "string",
            f"{_B64} key (its first 1 KiB when larger); null when it had none.",
            nullable=True,
        ),
        Field(
            "original_value",
            "string",
            f"{_B64} value (its first 512 KiB when larger; null when the broker refused "
            "the letter with it); null when it had none.",
            nullable=True,
        ),
        _count("original_size", "The original value's size in bytes."),
        Field(
            "original_sha256",
            "string",
            "Hex sha256 of the whole original value; null when it had none.",
            nullable=True,
        ),
        Field(
            "original_truncated",
            "boolean",
            "True when anything of the original was cut (value, key or headers): such a "
            "letter cannot be replayed.",
        ),
        Field(
            "original_headers",
            "array",
            "The original headers as [name, base64 value or null] pairs: the first 64, "
            "each value cut to 1 KiB and all of them to 16 KiB; none when the broker "
            "refused the letter with them.",
            items={
                "type": "array",
                "prefixItems": [{"type": "string"}, {"type": ["string", "null"]}],
                "minItems": 2,
                "maxItems": 2,
            },
        ),
        Field(
            "original_key_size",
            "integer",
            "The original key's size in bytes; null when it had none (absent from older letters).",
            required=False,
            nullable=True,
            minimum=0,
        ),
        Field(
            "original_headers_count",
            "integer",
            "How many headers the original had (absent from older letters).",
            required=False,
            minimum=0,
        ),
        Field(
            "original_headers_size",
            "integer",
            "The original headers' size in bytes, names and values (absent from older letters).",
            required=False,
            minimum=0,
        ),
        Field("topic", "string", "The topic the original was read from."),
        _count("partition", "Its partition."),
        Field(
            "offset",
            "integer",
            "Its offset; -1 for a trigger the worker made itself (a pending predecessor).",
            minimum=-1,
        ),
        _count("attempts", "Handler attempts made (0: never ran)."),
        Field(
            "reason",
            "string",
            "Why: undecodable, too_deep, invalid, null_key, null_value, oversized, "
            "oversized_key, oversized_headers, unknown_schema, unknown_schema_version, "
            "key_mismatch, unknown_run, user_mismatch, failed_before_claim (the record "
            "kept failing before its run was claimed), handler_failed.",
        ),
        Field("error", "string", "The error in words (at most 2000 characters)."),
        _at("When the letter was written (ISO 8601, UTC)."),
    ),
)

HEARTBEAT = RecordSpec(
    name="worker.heartbeat",
    version=1,
    description=(
        "A worker's beat, every KODA_BEAT_INTERVAL seconds. The topic is compacted; a "
        "null value (tombstone) means the worker left gracefully."
    ),
    topic="workers",
    key="worker_id (UTF-8)",
    fields=(
        Field(
            "worker_id",
            "string",
            "The worker: KODA_WORKER_ID, else KODA_POD_NAME, else <host>-<pid>-<random> "
            "drawn when the process started.",
        ),
        Field("beat_at", "string", "The worker's wall clock (ISO 8601, UTC).", format="date-time"),
        _count("in_flight", "Runs in progress."),
        Field("version", "string", "koda's version on that worker."),
        Field(
            "partitions",
            "array",
            "The runs-topic partitions it holds.",
            items={"type": "integer", "minimum": 0},
        ),
        Field("host", "string", "The host name."),
        Field(
            "pid",
            "integer",
            "The worker's process id on that host (absent from older workers' beats).",
            required=False,
            minimum=0,
        ),
        Field(
            "instance",
            "string",
            "A random id the process drew when it started: two processes beating under "
            "one worker_id differ here, so readers can tell them apart (absent from "
            "older workers' beats).",
            required=False,
            min_length=1,
            max_length=64,
        ),
    ),
)

ALL: tuple[RecordSpec, ...] = (
    RUN_REQUESTED,
    RUN_CHUNK,
    RUN_FINAL,
    RUN_EVENT,
    DEAD_LETTER,
    HEARTBEAT,
)
BY_NAME = {s.name: s for s in ALL}
