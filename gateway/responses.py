"""A subset of OpenAI's Responses API over koda's runs, for the official OpenAI SDKs.

``POST /v1/responses`` creates a run (gateway/admission.py, like ``POST /v1/runs``);
``GET /v1/responses/{id}`` reads it, ``?stream=true&starting_after=N`` streams its events
after N; ``POST /v1/responses/{id}/cancel`` is koda's cancel. Owner-only: another user's
response answers the 404 of an unknown one. Every refusal has OpenAI's error shape
``{"error": {"message", "type", "param", "code"}}``, ``param`` naming the field. The
mapping (ids, statuses, sequence numbers) is gateway/responses_wire.py's and
docs/design.md §9's.

* ``background`` changes only whether a create that does not stream waits for the end:
  every response is durable, resumable and cancellable, and kept as long as its run.
* ``previous_response_id`` continues that response's conversation (koda's session): it
  must be the latest response of its conversation, and ended. koda conversations are
  linear; a branch from an older response, or a second response started while one is
  running, would otherwise be merged into the running run (docs/design.md §12).
* Without an ``Idempotency-Key`` header every create is a new response, as with OpenAI;
  with one, the same key answers the same response.

The stream follows ``sse.py``'s order of work: subscribe to the live feed, check the
owner, replay the run's events from Postgres (always from seq 0: the numbering is
computed, never stored), then write live ones, backfilling a skipped seq. A viewer cut
off (overflow, shutdown) or a database error mid-stream ends the stream without a last
event; the client resumes with ``starting_after``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from koda_runtime import metrics
from koda_runtime.caps import CapReached
from koda_runtime.errors import DatabaseError, KodaError, Refused
from koda_runtime.gateway import control
from koda_runtime.gateway.auth import authenticate_request
from koda_runtime.gateway.bootstrap import Components
from koda_runtime.gateway.errors import DOMAIN_ERRORS, GatewayError, http_error
from koda_runtime.gateway.eventstream import MEDIA_TYPE, EventParser, comment
from koda_runtime.gateway.intake import (
    check_content_type,
    check_idempotency_key,
    decode_json,
    parse_run_request,
)
from koda_runtime.gateway.livefeed import Viewer
from koda_runtime.gateway.quotas import (
    ClientGone,
    StreamSlot,
    limit_reached,
    read_body_within,
    stream_slots,
)
from koda_runtime.gateway.responses_wire import (
    EventNumbering,
    RequestError,
    error_body,
    parse_create,
    response_id,
    response_object,
    run_id_of,
    served_model,
    sse_frame,
)
from koda_runtime.gateway.submit import take_rate_token
from koda_runtime.lifecycle.chunks import END_KIND, TERMINAL_KINDS, ChunkKind
from koda_runtime.lifecycle.ids import uuid7
from koda_runtime.lifecycle.states import RunStatus
from koda_runtime.schemas.runs.control import MergeCaps
from koda_runtime.schemas.runs.reads import RunState

log = logging.getLogger(__name__)

router = APIRouter()

REPLAY_PAGE = 500
# How long a cancel waits for the worker to end a running run before it answers with
# the response as it stands (still in_progress; the run ends cancelled soon after).
CANCEL_WAIT_S = 10.0
# How often a waiting create or cancel re-reads Postgres without a live event.
WAIT_TICK_S = 1.0
QUERY_PARAMS = ("stream", "starting_after", "include_obfuscation")

Scope = MutableMapping[str, Any]

# --- errors in OpenAI's shape -------------------------------------------------------------


def _openai_error(exc: Exception) -> JSONResponse:
    """The answer to a refusal: OpenAI's shape, the status and headers koda gives it."""
    if isinstance(exc, RequestError):
        body = error_body(exc.message, param=exc.param, code=exc.code, status=exc.status)
        return JSONResponse(body, status_code=exc.status)
    if isinstance(exc, CapReached):
        exc = limit_reached(exc)
    refusal = http_error(exc) if isinstance(exc, KodaError) else None
    if refusal is None:  # pragma: no cover - only answered errors reach here
        raise exc
    body = error_body(
        refusal.message, param=refusal.field, code=refusal.code, status=refusal.status
    )
    return JSONResponse(body, status_code=refusal.status, headers=refusal.headers)


_ANSWERED: tuple[type[Exception], ...] = (RequestError, GatewayError, CapReached, *DOMAIN_ERRORS)


async def _answered(work: Callable[[], Awaitable[Response]]) -> Response:
    try:
        return await work()
    except DatabaseError as exc:
        log.warning("event=database_unavailable route=responses error=%s", exc)
        return _openai_error(exc)
    except _ANSWERED as exc:
        return _openai_error(exc)


def _not_found(resp_id: str) -> RequestError:
    return RequestError(
        f"no response with id {resp_id[:160]!r}: check the id and the token's user",
        param="response_id",
        code="not_found",
        status=404,
    )


# --- reads -------------------------------------------------------------------------------


def _model_of(settings: Any) -> str:
    return served_model(settings.handler, settings.openai_model)


async def read_state(gw: Components, run_id: str, user_id: str) -> RunState | None:
    """The run as its response shows it, if it is ``user_id``'s; None otherwise."""
    return await gw.reads.response_state(run_id, user_id, _model_of(gw.settings))


async def _owned_state(gw: Components, resp_id: str, user_id: str) -> RunState:
    run_id = run_id_of(resp_id)
    state = None if run_id is None else await read_state(gw, run_id, user_id)
    if state is None:
        raise _not_found(resp_id)
    return state


async def wait_until_ended(
    gw: Components,
    run_id: str,
    user_id: str,
    *,
    timeout_s: float | None,
    request: Request | None = None,
) -> RunState | None:
    """The run's state once it is terminal; the state as it stands after ``timeout_s``
    (None: no limit), or when ``request``'s client has gone. Wakes on the run's live
    events and re-reads Postgres every WAIT_TICK_S in any case."""
    loop = asyncio.get_running_loop()
    deadline = None if timeout_s is None else loop.time() + timeout_s
    viewer = gw.feed.subscribe(run_id, gw.settings.sse_queue_bytes)
    try:
        while True:
            state = await read_state(gw, run_id, user_id)
            if state is None or RunStatus(state.status).terminal:
                return state
            left = WAIT_TICK_S if deadline is None else min(WAIT_TICK_S, deadline - loop.time())
            if left <= 0 or (request is not None and await request.is_disconnected()):
                return state
            await viewer.next_batch(left)
            if viewer.cut is not None:  # a full queue or a shutdown: keep reading Postgres
                gw.feed.unsubscribe(viewer)
                viewer = gw.feed.subscribe(run_id, gw.settings.sse_queue_bytes)
    finally:
        gw.feed.unsubscribe(viewer)


# --- create ------------------------------------------------------------------------------


@router.post("/v1/responses", summary="Create a response (OpenAI Responses API subset)")
async def create_response(request: Request) -> Response:
    gw: Components = request.app.state.components
    return await _answered(lambda: _create(request, gw))


async def _create(request: Request, gw: Components) -> Response:
    user_id = authenticate_request(request, gw.auth)
    take_rate_token(gw, user_id)
    check_content_type(request.headers.get("content-type"))
    client_key = check_idempotency_key(request.headers.getlist("idempotency-key"))
    try:
        body = await read_body_within(
            request, gw.settings.body_limit_bytes, gw.settings.body_read_timeout_s
        )
    except ClientGone:
        raise RequestError("the client disconnected before sending the whole body") from None
    asked = parse_create(decode_json(body), _model_of(gw.settings))
    session_id = None
    if asked.previous_response_id is not None:
        session_id = await _conversation_of(gw, asked.previous_response_id, user_id)
    try:
        run_request = parse_run_request(
            {
                "input": asked.run_input,
                "metadata": asked.metadata,
                "session_id": session_id,
                # A new message every time unless the client sends Idempotency-Key.
                "client_message_id": None if client_key else uuid7(),
            }
        )
    except GatewayError as exc:
        raise RequestError(exc.message, param=exc.field) from None
    try:
        run = await gw.admissions.submit(
            user_id, run_request, client_key, merge_caps=MergeCaps.of(gw.settings)
        )
    except (GatewayError, Refused, CapReached, DatabaseError) as exc:
        reason = "unavailable" if isinstance(exc, DatabaseError) else _code(exc)
        metrics.ADMISSIONS_REJECTED.labels(reason=reason).inc()
        raise
    if run.merged:
        # Two responses started at once in one conversation: koda merged this input into
        # the other's running run, which answers both.
        raise RequestError(
            f"another response of this conversation, {response_id(run.run_id)}, started at "
            "the same time and took this input; follow that response",
            param="previous_response_id",
            code="conversation_busy",
            status=409,
        )
    log.info(
        "event=response_created run_id=%s user_id=%s stream=%s background=%s",
        run.run_id,
        user_id,
        asked.stream,
        asked.background,
    )
    if asked.stream:
        return await open_stream(request, gw, run.run_id, user_id, after=-1)
    if asked.background:
        state = await read_state(gw, run.run_id, user_id)
    else:
        state = await wait_until_ended(gw, run.run_id, user_id, timeout_s=None, request=request)
    if state is None:  # pragma: no cover - the run was just admitted for this user
        raise _not_found(response_id(run.run_id))
    return JSONResponse(response_object(state))


def _code(exc: Exception) -> str:
    if isinstance(exc, CapReached):
        return exc.quota
    return http_error(exc).code if isinstance(exc, KodaError) else "error"


async def _conversation_of(gw: Components, previous: str, user_id: str) -> str:
    """The session a new response continues: ``previous``'s, which must be the latest
    response of its conversation and ended."""
    run_id = run_id_of(previous)
    state = None if run_id is None else await read_state(gw, run_id, user_id)
    if state is None:
        raise RequestError(
            f"previous response {previous[:160]!r} not found: check the id and the token's user",
            param="previous_response_id",
            code="previous_response_not_found",
        )
    if not RunStatus(state.status).terminal:
        raise RequestError(
            f"previous response {previous} is still in progress: wait for it to end (or "
            "cancel it) before continuing its conversation",
            param="previous_response_id",
            code="previous_response_in_progress",
        )
    latest = await gw.control.list_runs(
        user_id, session_id=state.session_id, status=None, limit=1, before=None
    )
    if latest and latest[0].run_id != state.run_id:
        raise RequestError(
            f"previous response {previous} is not the latest of its conversation: koda "
            f"conversations are linear; continue from {response_id(latest[0].run_id)}",
            param="previous_response_id",
            code="previous_response_not_latest",
        )
    return state.session_id


# --- retrieve, cancel --------------------------------------------------------------------


@router.get("/v1/responses/{resp_id}", summary="Read a response, or stream its events")
async def get_response(resp_id: str, request: Request) -> Response:
    gw: Components = request.app.state.components
    return await _answered(lambda: _retrieve(request, gw, resp_id))


async def _retrieve(request: Request, gw: Components, resp_id: str) -> Response:
    user_id = authenticate_request(request, gw.auth)
    stream, after = _stream_query(request.query_params)
    if stream:
        run_id = run_id_of(resp_id)
        if run_id is None:
            raise _not_found(resp_id)
        return await open_stream(request, gw, run_id, user_id, after=after)
    return JSONResponse(response_object(await _owned_state(gw, resp_id, user_id)))


def _stream_query(params: Mapping[str, str]) -> tuple[bool, int]:
    """``stream`` and ``starting_after`` (-1: from the start); RequestError naming a
    parameter koda does not take or a bad value."""
    for name in params:
        if name not in QUERY_PARAMS:
            raise RequestError(
                f"koda does not support the query parameter {name[:64]!r}; supported: "
                f"{', '.join(QUERY_PARAMS)}",
                param=name[:64],
                code="unsupported_parameter",
            )
    raw = params.get("stream", "false").lower()
    if raw not in ("true", "false"):
        raise RequestError("stream must be true or false", param="stream")
    if params.get("include_obfuscation", "false").lower() != "false":
        raise RequestError(
            "koda never obfuscates streams: include_obfuscation must be false",
            param="include_obfuscation",
            code="unsupported_parameter",
        )
    stream = raw == "true"
    after = -1
    if "starting_after" in params:
        if not stream:
            raise RequestError("starting_after needs stream=true", param="starting_after")
        text_value = params["starting_after"]
        if not text_value.isdigit() or len(text_value) > 12:
            raise RequestError(
                "starting_after must be a sequence number (a non-negative integer)",
                param="starting_after",
            )
        after = int(text_value)
    return stream, after


@router.post("/v1/responses/{resp_id}/cancel", summary="Cancel a response (koda's run cancel)")
async def cancel_response(resp_id: str, request: Request) -> Response:
    gw: Components = request.app.state.components
    return await _answered(lambda: _cancel(request, gw, resp_id))


async def _cancel(request: Request, gw: Components, resp_id: str) -> Response:
    user_id = authenticate_request(request, gw.auth)
    state = await _owned_state(gw, resp_id, user_id)
    if not RunStatus(state.status).terminal:
        # koda's own cancel, its writes, signal and metrics (gateway/control.py).
        await control.cancel_run(request=request, gw=gw, user_id=user_id, run_id=state.run_id)
        ended = await wait_until_ended(gw, state.run_id, user_id, timeout_s=CANCEL_WAIT_S)
        state = ended or state
    return JSONResponse(response_object(state))


# --- the stream --------------------------------------------------------------------------


async def open_stream(
    request: Request, gw: Components, run_id: str, user_id: str, *, after: int
) -> Response:
    """The run's Responses events after sequence number ``after`` (-1: all)."""
    slot = stream_slots(request).acquire(user_id)
    viewer = gw.feed.subscribe(run_id, gw.settings.sse_queue_bytes)  # before any read
    try:
        state = await read_state(gw, run_id, user_id)
        if state is None:
            raise _not_found(response_id(run_id))
    except BaseException:
        gw.feed.unsubscribe(viewer)
        slot.release()
        raise
    numbering = EventNumbering(run_id, response_object(state))
    return ResponseEventStream(
        gw=gw, viewer=viewer, slot=slot, numbering=numbering, after=after, user_id=user_id
    )


class _Stalled(KodaError):
    """A write did not complete within the write timeout: the client stopped reading."""


class ResponseEventStream(Response):
    """One client's stream of a response's events (an ASGI callable)."""

    media_type = MEDIA_TYPE

    def __init__(
        self,
        *,
        gw: Components,
        viewer: Viewer,
        slot: StreamSlot,
        numbering: EventNumbering,
        after: int,
        user_id: str,
    ) -> None:
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.gw, self.settings = gw, gw.settings
        self.viewer, self.slot = viewer, slot
        self.run_id = viewer.run_id
        self.user_id = user_id
        self.numbering = numbering
        self.after = after  # the client's starting_after: events up to it are not written
        self.last = -1  # the koda seq fed last
        self._send: Any = None

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        metrics.SSE_CONNECTIONS.inc()
        self._send = send
        watcher: asyncio.Task[None] | None = None
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            watcher = asyncio.create_task(self._watch_disconnect(receive))
            await self._write(self._frames(self.numbering.created()) or comment("stream open"))
            try:
                if not await self._catch_up():
                    await self._follow_live()
            except DatabaseError as exc:
                log.warning("event=responses_stream_database_error run_id=%s error=%s",
                            self.run_id, exc)  # fmt: skip
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except _Stalled:
            metrics.SSE_VIEWERS_CUT.labels(reason="stalled").inc()
        except OSError:
            pass  # the client went away mid-write
        finally:
            if watcher is not None:
                watcher.cancel()
            self.gw.feed.unsubscribe(self.viewer)
            self.slot.release()
            metrics.SSE_CONNECTIONS.dec()

    async def _watch_disconnect(self, receive: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.viewer.cut_off("disconnected")
                return

    async def _write(self, body: bytes) -> None:
        if not body:
            return
        try:
            async with asyncio.timeout(self.settings.sse_write_timeout_s):
                await self._send({"type": "http.response.body", "body": body, "more_body": True})
        except TimeoutError:
            raise _Stalled from None

    def _frames(self, events: list[dict[str, Any]]) -> bytes:
        return b"".join(sse_frame(e) for e in events if e["sequence_number"] > self.after)

    async def _feed(self, seq: int, kind: str, content: str) -> tuple[bytes, bool]:
        """The frames of koda event ``seq``, and whether it ended the run."""
        self.last = seq
        if kind in TERMINAL_KINDS:
            return await self._end(), True
        return self._frames(self.numbering.feed(kind, content)), False

    async def _end(self) -> bytes:
        state = await read_state(self.gw, self.run_id, self.user_id)
        if state is None:  # deleted meanwhile: nothing true is left to say
            return b""
        return self._frames(self.numbering.end(response_object(state)))

    async def _catch_up(self) -> bool:
        """Write every stored event after ``self.last``; True when the stream has ended."""
        reads = self.gw.reads
        while True:
            status, events = await reads.events_after(self.run_id, self.last, REPLAY_PAGE)
            out = bytearray()
            for e in events:
                frames, ended = await self._feed(e.seq, e.kind, e.content)
                out += frames
                if ended:
                    await self._write(bytes(out))
                    return True
            await self._write(bytes(out))
            if len(events) < REPLAY_PAGE:
                if status is None or not status.terminal:
                    return False
                # Terminal, and every event was committed before that status, yet none
                # ended it: end the stream as the run ended.
                kind = END_KIND.get(status, ChunkKind.DONE).value
                frames, _ = await self._feed(self.last + 1, kind, "")
                await self._write(frames)
                return True

    async def _follow_live(self) -> None:
        viewer, keepalive = self.viewer, self.settings.sse_keepalive_s
        while True:
            batch = await viewer.next_batch(keepalive)
            if viewer.cut is not None:
                return  # disconnected, or cut off: the client resumes with starting_after
            if not batch:
                await self._write(comment("keep-alive"))
                if await self._catch_up():
                    return
                continue
            out = bytearray()
            for event in batch:
                if event.seq <= self.last:
                    continue
                if event.seq > self.last + 1:
                    await self._write(bytes(out))
                    out.clear()
                    if await self._catch_up():
                        return
                    if event.seq != self.last + 1:
                        continue  # already written by the backfill
                frames, ended = await self._feed(event.seq, event.kind, _content(event.frame))
                out += frames
                if ended:
                    await self._write(bytes(out))
                    return
            await self._write(bytes(out))


def _content(frame: bytes) -> str:
    """The ``content`` of a live event's koda frame (its ``run.chunk/1`` JSON)."""
    parsed = EventParser().feed(frame)
    value = parsed[0].json() if parsed else {}
    content = value.get("content") if isinstance(value, dict) else None
    return content if isinstance(content, str) else ""
