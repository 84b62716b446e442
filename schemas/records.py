"""Wire formats of koda's Kafka records: encode, decode, validate.

Every record carries headers ``schema`` (``name/version``) and ``content-type``.
Values are UTF-8 JSON. Decoding never raises anything but :class:`RecordError`,
whose ``reason`` becomes the DLQ reason.
"""

from __future__ import annotations

import base64
import hashlib
import json
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from koda_runtime.errors import RecordError
from koda_runtime.schemas import record_specs as spec

CONTENT_TYPE = "application/json"
RUN_REQUESTED = spec.RUN_REQUESTED.name
RUN_CHUNK = spec.RUN_CHUNK.name
RUN_EVENT = spec.RUN_EVENT.name
DEAD_LETTER = spec.DEAD_LETTER.name
HEARTBEAT = spec.HEARTBEAT.name
RUN_FINAL = spec.RUN_FINAL.name
CURRENT_VERSION = {s.name: s.version for s in spec.ALL}
MAX_RUN_RECORD_BYTES = 256 * 1024
# A dead letter must fit the broker's 1 MiB default after base64: larger originals keep a
# prefix plus their size and sha256 (the full bytes stay on the source topic until retention).
MAX_DEAD_LETTER_ORIGINAL = 512 * 1024

Headers = list[tuple[str, bytes]]


def headers_for(schema: str, traceparent: str | None = None) -> Headers:
    """The standard headers of docs/design.md §2 for a record of ``schema``."""
    hs: Headers = [
        ("schema", f"{schema}/{CURRENT_VERSION[schema]}".encode()),
        ("content-type", CONTENT_TYPE.encode()),
    ]
    if traceparent:
        hs.append(("traceparent", traceparent.encode()))
    return hs


def header_value(headers: Any, name: str) -> bytes | None:
    """Find a header in either list-of-pairs or mapping form (clients differ)."""
    if not headers:
        return None
    items = headers.items() if isinstance(headers, dict) else headers
    for k, v in items:
        if k == name:
            return v if isinstance(v, bytes) or v is None else str(v).encode()
    return None


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


@dataclass(frozen=True)
class RunRequested:
    """``run.requested/1``: the trigger a worker acts on. Postgres holds the truth."""

    run_id: str
    user_id: str
    session_id: str
    created_at: str
    # Set on a scheduled run only (the fields are absent otherwise).
    schedule_id: str | None = None
    scheduled_for: str | None = None

    def encode(self) -> bytes:
        values = (
            self.run_id,
            self.user_id,
            self.session_id,
            self.created_at,
            self.schedule_id,
            self.scheduled_for,
        )
        names = spec.RUN_REQUESTED.names
        return dumps(
            {k: v for k, v in zip(names, values, strict=True) if v is not None or k in names[:4]}
        )


def decode_run_requested(key: bytes | None, value: bytes | None, headers: Any) -> RunRequested:
    """Decode and validate one runs-topic record; raise RecordError with a reason."""
    if value is None:
        raise RecordError("null_value", "record has no value")
    if len(value) > MAX_RUN_RECORD_BYTES:
        raise RecordError("oversized", f"value is {len(value)} bytes, limit {MAX_RUN_RECORD_BYTES}")
    if key is None:
        raise RecordError("null_key", "record has no key; runs are keyed by user_id")
    schema = header_value(headers, "schema")
    if schema is not None:
        name, _, version = schema.decode("utf-8", "replace").partition("/")
        if name != RUN_REQUESTED:
            raise RecordError("unknown_schema", f"schema {name!r} is not {RUN_REQUESTED}")
        if version != str(CURRENT_VERSION[RUN_REQUESTED]):
            raise RecordError(
                "unknown_schema_version", f"{RUN_REQUESTED} version {version!r} is not supported"
            )
    obj = spec.RUN_REQUESTED.check(json_object(value))
    record = RunRequested(
        run_id=obj["run_id"],
        user_id=obj["user_id"],
        session_id=obj["session_id"],
        created_at=str(obj.get("created_at") or ""),
        schedule_id=obj.get("schedule_id"),
        scheduled_for=obj.get("scheduled_for"),
    )
    if key.decode("utf-8", "replace") != record.user_id:
        raise RecordError("key_mismatch", "record key is not the run's user_id")
    return record


def chunk_value(run_id: str, seq: int, kind: str, content: str, attempt: int) -> bytes:
    """``run.chunk/1`` value."""
    values = (run_id, seq, kind, content, attempt)
    return dumps(dict(zip(spec.RUN_CHUNK.names, values, strict=True)))


@dataclass(frozen=True)
class ChunkRecord:
    """A decoded ``run.chunk/1`` value. Unknown fields are ignored (forward compatible)."""

    run_id: str
    seq: int
    kind: str
    content: str
    attempt: int


def json_object(value: bytes | None) -> dict[str, Any]:
    """A record value as a JSON object; RecordError (null_value, undecodable, invalid)."""
    if value is None:
        raise RecordError("null_value", "record has no value")
    try:
        obj = json.loads(value.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RecordError("undecodable", f"value is not UTF-8 JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise RecordError("invalid", "value is not a JSON object")
    return obj


def decode_chunk_value(value: bytes | None) -> ChunkRecord:
    """Decode one chunk-topic value; raise RecordError with a reason."""
    obj = spec.RUN_CHUNK.check(json_object(value))
    return ChunkRecord(
        run_id=obj["run_id"],
        seq=obj["seq"],
        kind=obj["kind"],
        content=obj["content"],
        attempt=obj["attempt"],
    )


@dataclass(frozen=True)
class FinalRecord:
    """``run.final/1``: a compacted run's whole output, under the key ``<run_id>:final``.

    ``content`` is the text after the last ``reset`` (what the run answered), ``end``
    the terminal kind (done, error, cancelled), ``end_content`` that event's content and
    ``last_seq`` its seq.
    """

    run_id: str
    last_seq: int
    end: str
    end_content: str
    content: str
    attempt: int

    def encode(self) -> bytes:
        values = (
            self.run_id,
            "final",
            self.last_seq,
            self.end,
            self.end_content,
            self.content,
            self.attempt,
        )
        return dumps(dict(zip(spec.RUN_FINAL.names, values, strict=True)))


def decode_final_value(value: bytes | None) -> FinalRecord:
    """Decode a ``<run_id>:final`` value; raise RecordError with a reason."""
    obj = spec.RUN_FINAL.check(json_object(value))
    return FinalRecord(
        run_id=obj["run_id"],
        last_seq=obj["last_seq"],
        end=obj["end"],
        end_content=obj["end_content"],
        content=obj["content"],
        attempt=obj["attempt"],
    )


def event_value(run_id: str, event: str, **fields: Any) -> bytes:
    """``run.event/1`` value: status transitions and usage records, for the warehouse.

    Raises ValueError for a field the spec does not declare for ``event``.
    """
    return dumps(
        spec.RUN_EVENT.value({"run_id": run_id, "event": event, "at": now_iso(), **fields})
    )


def dead_letter_value(
    *,
    key: bytes | None,
    value: bytes | None,
    headers: Any,
    topic: str,
    partition: int,
    offset: int,
    attempts: int,
    reason: str,
    error: str,
) -> bytes:
    """``run.dead-letter/1``: the original bytes (base64) and where they came from."""

    def b64(b: bytes | None) -> str | None:
        return None if b is None else base64.b64encode(b).decode()

    items = headers.items() if isinstance(headers, dict) else (headers or [])
    size = 0 if value is None else len(value)
    kept = (
        value
        if value is None or size <= MAX_DEAD_LETTER_ORIGINAL
        else value[:MAX_DEAD_LETTER_ORIGINAL]
    )
    return dumps(
        spec.DEAD_LETTER.value(
            {
                "original_key": b64(key),
                "original_value": b64(kept),
                "original_size": size,
                "original_sha256": None if value is None else hashlib.sha256(value).hexdigest(),
                "original_truncated": kept is not value,
                "original_headers": [[k, b64(v)] for k, v in items],
                "topic": topic,
                "partition": partition,
                "offset": offset,
                "attempts": attempts,
                "reason": reason,
                "error": error[:2000],
                "at": now_iso(),
            }
        )
    )


def now_iso() -> str:
    return datetime.now(UTC).isoformat()
