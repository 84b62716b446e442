"""``worker.heartbeat/1``: one worker's beat on ``<env>.koda.workers`` (key = worker_id).

The topic is compacted, so it holds the latest beat of every worker. A null value
(a tombstone) means the worker left gracefully; compaction then forgets it. A
worker that stops beating without a tombstone is lost, and shows as stale.

Value (UTF-8 JSON)::

    {"worker_id": "w-1", "beat_at": "2025-01-01T00:00:00.000+00:00", "in_flight": 2,
     "version": "0.1.0", "partitions": [0, 5], "host": "node-a", "pid": 4242,
     "instance": "9f2c51d07a3e4b18"}

``pid`` and ``instance`` came later and are optional: older workers' beats lack them
and still decode (``pid`` None, ``instance`` empty). ``instance`` is drawn once per
process, so two live processes beating under one worker id can be told apart.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from koda_runtime.errors import RecordError
from koda_runtime.topics.records import formats as spec
from koda_runtime.topics.records.codec import HEARTBEAT, Headers, dumps, headers_for

__all__ = ["HEARTBEAT", "Beat", "beat_headers", "decode_beat"]


@dataclass(frozen=True)
class Beat:
    """One heartbeat. ``beat_at`` is the worker's wall clock, timezone-aware UTC."""

    worker_id: str
    beat_at: datetime
    in_flight: int
    version: str
    partitions: tuple[int, ...]
    host: str
    pid: int | None = None
    instance: str = ""

    def encode(self) -> bytes:
        values = (
            self.worker_id,
            self.beat_at.astimezone(UTC).isoformat(timespec="milliseconds"),
            self.in_flight,
            self.version,
            list(self.partitions),
            self.host,
            self.pid,
            self.instance or None,
        )
        fields = zip(spec.HEARTBEAT.names, values, strict=True)
        return dumps(spec.HEARTBEAT.value({k: v for k, v in fields if v is not None}))

    @property
    def who(self) -> str:
        """``host/pid`` (``host`` alone for an older worker's beat), for messages."""
        return self.host if self.pid is None else f"{self.host}/{self.pid}"


def beat_headers() -> Headers:
    return headers_for(HEARTBEAT)


def decode_beat(key: bytes | None, value: bytes | None) -> Beat | None:
    """Decode one workers-topic record; None for a tombstone.

    Raises RecordError for anything else that is not a valid beat of the same worker
    as the key.
    """
    if value is None:
        return None
    if key is None:
        raise RecordError("null_key", "heartbeat has no key; the key is the worker id")
    try:
        obj: Any = json.loads(value.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RecordError("undecodable", f"heartbeat is not UTF-8 JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise RecordError("invalid", "heartbeat is not a JSON object")
    worker_id = obj.get("worker_id")
    if not isinstance(worker_id, str) or worker_id != key.decode("utf-8", "replace"):
        raise RecordError("key_mismatch", "heartbeat worker_id is not the record key")
    try:
        beat_at = datetime.fromisoformat(str(obj["beat_at"]))
        in_flight = int(obj.get("in_flight", 0))
        partitions = tuple(sorted(int(p) for p in obj.get("partitions") or ()))
        pid = None if obj.get("pid") is None else int(obj["pid"])
    except (KeyError, TypeError, ValueError) as exc:
        raise RecordError("invalid", f"heartbeat field is invalid: {exc}") from None
    if beat_at.tzinfo is None:
        beat_at = beat_at.replace(tzinfo=UTC)
    return Beat(
        worker_id=worker_id,
        beat_at=beat_at,
        in_flight=in_flight,
        version=str(obj.get("version") or "unknown"),
        partitions=partitions,
        host=str(obj.get("host") or ""),
        pid=pid,
        instance=str(obj.get("instance") or "")[:64],
    )
