"""Reading koda's Server-Sent Events: whole events out of bytes in any split.

One run event is one frame (docs/design.md §5): ``id: <seq>``, ``event: <kind>``,
``data: <JSON>``, a blank line; gateway/eventstream.py writes them. The parser lives in
the core so that the gateway (``koda runs follow``, its tests, the benches) and
``koda_runtime.client``, which imports nothing of the gateway, read them with one piece
of code.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from koda_runtime.lifecycle.chunks import TERMINAL_KINDS

# The gateway cut this viewer: reconnect with Last-Event-ID (a frame without ``id``).
RECONNECT = "reconnect"
TERMINAL = frozenset(k.value for k in TERMINAL_KINDS)


@dataclass(frozen=True)
class Event:
    """One event of a run: ``event`` its kind (chunk, reset, status, tool, done, error,
    cancelled), ``data`` its JSON text, ``id`` its seq (None on a frame without one)."""

    id: str | None
    event: str
    data: str

    @property
    def seq(self) -> int | None:
        return int(self.id) if self.id is not None and self.id.isdigit() else None

    @property
    def terminal(self) -> bool:
        return self.event in TERMINAL

    def json(self) -> Any:
        return json.loads(self.data)


class EventParser:
    """Incremental SSE parser (the HTML standard's field rules; LF or CRLF line ends).
    ``retry`` holds the last ``retry:`` value seen, in milliseconds."""

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
