"""Wire formats of koda's Kafka records: encode, decode, validate.

Every record carries headers ``schema`` (``name/version``) and ``content-type``.
Values are UTF-8 JSON. Decoding never raises anything but :class:`RecordError`,
whose ``reason`` becomes the DLQ reason: sizes are checked before anything is parsed
(value, key, headers), JSON nesting is capped at :data:`MAX_JSON_DEPTH` before the
parser sees the text, and whatever the parser or a spec check raises besides (a
``RecursionError``, a ``ValueError`` for a 5,000-digit number, ...) becomes
``undecodable`` with the exception named.

A dead letter (:func:`dead_letter_value`) always fits the worker's producer: the
original key, headers and value are cut to fixed bounds, their original sizes kept.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

from koda_runtime.errors import RecordError
from koda_runtime.lifecycle.chunks import ChunkKind
from koda_runtime.topics.records import formats as spec

CONTENT_TYPE = "application/json"
RUN_REQUESTED = spec.RUN_REQUESTED.name
RUN_CHUNK = spec.RUN_CHUNK.name
RUN_EVENT = spec.RUN_EVENT.name
DEAD_LETTER = spec.DEAD_LETTER.name
HEARTBEAT = spec.HEARTBEAT.name
RUN_FINAL = spec.RUN_FINAL.name
CURRENT_VERSION = {s.name: s.version for s in spec.ALL}
MAX_RUN_RECORD_BYTES = 256 * 1024
# A runs-topic key is a user id (at most 200 characters); headers are a few short
# strings. Anything far beyond is refused before it is decoded.
MAX_RUN_KEY_BYTES = 1024
MAX_RUN_HEADERS_BYTES = 16 * 1024
# No koda record nests deeper than a few levels; a deeper value is refused before the
# parser (whose recursion would otherwise end in RecursionError) sees it.
MAX_JSON_DEPTH = 64
# A dead letter must fit the worker's producer (Faust's producer_max_request_size,
# 1,000,000 bytes) and the broker's default 1 MiB: its key, value and headers together
# stay under DEAD_LETTER_MAX_BYTES. Larger originals keep a prefix plus their size (and
# the value its sha256); the full bytes stay on the source topic until retention.
DEAD_LETTER_MAX_BYTES = 900_000
MAX_DEAD_LETTER_ORIGINAL = 512 * 1024
MAX_DEAD_LETTER_KEY = 1024
MAX_DEAD_LETTER_HEADERS = 16 * 1024  # names and values, all headers together
MAX_DEAD_LETTER_HEADER_VALUE = 1024
MAX_DEAD_LETTER_HEADER_COUNT = 64
MAX_DEAD_LETTER_ERROR = 2000

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


def headers_size(headers: Any) -> tuple[int, int]:
    """``(count, bytes)`` of ``headers`` (names in UTF-8 plus values), in either form."""
    items = headers.items() if isinstance(headers, dict) else (headers or [])
    count = size = 0
    for name, value in items:
        count += 1
        size += len(str(name).encode("utf-8", "replace"))
        size += 0 if value is None else len(value if isinstance(value, bytes) else str(value))
    return count, size


F = TypeVar("F", bound=Callable[..., Any])


def _only_record_errors(fn: F) -> F:
    """Make ``fn`` raise nothing but RecordError: anything else a decoder meets (a
    RecursionError, a ValueError, a TypeError from a header of an odd type) becomes
    ``undecodable`` naming the exception."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except RecordError:
            raise
        except Exception as exc:  # noqa: BLE001 - the decoders' promise: RecordError only
            raise RecordError(
                "undecodable", f"cannot decode the record: {type(exc).__name__}: {exc}"[:500]
            ) from None

    return wrapper  # type: ignore[return-value]


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


@_only_record_errors
def decode_run_requested(key: bytes | None, value: bytes | None, headers: Any) -> RunRequested:
    """Decode and validate one runs-topic record; raise RecordError with a reason (and
    nothing else)."""
    if value is None:
        raise RecordError("null_value", "record has no value")
    if len(value) > MAX_RUN_RECORD_BYTES:
        raise RecordError("oversized", f"value is {len(value)} bytes, limit {MAX_RUN_RECORD_BYTES}")
    if key is None:
        raise RecordError("null_key", "record has no key; runs are keyed by user_id")
    if len(key) > MAX_RUN_KEY_BYTES:
        raise RecordError(
            "oversized_key", f"key is {len(key)} bytes, limit {MAX_RUN_KEY_BYTES} (a user id)"
        )
    count, size = headers_size(headers)
    if size > MAX_RUN_HEADERS_BYTES:
        raise RecordError(
            "oversized_headers",
            f"{count} headers of {size} bytes in all, limit {MAX_RUN_HEADERS_BYTES}",
        )
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


# What opens or closes a JSON container outside strings: strings (escapes included) are
# matched whole, so a bracket inside one is never counted.
_JSON_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"?|[\[\]{}]')


def json_depth_exceeds(text: str, limit: int = MAX_JSON_DEPTH) -> bool:
    """True when ``text`` nests arrays and objects deeper than ``limit`` (counted over
    the brackets outside strings; the text need not be valid JSON)."""
    if text.count("[") + text.count("{") <= limit:
        return False  # too few openers to nest that deep: the common case, no scan
    depth = 0
    for m in _JSON_TOKENS.finditer(text):
        c = m.group()
        if c in "[{":
            depth += 1
            if depth > limit:
                return True
        elif c in "]}":
            depth -= 1
    return False


def json_object(value: bytes | None) -> dict[str, Any]:
    """A record value as a JSON object; RecordError (null_value, undecodable, too_deep,
    invalid) and nothing else."""
    if value is None:
        raise RecordError("null_value", "record has no value")
    try:
        text = value.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RecordError("undecodable", f"value is not UTF-8: {exc}") from None
    if json_depth_exceeds(text):
        raise RecordError(
            "too_deep", f"value nests JSON deeper than {MAX_JSON_DEPTH} levels ({len(value)} bytes)"
        )
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RecordError("undecodable", f"value is not JSON: {exc}") from None
    except (RecursionError, ValueError, MemoryError) as exc:
        # ValueError: e.g. an integer of more than 4,300 digits.
        raise RecordError(
            "undecodable", f"value is not decodable JSON: {type(exc).__name__}: {exc}"[:500]
        ) from None
    if not isinstance(obj, dict):
        raise RecordError("invalid", "value is not a JSON object")
    return obj


@_only_record_errors
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


CHUNK_KINDS = frozenset(k.value for k in ChunkKind)


def decode_keyed_chunk(run_id: str, seq: int, value: bytes | None) -> ChunkRecord:
    """Decode the value of the chunk-topic key ``<run_id>:<seq>`` and check it against
    the key: the same run and seq, and a kind koda writes. RecordError otherwise
    (``key_mismatch``, ``invalid``, or a decoding reason)."""
    chunk = decode_chunk_value(value)
    if chunk.run_id != run_id or chunk.seq != seq:
        raise RecordError(
            "key_mismatch",
            f"value is run {chunk.run_id[:80]!r} seq {chunk.seq}, "
            f"its key says run {run_id[:80]!r} seq {seq}",
        )
    if chunk.kind not in CHUNK_KINDS:
        raise RecordError("invalid", f"kind {chunk.kind[:40]!r} is not a chunk kind")
    return chunk


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


@_only_record_errors
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


def decode_keyed_final(run_id: str, value: bytes | None) -> FinalRecord:
    """Decode the value of the chunk-topic key ``<run_id>:final`` and check that it is
    that run's; RecordError otherwise."""
    final = decode_final_value(value)
    if final.run_id != run_id:
        raise RecordError(
            "key_mismatch", f"value is run {final.run_id[:80]!r}, its key says {run_id[:80]!r}"
        )
    return final


def event_value(run_id: str, event: str, **fields: Any) -> bytes:
    """``run.event/1`` value: status transitions and usage records, for the warehouse.

    Raises ValueError for a field the spec does not declare for ``event``.
    """
    return dumps(
        spec.RUN_EVENT.value({"run_id": run_id, "event": event, "at": now_iso(), **fields})
    )


def dead_letter_key(key: bytes | None) -> bytes | None:
    """The dead letter's own record key: the original key's first
    :data:`MAX_DEAD_LETTER_KEY` bytes."""
    return None if key is None else key[:MAX_DEAD_LETTER_KEY]


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
    bare: bool = False,
) -> bytes:
    """``run.dead-letter/1``: the original bytes (base64) and where they came from.

    The letter always fits :data:`DEAD_LETTER_MAX_BYTES` with its key: the original key
    keeps its first :data:`MAX_DEAD_LETTER_KEY` bytes, the headers their first
    :data:`MAX_DEAD_LETTER_HEADER_COUNT` (each value cut to
    :data:`MAX_DEAD_LETTER_HEADER_VALUE` bytes, all of them to
    :data:`MAX_DEAD_LETTER_HEADERS`), the value its first
    :data:`MAX_DEAD_LETTER_ORIGINAL` bytes. The original sizes are kept
    (``original_size``, ``original_key_size``, ``original_headers_count``,
    ``original_headers_size``) and ``original_truncated`` says something was cut.
    ``bare`` keeps no value and no headers at all (the last try before giving up on a
    letter the broker refused).
    """

    def b64(b: bytes | None) -> str | None:
        return None if b is None else base64.b64encode(b).decode()

    items = [(str(k), _header_bytes(v)) for k, v in _header_items(headers)]
    header_count, header_bytes = headers_size(items)
    if bare:
        kept_headers: list[list[str | None]] = []
        cut = bool(items)
    else:
        kept_headers, cut = _kept_headers(items)
    size = 0 if value is None else len(value)
    kept = None if value is None or bare else value[:MAX_DEAD_LETTER_ORIGINAL]
    if value is not None and (kept is None or len(kept) < size):
        cut = True
    kept_key = dead_letter_key(key)
    if key is not None and kept_key is not None and len(kept_key) < len(key):
        cut = True
    letter = dumps(
        spec.DEAD_LETTER.value(
            {
                "original_key": b64(kept_key),
                "original_value": b64(kept),
                "original_size": size,
                "original_sha256": None if value is None else hashlib.sha256(value).hexdigest(),
                "original_truncated": cut,
                "original_headers": kept_headers,
                "original_key_size": None if key is None else len(key),
                "original_headers_count": header_count,
                "original_headers_size": header_bytes,
                "topic": topic,
                "partition": partition,
                "offset": offset,
                "attempts": attempts,
                "reason": reason,
                # The error may quote the record (a run id with a lone surrogate,
                # which UTF-8 cannot encode): such characters are kept as escapes.
                "error": error[:MAX_DEAD_LETTER_ERROR]
                .encode("utf-8", "backslashreplace")
                .decode("utf-8"),
                "at": now_iso(),
            }
        )
    )
    if not bare and len(letter) + len(kept_key or b"") > DEAD_LETTER_MAX_BYTES:
        # The bounds above keep a letter far below the limit; should a future field
        # break them, the letter still fits, without the original's bytes.
        return dead_letter_value(
            key=key,
            value=value,
            headers=headers,
            topic=topic,
            partition=partition,
            offset=offset,
            attempts=attempts,
            reason=reason,
            error=error,
            bare=True,
        )
    return letter


def _header_items(headers: Any) -> list[tuple[Any, Any]]:
    return list(headers.items() if isinstance(headers, dict) else (headers or []))


def _header_bytes(value: Any) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    return str(value).encode("utf-8", "replace")


def _kept_headers(items: list[tuple[str, bytes | None]]) -> tuple[list[list[str | None]], bool]:
    """The headers a dead letter keeps (as [name, base64 value]) and whether any was cut."""
    kept: list[list[str | None]] = []
    used = 0
    cut = False
    for name, value in items:
        short_name = name[:256]
        short = None if value is None else value[:MAX_DEAD_LETTER_HEADER_VALUE]
        size = len(short_name.encode("utf-8", "replace")) + (0 if short is None else len(short))
        if len(kept) >= MAX_DEAD_LETTER_HEADER_COUNT or used + size > MAX_DEAD_LETTER_HEADERS:
            return kept, True
        used += size
        cut = cut or short_name != name or short != value
        kept.append([short_name, None if short is None else base64.b64encode(short).decode()])
    return kept, cut


def now_iso() -> str:
    return datetime.now(UTC).isoformat()
