"""``GET /v1/runs/{run_id}/events``: a run's events as Server-Sent Events (docs/design.md §5).

Order of work on every connection, whatever the timing:

1. subscribe to the live feed (from now on every record of the run is queued);
2. check the owner and read the run's status (404 for an unknown run or another
   user's; 204 when the run is over and the client already has its last event);
3. replay seq > n from Postgres (n from ``Last-Event-ID``, else ``?after=n``, else -1),
   page by page;
4. write live events with seq above the last one written; a live seq that skips ahead
   triggers a backfill from Postgres first.

The stream ends after the terminal event. Every ``sse_keepalive_s`` without a live
event the stream writes a comment and re-reads Postgres (which also closes streams of
runs that ended without a terminal event of their own). A viewer whose queue
overflows, or that does not take a write within ``sse_write_timeout_s``, is cut off:
it gets ``event: reconnect`` when it can still receive one, and resumes with
``Last-Event-ID`` from Postgres.

A run whose chunks expired (``KODA_CHUNK_RETENTION``, processors/retention.py) has one
``chunk`` row holding its whole output and its terminal event: a viewer gets those two.
A client resuming before that output row first gets an id-less ``reset``.

Authentication: ``Authorization: Bearer <token>``, or, because a browser's
``EventSource`` cannot set headers, ``?ticket=<ticket>`` from ``POST
/v1/runs/{run_id}/stream-ticket`` (60 s, this run and user only; gateway/auth.py), on
this endpoint only. ``?access_token=<token>`` is accepted in dev only. The request log
shows the route template, never the query string.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import MutableMapping
from contextvars import ContextVar
from typing import Any

from fastapi import APIRouter, Query, Request, Response

from koda_runtime import metrics, tracing
from koda_runtime.errors import DatabaseError, KodaError
from koda_runtime.gateway.bootstrap import Components
from koda_runtime.gateway.dependencies import Gateway, RunId, StreamUser, run_not_found
from koda_runtime.gateway.errors import BadRequest
from koda_runtime.gateway.eventstream import (
    MEDIA_TYPE,
    RECONNECT,
    comment,
    event_frame,
    json_data,
    retry_frame,
)
from koda_runtime.gateway.livefeed import Viewer
from koda_runtime.gateway.models import ErrorBody
from koda_runtime.gateway.quotas import StreamSlot, stream_slots
from koda_runtime.lifecycle.chunks import END_KIND, TERMINAL_KINDS, ChunkKind
from koda_runtime.lifecycle.states import RunStatus
from koda_runtime.schemas.runs.reads import StoredEvent
from koda_runtime.topics.records.codec import chunk_value

log = logging.getLogger(__name__)

REPLAY_PAGE = 500
MAX_SEQ = 2**31 - 1  # messages.seq is a Postgres integer

router = APIRouter()

Scope = MutableMapping[str, Any]


def resume_position(last_event_id: str | None, after: str | None) -> int:
    """The seq the client already has: ``Last-Event-ID`` wins over ``after``; -1 = none.

    An empty ``Last-Event-ID`` counts as absent. Anything else must be an integer in
    0..2^31-1, or the request is refused with 400 naming the parameter.
    """
    if last_event_id is not None and last_event_id.strip():
        return _seq_param(last_event_id, "Last-Event-ID")
    if after is not None:
        return _seq_param(after, "after")
    return -1


def _seq_param(raw: str, name: str) -> int:
    text = raw.strip()
    try:
        value = int(text)
    except ValueError:
        raise BadRequest(
            f"{name} must be a non-negative integer (the last seq received), got {raw[:40]!r}",
            field=name,
        ) from None
    if value < 0 or value > MAX_SEQ:
        raise BadRequest(f"{name} must be between 0 and {MAX_SEQ}, got {value}", field=name)
    return value


@router.get(
    "/v1/runs/{run_id}/events",
    response_class=Response,
    responses={
        200: {
            "content": {MEDIA_TYPE: {"schema": {"type": "string"}}},
            "description": "The run's events: `id:` seq, `event:` kind, `data:` JSON "
            "(run_id, seq, kind, content, attempt); closes after the terminal event.",
        },
        204: {"description": "The run is over and Last-Event-ID is its last event"},
        400: {"model": ErrorBody, "description": "Last-Event-ID or after is not a seq"},
        401: {"model": ErrorBody, "description": "Missing or invalid token"},
        404: {"model": ErrorBody, "description": "Unknown run (or another user's)"},
        429: {
            "model": ErrorBody,
            "description": "KODA_SSE_MAX_STREAMS_PER_USER or KODA_SSE_MAX_STREAMS streams "
            "are open (error.limit names which); see Retry-After",
        },
        503: {"model": ErrorBody, "description": "Postgres is unavailable; see Retry-After"},
    },
    openapi_extra={
        "parameters": [
            {
                "name": "Last-Event-ID",
                "in": "header",
                "required": False,
                "description": "Resume after this seq (sent by EventSource when it "
                "reconnects); wins over `after`.",
                "schema": {"type": "string"},
            }
        ]
    },
    summary="Stream a run's events (Server-Sent Events), resuming after Last-Event-ID",
)
async def run_events(
    request: Request,
    gw: Gateway,
    user_id: StreamUser,
    run_id: RunId,
    after: str | None = Query(
        None, description="Resume after this seq (when there is no Last-Event-ID header)."
    ),
) -> Response:
    position = resume_position(request.headers.get("last-event-id"), after)
    # A place among the streams open here (429 past a cap), held until the stream ends.
    slot = stream_slots(request).acquire(user_id)
    feed = gw.feed
    viewer = feed.subscribe(run_id, gw.settings.sse_queue_bytes)  # 1. before any read
    try:
        head = await gw.reads.stream_head(run_id, user_id)
        if head is None:
            raise run_not_found()
        if head.complete_through is not None and position >= head.complete_through:
            feed.unsubscribe(viewer)
            slot.release()
            # 204 tells an EventSource to stop reconnecting: there is nothing left.
            return Response(status_code=204)
    except BaseException:
        feed.unsubscribe(viewer)
        slot.release()
        raise
    return RunEventStream(
        gw=gw,
        viewer=viewer,
        after=position,
        user_id=user_id,
        slot=slot,
        trace=(head.traceparent, request.headers.get(tracing.HEADER)),
    )


def _viewer_span(run_id: str, after: int, run_trace: str | None, own: str | None) -> tracing.Span:
    """A viewer's connection as a span (koda/tracing.py): in the viewer's own trace (a
    client's ``traceparent``, else a new one), linked to the run's trace."""
    if not tracing.ON:
        return tracing.INVALID_SPAN
    return tracing.start(
        "GET /v1/runs/{run_id}/events",
        kind=tracing.SpanKind.SERVER,
        parent=own,
        links=tracing.links_to(run_trace),
        attributes={"koda.run_id": run_id, "koda.sse.after": after},
    )


class _Stalled(KodaError):
    """A write did not complete within the write timeout: the client stopped reading."""


# Set in the request's task when a stalled viewer is cut (see StalledStreamLogFilter).
_CUT_STALLED: ContextVar[bool] = ContextVar("koda_sse_cut_stalled", default=False)


class StalledStreamLogFilter(logging.Filter):
    """Lowers uvicorn's ERROR for streams koda cut because the client stopped reading.

    Such a stream cannot write its last chunk (the peer reads nothing), so uvicorn logs
    "ASGI callable returned without completing response" at ERROR. The cut is expected
    and koda logs it itself (``event=sse_viewer_cut reason=stalled``); for those
    requests only, uvicorn's line becomes INFO. Install on the ``uvicorn.error`` logger.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR and _CUT_STALLED.get():
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


class RunEventStream(Response):
    """The streaming response of one viewer (an ASGI callable, like StreamingResponse)."""

    media_type = MEDIA_TYPE

    def __init__(
        self,
        *,
        gw: Components,
        viewer: Viewer,
        after: int,
        user_id: str,
        slot: StreamSlot | None = None,
        trace: tuple[str | None, str | None] = (None, None),
    ) -> None:
        self.status_code = 200
        self.background = None
        self.init_headers(
            {
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",  # no buffering in reverse proxies
            }
        )
        self.gw, self.settings = gw, gw.settings
        self.feed, self.viewer = gw.feed, viewer
        self.run_id = viewer.run_id
        self.user_id = user_id
        self.last = after
        self.slot = slot
        self._send: Any = None
        # The run's traceparent (the viewer's span links to it) and the viewer's own.
        self.trace = trace

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        metrics.SSE_CONNECTIONS.inc()
        self._send = send
        watcher: asyncio.Task[None] | None = None
        span = _viewer_span(self.run_id, self.last, *self.trace)
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            watcher = asyncio.create_task(self._watch_disconnect(receive))
            await self._write(retry_frame(self.settings.sse_retry_ms) + comment("stream open"))
            await self._stream()
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except _Stalled:
            metrics.SSE_VIEWERS_CUT.labels(reason="stalled").inc()
            self._log_cut("stalled")
            _CUT_STALLED.set(True)
        except OSError:
            pass  # the client went away mid-write
        finally:
            if watcher is not None:
                watcher.cancel()
            self.feed.unsubscribe(self.viewer)
            if self.slot is not None:
                self.slot.release()
            metrics.SSE_CONNECTIONS.dec()
            if span.is_recording():
                span.set_attribute("koda.sse.last_seq", self.last)
                span.end()

    async def _watch_disconnect(self, receive: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.viewer.cut_off("disconnected")
                return

    async def _write(self, body: bytes) -> None:
        try:
            async with asyncio.timeout(self.settings.sse_write_timeout_s):
                await self._send({"type": "http.response.body", "body": body, "more_body": True})
        except TimeoutError:
            raise _Stalled from None

    async def _stream(self) -> None:
        try:
            await self._reset_if_expired()
            if await self._catch_up("replay"):
                return
            await self._follow_live()
        except DatabaseError as exc:
            # Mid-stream there is no status code left to answer with: ask for a reconnect.
            log.warning("event=sse_database_error run_id=%s error=%s", self.run_id, exc)
            await self._write(self._reconnect_frame("unavailable"))

    async def _follow_live(self) -> None:
        viewer, keepalive = self.viewer, self.settings.sse_keepalive_s
        while True:
            batch = await viewer.next_batch(keepalive)
            if viewer.cut == "disconnected":
                return
            if viewer.cut is not None:
                metrics.SSE_VIEWERS_CUT.labels(reason=viewer.cut).inc()
                self._log_cut(viewer.cut)
                await self._write(self._reconnect_frame(viewer.cut))
                return
            if not batch:
                await self._write(comment("keep-alive"))
                if await self._catch_up("idle"):
                    return
                continue
            out = bytearray()
            written = 0
            ended = False
            for event in batch:
                if event.seq <= self.last:
                    continue
                if event.seq > self.last + 1:
                    if out:
                        await self._write(bytes(out))
                        metrics.SSE_EVENTS.labels(source="live").inc(written)
                        out.clear()
                        written = 0
                    if await self._catch_up("gap"):
                        return
                    if event.seq != self.last + 1:
                        continue  # already written by the backfill
                out += event.frame
                written += 1
                self.last = event.seq
                if event.terminal:
                    ended = True
                    break
            if out:
                await self._write(bytes(out))
                metrics.SSE_EVENTS.labels(source="live").inc(written)
            if ended:
                return

    async def _catch_up(self, reason: str) -> bool:
        """Write every stored event after ``self.last``; True when the stream has ended."""
        if reason != "replay":
            metrics.SSE_BACKFILLS.labels(reason=reason).inc()
        reads = self.gw.reads
        while True:
            status, events = await reads.events_after(self.run_id, self.last, REPLAY_PAGE)
            if events:
                ended = await self._write_stored(events)
                if ended:
                    return True
            if len(events) < REPLAY_PAGE:
                if status is None or not status.terminal:
                    return False
                # Terminal, and every event was committed before that status: nothing
                # more will come. Either the client already has the terminal event (it
                # resumed past it), or the run ended without one: say how it ended.
                if await reads.terminal_seq(self.run_id) is None:
                    await self._write(self._end_frame(status))
                return True

    async def _write_stored(self, events: list[StoredEvent]) -> bool:
        out = bytearray()
        written = 0
        ended = False
        for e in events:
            data = chunk_value(self.run_id, e.seq, e.kind, e.content, e.attempt)
            out += event_frame(e.seq, e.kind, data)
            written += 1
            self.last = e.seq
            if e.kind in TERMINAL_KINDS:
                ended = True
                break
        await self._write(bytes(out))
        metrics.SSE_EVENTS.labels(source="replay").inc(written)
        return ended

    async def _reset_if_expired(self) -> None:
        """A client resuming inside a run whose chunks expired holds part of an answer
        that is now stored as one event holding all of it: tell it to drop what it has
        (an id-less ``reset``) before that event."""
        if self.last < 0:
            return
        output_seq = await self.gw.reads.expired_output_seq(self.run_id)
        if output_seq is not None and self.last < output_seq:
            data = json_data({"run_id": self.run_id, "kind": "reset", "reason": "expired"})
            await self._write(event_frame(None, ChunkKind.RESET.value, data))

    def _end_frame(self, status: RunStatus) -> bytes:
        data = json_data({"run_id": self.run_id, "status": status.value})
        return event_frame(None, END_KIND.get(status, ChunkKind.DONE).value, data)

    def _reconnect_frame(self, reason: str) -> bytes:
        data = json_data({"run_id": self.run_id, "reason": reason, "last_event_id": self.last})
        return event_frame(None, RECONNECT, data)

    def _log_cut(self, reason: str) -> None:
        log.info(
            "event=sse_viewer_cut reason=%s run_id=%s user_id=%s last_seq=%d",
            reason,
            self.run_id,
            self.user_id,
            self.last,
        )
