"""A run's Server-Sent Events as a benchmark's viewer reads them: each event's kind and
frame, stamped with the wall-clock time of the network read that completed it."""

from __future__ import annotations

import re
import time
from collections.abc import AsyncGenerator

import aiohttp

TERMINAL = {b"done", b"error", b"cancelled"}
_EVENT = re.compile(rb"event: ?(\w+)")


async def events(
    session: aiohttp.ClientSession, run_id: str, user: str
) -> AsyncGenerator[tuple[float, bytes, bytes], None]:
    """``(received_at, kind, frame)`` for every event of the run's stream, in order;
    keep-alive comments and retry hints are skipped."""
    buf = b""
    async with session.get(
        f"/v1/runs/{run_id}/events", headers={"Authorization": f"Bearer dev:{user}"}
    ) as r:
        if r.status != 200:
            raise AssertionError(f"SSE {run_id}: HTTP {r.status}: {await r.text()}")
        async for data in r.content.iter_any():
            now = time.time()
            buf += data
            *frames, buf = buf.split(b"\n\n")
            for frame in frames:
                m = _EVENT.search(frame)
                if m is not None:
                    yield now, m.group(1), frame
