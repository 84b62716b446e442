"""Reading ``run.dead-letter/1`` values.

They are written by :func:`koda_runtime.schemas.records.dead_letter_value`.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from typing import Any

from koda_runtime.errors import RecordError


@dataclass(frozen=True)
class DeadLetter:
    """A dead letter: the original record's bytes and where and why it failed."""

    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes | None]]
    truncated: bool
    topic: str
    partition: int
    offset: int
    attempts: int
    reason: str
    error: str
    at: str = ""
    original_size: int | None = None
    original_sha256: str | None = None
    # The original key's and headers' sizes (None in letters written before they were
    # recorded); ``truncated`` says whether the key, headers or value were cut.
    key_size: int | None = None
    headers_count: int | None = None
    headers_size: int | None = None


def decode_dead_letter(value: bytes | None) -> DeadLetter:
    """Decode a dead-letter value; raise RecordError if it is not one."""
    if value is None:
        raise RecordError("null_value", "dead letter has no value")
    try:
        obj: Any = json.loads(value.decode("utf-8"))
        if not isinstance(obj, dict):
            raise RecordError("invalid", "dead letter is not a JSON object")
        return DeadLetter(
            key=_b64(obj.get("original_key")),
            value=_b64(obj.get("original_value")),
            headers=[(str(k), _b64(v)) for k, v in obj.get("original_headers") or []],
            truncated=bool(obj.get("original_truncated")),
            topic=str(obj["topic"]),
            partition=int(obj["partition"]),
            offset=int(obj["offset"]),
            attempts=int(obj.get("attempts", 0)),
            reason=str(obj.get("reason", "")),
            error=str(obj.get("error", "")),
            at=str(obj.get("at") or ""),
            original_size=None if obj.get("original_size") is None else int(obj["original_size"]),
            original_sha256=None
            if obj.get("original_sha256") is None
            else str(obj["original_sha256"]),
            key_size=_count(obj.get("original_key_size")),
            headers_count=_count(obj.get("original_headers_count")),
            headers_size=_count(obj.get("original_headers_size")),
        )
    except (UnicodeDecodeError, json.JSONDecodeError, binascii.Error) as exc:
        raise RecordError("undecodable", f"dead letter is not decodable: {exc}") from None
    except (KeyError, TypeError, ValueError) as exc:
        raise RecordError("invalid", f"dead letter field is invalid: {exc}") from None
    except RecursionError as exc:
        raise RecordError("undecodable", f"dead letter nests too deep: {exc}") from None


def _count(value: Any) -> int | None:
    return None if value is None else int(value)


def _b64(text: str | None) -> bytes | None:
    return None if text is None else base64.b64decode(text, validate=True)
