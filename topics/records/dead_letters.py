"""Reading ``run.dead-letter/1`` values.

They are written by :func:`koda_runtime.topics.records.codec.dead_letter_value`.
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

    # What was cut, part by part (None: a letter written before the sizes were kept
    # cannot tell; ``truncated`` still says whether anything was).

    @property
    def key_truncated(self) -> bool | None:
        """The letter keeps less of the original key than it had."""
        if self.key_size is None:  # no key, or a letter written before sizes were kept
            return None if self.headers_count is None else False
        return len(self.key or b"") < self.key_size

    @property
    def headers_truncated(self) -> bool | None:
        """Headers were dropped, or a name or value cut."""
        if self.headers_count is None or self.headers_size is None:
            return None
        kept = sum(
            len(name.encode("utf-8", "replace")) + len(value or b"") for name, value in self.headers
        )
        return len(self.headers) < self.headers_count or kept < self.headers_size

    @property
    def value_truncated(self) -> bool | None:
        """The letter keeps less of the original value than it had (none at all in a
        bare letter)."""
        if self.original_size is None:
            return None
        if self.original_sha256 is None:  # the original had no value
            return False
        return len(self.value or b"") < self.original_size

    @property
    def cut_parts(self) -> list[str]:
        """The parts the letter cut (``key``, ``headers``, ``value``), as far as it tells."""
        flags = (
            ("key", self.key_truncated),
            ("headers", self.headers_truncated),
            ("value", self.value_truncated),
        )
        return [name for name, cut in flags if cut]


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
