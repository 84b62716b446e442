"""Time-ordered ids (UUIDv7) and idempotency keys."""

from __future__ import annotations

import hashlib
import json
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


def derived_idempotency_key(
    user_id: str, session_id: str | None, client_message_id: str | None, body: Any
) -> str:
    """Key for a request that sent no ``Idempotency-Key``: same intent, same key."""
    canonical = json.dumps(
        {"u": user_id, "s": session_id, "m": client_message_id, "b": body},
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
    )
    return "derived:" + hashlib.sha256(canonical.encode()).hexdigest()


def scoped_idempotency_key(user_id: str, key: str) -> str:
    """A client's key, scoped to its user so two users' keys can never collide."""
    digest = hashlib.sha256(f"{user_id}\x00{key}".encode()).hexdigest()
    return "client:" + digest
