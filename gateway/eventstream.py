"""The Server-Sent Events wire format: the frames the gateway writes.

One run event is one frame (docs/design.md §5)::

    id: <seq>
    event: <kind>                    chunk, reset, status, done, error, cancelled
    data: <the run.chunk/1 JSON, on one line>
    <blank line>

Lines starting with ``:`` are comments (keep-alives); ``retry: <ms>`` tells a browser
how long to wait before reconnecting. Two frames carry no ``id`` (so a browser's
Last-Event-ID is left alone): ``event: reconnect`` (the gateway cut this viewer;
reconnect with Last-Event-ID) and a terminal kind for a run that ended without a
terminal event of its own.

:class:`EventParser` (koda/sse.py, re-exported here) reads them back: feed it bytes in
any split, it returns whole events.
"""

from __future__ import annotations

import json
from typing import Any

from koda_runtime.lifecycle.chunks import TERMINAL_KINDS as TERMINAL_KINDS
from koda_runtime.sse import RECONNECT as RECONNECT
from koda_runtime.sse import Event as Event
from koda_runtime.sse import EventParser as EventParser

MEDIA_TYPE = "text/event-stream"


def event_frame(seq: int | None, kind: str, data: bytes) -> bytes:
    """One event; ``data`` must be a single line (compact JSON is)."""
    if b"\n" in data or b"\r" in data:
        # Never expected from koda's own JSON; split rather than corrupt the stream.
        lines = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
        payload = b"".join(b"data: " + line + b"\n" for line in lines)
    else:
        payload = b"data: " + data + b"\n"
    head = b"" if seq is None else b"id: %d\n" % seq
    return head + b"event: " + kind.encode() + b"\n" + payload + b"\n"


def comment(text: str) -> bytes:
    """A comment line (ignored by clients; keeps proxies from timing the stream out)."""
    return b": " + text.encode() + b"\n\n"


def retry_frame(ms: int) -> bytes:
    """Tell a browser to wait ``ms`` milliseconds before reconnecting."""
    return b"retry: %d\n\n" % ms


def json_data(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()
