"""The Server-Sent Events wire format: the frames the gateway writes, and a client parser.

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

:class:`EventParser` is the client side (``koda runs follow``, tests, benchmarks):
feed it bytes in any split, it returns whole events.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from koda_runtime.lifecycle.chunks import TERMINAL_KINDS as TERMINAL_KINDS

MEDIA_TYPE = "text/event-stream"
RECONNECT = "reconnect"


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


@dataclass(frozen=True)
class Event:
    """One dispatched event: ``id`` is None when the frame had no ``id`` line."""

    id: str | None
    event: str
    data: str

    @property
    def seq(self) -> int | None:
        return int(self.id) if self.id is not None and self.id.isdigit() else None

    def json(self) -> Any:
        return json.loads(self.data)


class EventParser:
    """Incremental SSE parser (the HTML standard's field rules; LF or CRLF line ends).

    ``retry`` holds the last ``retry:`` value seen, in milliseconds.
    """

    def __init__(self) -> None:
        self._buffer = b""
        self._id: str | None = None
        self._event = ""
        self._data: list[str] = []
        self.retry: int | None = None

    def feed(self, chunk: bytes) -> list[Event]:
        """Parse ``chunk``; return the events it completed (possibly none)."""
        self._buffer += chunk
        events: list[Event] = []
        while True:
            end = self._buffer.find(b"\n")
            if end < 0:
                return events
            raw, self._buffer = self._buffer[:end], self._buffer[end + 1 :]
            line = raw[:-1] if raw.endswith(b"\r") else raw
            event = self._line(line.decode("utf-8", "replace"))
            if event is not None:
                events.append(event)

    def _line(self, line: str) -> Event | None:
        if not line:
            return self._dispatch()
        if line.startswith(":"):
            return None
        name, sep, value = line.partition(":")
        if sep and value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        elif name == "id" and "\0" not in value:
            self._id = value
        elif name == "retry" and value.isdigit():
            self.retry = int(value)
        return None

    def _dispatch(self) -> Event | None:
        event_id, kind, data = self._id, self._event or "message", self._data
        self._id, self._event, self._data = None, "", []
        if not data and event_id is None:
            return None
        return Event(event_id, kind, "\n".join(data))
