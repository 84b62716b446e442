"""A small SSE client for tests: connect, read k events or all, resume."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import httpx

from koda_runtime.gateway.eventstream import TERMINAL_KINDS, Event, EventParser


@dataclass
class Stream:
    """What one connection gave: status, events, and whether the server ended it."""

    status: int
    events: list[Event] = field(default_factory=list)
    closed_by_server: bool = False
    comments: int = 0
    retry: int | None = None

    @property
    def terminal(self) -> bool:
        return any(e.event in TERMINAL_KINDS for e in self.events)


def bearer(user: str) -> dict[str, str]:
    return {"Authorization": f"Bearer dev:{user}"}


async def read_stream(
    client: httpx.AsyncClient,
    run_id: str,
    *,
    headers: dict[str, str] | None = None,
    params: dict[str, str] | None = None,
    last_event_id: int | None = None,
    max_events: int | None = None,
) -> Stream:
    """One connection to the run's events; stop after ``max_events`` events (disconnect)."""
    hdrs = dict(headers or {})
    if last_event_id is not None:
        hdrs["Last-Event-ID"] = str(last_event_id)
    async with client.stream(
        "GET", f"/v1/runs/{run_id}/events", headers=hdrs, params=params
    ) as response:
        result = Stream(response.status_code)
        if response.status_code != 200:
            await response.aread()
            return result
        parser = EventParser()
        async for chunk in response.aiter_bytes():
            result.comments += chunk.count(b"\n:") + chunk.startswith(b":")
            for event in parser.feed(chunk):
                result.events.append(event)
                if max_events is not None and len(result.events) >= max_events:
                    result.retry = parser.retry
                    return result
        result.retry = parser.retry
        result.closed_by_server = True
        return result


def contents(events: list[Event]) -> list[tuple[int | None, str, str]]:
    """``(seq, kind, content)`` of events (content from the JSON data)."""
    out = []
    for e in events:
        data: Any = json.loads(e.data) if e.data else {}
        out.append((e.seq, e.event, data.get("content", "") if isinstance(data, dict) else ""))
    return out


def numbered(items: list[tuple[int | None, str, str]]) -> list[tuple[int, str, str]]:
    """``contents`` of a run's stream, where every event carries its seq."""
    out = []
    for seq, kind, content in items:
        assert seq is not None, f"a {kind} event without a seq"
        out.append((seq, kind, content))
    return out


@dataclass
class Followed:
    """Everything a resuming client received over all its connections."""

    events: list[Event] = field(default_factory=list)
    connections: int = 0
    reconnect_hints: int = 0


async def follow_run(
    client: httpx.AsyncClient,
    run_id: str,
    *,
    headers: dict[str, str],
    after: int = -1,
    max_connections: int = 100,
) -> Followed:
    """Read the run to its end as a well-behaved client does: on ``reconnect`` or a cut
    stream, reconnect with Last-Event-ID. Only events with an id are kept."""
    out = Followed()
    last = after
    while out.connections < max_connections:
        out.connections += 1
        s = await read_stream(
            client, run_id, headers=headers, last_event_id=last if last >= 0 else None
        )
        if s.status == 204:
            return out
        assert s.status == 200, s.status
        for e in s.events:
            if e.event == "reconnect":
                out.reconnect_hints += 1
            elif e.seq is not None:
                assert e.seq == last + 1, f"seq {e.seq} after {last}"
                last = e.seq
                out.events.append(e)
        if s.terminal:
            return out
    raise AssertionError(f"run {run_id} not finished after {max_connections} connections")
