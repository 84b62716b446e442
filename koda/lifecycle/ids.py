"""Time-ordered ids (UUIDv7) and idempotency keys."""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
import uuid
from typing import Any


def uuid7() -> str:
    """A UUIDv7 string: 48-bit unix ms timestamp, then random bits (RFC 9562)."""
    ms = time.time_ns() // 1_000_000
    rand = int.from_bytes(os.urandom(10), "big")
    value = (ms & ((1 << 48) - 1)) << 80
    value |= 0x7 << 76
    value |= ((rand >> 62) & 0xFFF) << 64
    value |= 0b10 << 62
    value |= rand & ((1 << 62) - 1)
    return str(uuid.UUID(int=value))


def dedup_bucket(now_s: float, window_s: float) -> int:
    """The number of the ``window_s``-second dedup window holding unix time ``now_s``."""
    if not window_s > 0:
        raise ValueError(f"the dedup window must be positive, got {window_s}")
    return math.floor(now_s / window_s)


def derived_idempotency_key(
    user_id: str,
    session_id: str | None,
    client_message_id: str | None,
    body: Any,
    bucket: int | None = None,
) -> str:
    """Key for a request that sent no ``Idempotency-Key``: same intent, same key.

    With a ``client_message_id`` the message is its id (with the user, session and
    body): the same key for ever, so a client's retry of a message is one run and a
    repeated message with a new id is a new one. Without one, ``bucket`` (see
    :func:`dedup_bucket`) is part of the key: the same body is the same run only
    within a short window (``KODA_DEDUP_WINDOW_S``, a double click).
    """
    fields: dict[str, Any] = {"u": user_id, "s": session_id, "m": client_message_id, "b": body}
    if client_message_id is None and bucket is not None:
        fields["w"] = bucket
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return "derived:" + hashlib.sha256(canonical.encode()).hexdigest()


def scoped_idempotency_key(user_id: str, key: str) -> str:
    """A client's key, scoped to its user so two users' keys can never collide."""
    digest = hashlib.sha256(f"{user_id}\x00{key}".encode()).hexdigest()
    return "client:" + digest
