"""Decode and validate a ``POST /v1/runs`` request before anything is written.

Every check raises a :class:`~koda_runtime.gateway.errors.GatewayError` that names what was
wrong: the header, the field, the byte limit. The checks run in the order a
client can fix them: content type, headers, size, encoding, JSON, fields.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from koda_runtime.gateway.errors import (
    BadRequest,
    InvalidField,
    PayloadTooLarge,
    UnsupportedMediaType,
)

MAX_DEPTH = 32
MAX_IDEMPOTENCY_KEY_CHARS = 200
MAX_CLIENT_MESSAGE_ID_CHARS = 200
SESSION_ID = re.compile(r"[A-Za-z0-9._:@-]{1,128}")
# A client's id of one message (a UUID, a ULID, a counter): printable ASCII, no space.
CLIENT_MESSAGE_ID = re.compile(r"[\x21-\x7e]{1,%d}" % MAX_CLIENT_MESSAGE_ID_CHARS)
FIELDS = ("session_id", "input", "metadata", "client_message_id")
# Postgres jsonb cannot hold NUL, and lone surrogates cannot be encoded as UTF-8.
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")
_PRINTABLE_ASCII = re.compile(r"[\x20-\x7e]+")


@dataclass(frozen=True)
class RunRequest:
    """A validated body; ``input`` is always an object (a string became ``{"text": s}``)."""

    input: dict[str, Any]
    session_id: str | None = None
    metadata: dict[str, Any] | None = None
    client_message_id: str | None = None

    def canonical(self) -> dict[str, Any]:
        """What identifies the request's intent, for a derived idempotency key."""
        return {"input": self.input, "metadata": self.metadata}


def check_content_type(content_type: str | None) -> None:
    """Accept ``application/json`` (or ``+json``), UTF-8 only; else 415."""
    if not content_type:
        raise UnsupportedMediaType(
            "missing Content-Type: send the body as application/json", field="Content-Type"
        )
    media, _, params = content_type.partition(";")
    media = media.strip().lower()
    if media != "application/json" and not (
        media.startswith("application/") and media.endswith("+json")
    ):
        raise UnsupportedMediaType(
            f"Content-Type {media!r} is not supported: send application/json",
            field="Content-Type",
        )
    for param in params.split(";"):
        name, _, value = param.partition("=")
        if name.strip().lower() == "charset" and value.strip().strip('"').lower() not in (
            "utf-8",
            "utf8",
        ):
            raise UnsupportedMediaType(
                f"charset {value.strip()!r} is not supported: send UTF-8", field="Content-Type"
            )


def check_idempotency_key(values: list[str]) -> str | None:
    """The ``Idempotency-Key`` header: at most 200 printable ASCII chars, sent once."""
    if not values:
        return None
    if len(values) > 1:
        raise BadRequest(
            "Idempotency-Key header sent more than once: send one key",
            field="Idempotency-Key",
            code="invalid_header",
        )
    key = values[0]
    if len(key) > MAX_IDEMPOTENCY_KEY_CHARS:
        raise BadRequest(
            f"Idempotency-Key header is {len(key)} chars, limit {MAX_IDEMPOTENCY_KEY_CHARS}",
            field="Idempotency-Key",
            code="invalid_header",
        )
    if not _PRINTABLE_ASCII.fullmatch(key):
        raise BadRequest(
            "Idempotency-Key header must be 1-200 printable ASCII characters "
            "(no control characters, CR or LF)",
            field="Idempotency-Key",
            code="invalid_header",
        )
    return key


def _too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"the body is larger than {limit} bytes", field="body")


async def read_body(content_length: str | None, stream: AsyncIterator[bytes], limit: int) -> bytes:
    """Read at most ``limit`` bytes: refuse early on Content-Length, and count streamed bytes.

    Counting matters for chunked requests, which announce no length.
    """
    if content_length is not None:
        if not content_length.strip().isdigit():
            raise BadRequest(
                "Content-Length is not a number", field="Content-Length", code="invalid_header"
            )
        if int(content_length) > limit:
            raise _too_large(limit)
    body = bytearray()
    async for chunk in stream:
        body += chunk
        if len(body) > limit:
            raise _too_large(limit)
    return bytes(body)


def _finite_float(raw: str) -> float:
    value = float(raw)
    if not math.isfinite(value):
        raise ValueError(f"number {raw} is out of range")
    return value


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def decode_json(body: bytes) -> Any:
    """UTF-8 JSON to Python; 400 ``invalid_utf8`` or ``invalid_json`` naming the position."""
    if not body.strip():
        raise BadRequest("the body is empty: send a JSON object", field="body", code="invalid_json")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequest(
            f"the body is not valid UTF-8 (byte {exc.start})", field="body", code="invalid_utf8"
        ) from None
    try:
        return json.loads(text, parse_float=_finite_float, parse_constant=_refuse_constant)
    except json.JSONDecodeError as exc:
        raise BadRequest(
            f"the body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}",
            field="body",
            code="invalid_json",
        ) from None
    except RecursionError:
        raise InvalidField(
            f"the body is nested deeper than {MAX_DEPTH} levels", field="body"
        ) from None
    except ValueError as exc:
        raise BadRequest(
            f"the body is not valid JSON: {exc}", field="body", code="invalid_json"
        ) from None


def _check_value(value: Any, field: str, depth: int) -> None:
    """Nesting (the body object is level 1) and storable strings, everywhere under ``field``.

    ``depth`` is the level ``value`` sits at; only objects and arrays count as levels.
    """
    if depth > MAX_DEPTH and isinstance(value, dict | list):
        raise InvalidField(f"{field} is nested deeper than {MAX_DEPTH} levels", field=field)
    if isinstance(value, str):
        if _UNSTORABLE.search(value):
            raise InvalidField(
                f"{field} contains a NUL character or an unpaired surrogate", field=field
            )
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_value(key, field, depth)
            _check_value(item, field, depth + 1)
    elif isinstance(value, list):
        for item in value:
            _check_value(item, field, depth + 1)


def _optional_str(obj: dict[str, Any], name: str) -> str | None:
    value = obj.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidField(f"{name} must be a string, got {json_type(value)}", field=name)
    return value


def json_type(value: Any) -> str:
    """The JSON name of ``value``'s type, for error messages that say what came."""
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return "null"


def json_object(obj: Any, fields: tuple[str, ...]) -> dict[str, Any]:
    """``obj`` if it is a JSON object whose names are all in ``fields``; else InvalidField
    naming the body or the first unknown field."""
    if not isinstance(obj, dict):
        raise InvalidField(f"the body must be a JSON object, got {json_type(obj)}", field="body")
    for name in obj:
        if name not in fields:
            raise InvalidField(
                f"unknown field {name[:64]!r}: accepted fields are {', '.join(fields)}",
                field=name[:64],
            )
    return obj


def parse_run_request(obj: Any) -> RunRequest:
    """Validate a decoded body against ``{session_id?, input, metadata?, client_message_id?}``."""
    obj = json_object(obj, FIELDS)
    for name, value in obj.items():
        _check_value(value, name, 2)

    if "input" not in obj or obj["input"] is None:
        raise InvalidField("input is required: a JSON object or a string", field="input")
    raw_input = obj["input"]
    if isinstance(raw_input, str):
        if not raw_input.strip():
            raise InvalidField("input must not be empty", field="input")
        run_input: dict[str, Any] = {"text": raw_input}
    elif isinstance(raw_input, dict):
        run_input = raw_input
    else:
        raise InvalidField(
            f"input must be a JSON object or a string, got {json_type(raw_input)}",
            field="input",
        )

    session_id = _optional_str(obj, "session_id")
    if session_id is not None and not SESSION_ID.fullmatch(session_id):
        raise InvalidField(
            "session_id must be 1-128 chars of A-Z a-z 0-9 . _ : @ -", field="session_id"
        )

    metadata = obj.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise InvalidField(
            f"metadata must be a JSON object, got {json_type(metadata)}", field="metadata"
        )

    client_message_id = _optional_str(obj, "client_message_id")
    if client_message_id is not None and not CLIENT_MESSAGE_ID.fullmatch(client_message_id):
        raise InvalidField(
            f"client_message_id must be 1-{MAX_CLIENT_MESSAGE_ID_CHARS} printable ASCII "
            f"characters without spaces (got {len(client_message_id)} chars)",
            field="client_message_id",
        )
    return RunRequest(
        input=run_input,
        session_id=session_id,
        metadata=metadata,
        client_message_id=client_message_id,
    )
