"""The Vercel AI SDK's ``useChat`` against koda: its UI message stream protocol (v1).

Three routes (docs/design.md §9 has the rules users rely on):

* ``POST /v1/chat``: ``DefaultChatTransport``'s request (``{id, messages, trigger,
  messageId?}``, or ``{id, message}`` from a ``prepareSendMessagesRequest`` that sends
  the last message only). The chat id is a koda session of the token's user (created by
  the first message; another user's is 404), the last user message becomes a run with
  the session's rules (its earlier turns, a merge into the running run within the merge
  window), and the answer is that run's stream as UI message parts.
* ``GET /v1/chat/{id}/stream``: the transport's reconnect URL (``${api}/${id}/stream``):
  the chat's active run streamed from the start of its current answer, or 204.
* ``DELETE /v1/chat/{id}/stream``: stop. ``useChat``'s ``stop()`` only aborts the fetch,
  and a disconnect never cancels a run (a reload disconnects too), so a page's stop
  button calls this as well; it cancels the chat's active run like ``POST
  /v1/runs/{id}/cancel``.

The stream is :class:`~koda_runtime.gateway.sse.RunEventStream` (live feed first, then
replay, then live with gap backfill: no gap, no repeat) with its frames translated by
:class:`UIParts`, a pure function of the run's events in seq order.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Query, Request, Response, Security

from koda_runtime import metrics
from koda_runtime.caps import CapReached
from koda_runtime.errors import DatabaseError, Refused, SessionNotOwned
from koda_runtime.gateway.auth import BEARER, authenticate_request
from koda_runtime.gateway.bootstrap import Components
from koda_runtime.gateway.control import cancel_run
from koda_runtime.gateway.dependencies import Gateway, User
from koda_runtime.gateway.errors import (
    GatewayError,
    InvalidField,
    NotFound,
    http_error,
)
from koda_runtime.gateway.eventstream import RECONNECT, EventParser, comment
from koda_runtime.gateway.intake import (
    CLIENT_MESSAGE_ID,
    SESSION_ID,
    RunRequest,
    check_content_type,
    decode_json,
    json_object,
    json_type,
    parse_run_request,
)
from koda_runtime.gateway.models import error_responses
from koda_runtime.gateway.quotas import limit_reached, read_body_within, stream_slots
from koda_runtime.gateway.sse import RunEventStream
from koda_runtime.gateway.submit import take_rate_token
from koda_runtime.lifecycle.chunks import ChunkKind
from koda_runtime.lifecycle.states import RunStatus
from koda_runtime.schemas.runs.control import MergeCaps

log = logging.getLogger(__name__)

router = APIRouter()

PROTOCOL_HEADER = "x-vercel-ai-ui-message-stream"
PROTOCOL_VERSION = "v1"
DONE_FRAME = b"data: [DONE]\n\n"
FIELDS = ("id", "messages", "message", "trigger", "messageId", "metadata", "input")
SUBMIT = "submit-message"

_ERRORS = error_responses(
    {
        400: "Undecodable body",
        401: "Missing or invalid bearer token",
        402: "Over the user's budget",
        404: "Unknown chat (or another user's)",
        409: "A merge into the running run is over a cap (error.limit names it)",
        413: "Body larger than KODA_BODY_LIMIT",
        415: "Body is not application/json",
        422: "A field is missing or invalid (error.field names it)",
        429: "Over the rate, the active-run cap or the open-stream caps; see Retry-After",
        503: "Postgres is unavailable; see Retry-After",
    }
)
_STREAM_200 = {
    "content": {"text/event-stream": {"schema": {"type": "string"}}},
    "description": "The run as UI message stream parts (`x-vercel-ai-ui-message-stream: v1`), "
    "ending with `data: [DONE]`.",
}


# --- the request ------------------------------------------------------------------------


@dataclass(frozen=True)
class ChatRequest:
    """A validated ``POST /v1/chat`` body: what the run is made of."""

    chat_id: str
    text: str
    message_id: str
    metadata: dict[str, Any] | None = None
    extra_input: dict[str, Any] | None = None

    def run_request(self) -> RunRequest:
        """The run: the message's text (plus ``input``'s fields) in the chat's session,
        its idempotency key derived from the message id (a resend is the same run)."""
        body: dict[str, Any] = {
            "session_id": self.chat_id,
            "input": {**(self.extra_input or {}), "text": self.text},
            "client_message_id": self.message_id,
        }
        if self.metadata is not None:
            body["metadata"] = self.metadata
        return parse_run_request(body)  # the same checks as POST /v1/runs


def parse_chat_request(obj: Any) -> ChatRequest:
    """Validate ``useChat``'s body; InvalidField (422) names the field at fault.

    Only the last message is read: koda's session holds the conversation, so earlier
    messages the client sends are not taken from it (they cannot rewrite history).
    """
    obj = json_object(obj, FIELDS)
    chat_id = obj.get("id")
    if not isinstance(chat_id, str) or not SESSION_ID.fullmatch(chat_id):
        raise InvalidField(
            "id (the chat id, koda's session id) must be 1-128 chars of A-Z a-z 0-9 . _ : @ -",
            field="id",
        )
    trigger = obj.get("trigger", SUBMIT)
    if trigger != SUBMIT:
        raise InvalidField(
            f"trigger {str(trigger)[:40]!r} is not supported: koda keeps every answer of the "
            f"chat, so send the message again (trigger {SUBMIT!r})",
            field="trigger",
        )
    if obj.get("messageId") is not None:
        raise InvalidField(
            "messageId is set: editing a sent message is not supported (koda's session "
            "keeps what was said); send a new message",
            field="messageId",
        )
    if "message" in obj and "messages" in obj:
        raise InvalidField("send either message or messages, not both", field="message")
    if "message" in obj:
        message, where = obj["message"], "message"
    else:
        messages = obj.get("messages")
        if not isinstance(messages, list) or not messages:
            raise InvalidField(
                "messages must be a non-empty array of UI messages (or send message)",
                field="messages",
            )
        message, where = messages[-1], f"messages[{len(messages) - 1}]"
    text_, message_id = _user_message(message, where)
    metadata = obj.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise InvalidField(
            f"metadata must be a JSON object, got {json_type(metadata)}", field="metadata"
        )
    extra = obj.get("input")
    if extra is not None:
        if not isinstance(extra, dict):
            raise InvalidField(
                f"input must be a JSON object (fields added to the run's input), got "
                f"{json_type(extra)}",
                field="input",
            )
        if "text" in extra:
            raise InvalidField(
                "input.text is not allowed: the run's text is the last user message",
                field="input.text",
            )
    return ChatRequest(chat_id, text_, message_id, metadata, extra)


def _user_message(message: Any, where: str) -> tuple[str, str]:
    """The text and id of the user message ``message`` (at ``where`` in the body)."""
    if not isinstance(message, dict):
        raise InvalidField(f"{where} must be a UI message object", field=where)
    if message.get("role") != "user":
        raise InvalidField(
            f"{where}.role must be 'user': the last message is the one koda answers",
            field=f"{where}.role",
        )
    message_id = message.get("id")
    if not isinstance(message_id, str) or not CLIENT_MESSAGE_ID.fullmatch(message_id):
        raise InvalidField(
            f"{where}.id must be 1-200 printable ASCII characters without spaces",
            field=f"{where}.id",
        )
    parts = message.get("parts")
    if not isinstance(parts, list) or not parts:
        raise InvalidField(f"{where}.parts must be a non-empty array", field=f"{where}.parts")
    texts = []
    for i, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise InvalidField(
                f"{where}.parts[{i}] must be a text part ({{type: 'text', text}}); koda "
                f"takes text only, got {str(kind)[:40]!r}",
                field=f"{where}.parts[{i}]",
            )
        texts.append(part["text"])
    joined = "\n".join(texts)
    if not joined.strip():
        raise InvalidField(f"{where} has no text", field=f"{where}.parts")
    return joined, message_id


# --- koda events as UI message parts ----------------------------------------------------


class UIParts:
    """Translates one run's events (seq order) into UI message stream parts.

    One run is one assistant message whose id is the run id. Text chunks go into text
    parts (a new one after any tool activity or reset); a tool call is a
    ``tool-input-available`` part and its result a ``tool-output-available`` part
    (``dynamic``: the tools are the server's, and ``providerExecuted``: the client must
    not run them); ``status`` is a transient ``data-koda-status`` part; ``reset`` (a
    retry, or a merged message) closes the text and adds a ``data-koda-reset`` part: the
    protocol cannot take back text, so the answer is what follows the last such part.
    ``done`` is ``finish``, ``error`` is ``error``, ``cancelled`` is ``abort``;
    :attr:`ended` is then True and the stream ends with ``[DONE]``.
    """

    def __init__(self, message_id: str) -> None:
        self.message_id = message_id
        self._text: str | None = None
        self._calls: set[str] = set()
        self.ended = False

    def start(self) -> list[dict[str, Any]]:
        return [{"type": "start", "messageId": self.message_id}]

    def event(self, seq: int | None, kind: str, content: str | None) -> list[dict[str, Any]]:
        """The parts for one koda event (``seq`` None: an end without an event of its own)."""
        if self.ended:
            return []
        if kind == ChunkKind.CHUNK.value:
            if not content:
                return []
            parts = []
            if self._text is None:
                self._text = f"text-{seq}"
                parts.append({"type": "text-start", "id": self._text})
            parts.append({"type": "text-delta", "id": self._text, "delta": content})
            return parts
        if kind == ChunkKind.TOOL.value:
            return self._close_text() + self._tool(_json_object(content))
        if kind == ChunkKind.STATUS.value:
            return [{"type": "data-koda-status", "data": _json_object(content), "transient": True}]
        if kind == ChunkKind.APPROVAL_REQUIRED.value:
            # The run waits for POST /v1/runs/{run id}/approve or /reject: a data part the
            # page can show with its buttons (the call's name and arguments).
            data = _json_object(content)
            return [
                *self._close_text(),
                {"type": "data-koda-approval", "id": f"approval-{seq}", "data": data},
            ]
        if kind == ChunkKind.RESET.value:
            self._calls.clear()
            reset = {"type": "data-koda-reset", "id": f"reset-{seq}", "data": _json_object(content)}
            return [*self._close_text(), reset]
        if kind == ChunkKind.DONE.value:
            return self._end({"type": "finish", "finishReason": "stop"})
        if kind == ChunkKind.CANCELLED.value:
            reason = _json_object(content).get("reason")
            abort: dict[str, Any] = {"type": "abort"}
            if isinstance(reason, str):
                abort["reason"] = reason
            return self._end(abort)
        if kind == ChunkKind.ERROR.value:
            error = _json_object(content).get("error")
            message = error if isinstance(error, str) and error else "the run failed"
            return self._end({"type": "error", "errorText": message})
        if kind == RECONNECT:
            # This gateway cut the stream (a viewer too slow, or Postgres away): the client
            # is told, and resumes with the reconnect URL.
            return self._end(
                {
                    "type": "error",
                    "errorText": "the stream was cut; resume it (GET /v1/chat/{id}/stream)",
                }
            )
        return []  # a kind this protocol has no part for

    def _tool(self, tool: dict[str, Any]) -> list[dict[str, Any]]:
        call_id = str(tool.get("call_id", ""))
        name = str(tool.get("name", ""))
        common = {"toolCallId": call_id, "dynamic": True, "providerExecuted": True}
        parts: list[dict[str, Any]] = []
        if "arguments" in tool or call_id not in self._calls:
            self._calls.add(call_id)
            parts.append(
                {
                    "type": "tool-input-available",
                    **common,
                    "toolName": name,
                    "input": _arguments(tool.get("arguments")),
                }
            )
        if "result" in tool:
            parts.append({"type": "tool-output-available", **common, "output": tool["result"]})
        return parts

    def _close_text(self) -> list[dict[str, Any]]:
        if self._text is None:
            return []
        part = {"type": "text-end", "id": self._text}
        self._text = None
        return [part]

    def _end(self, last: dict[str, Any]) -> list[dict[str, Any]]:
        self.ended = True
        return [*self._close_text(), last]


def _json_object(content: str | None) -> dict[str, Any]:
    try:
        value = json.loads(content) if content else {}
    except ValueError:
        return {"text": content}
    return value if isinstance(value, dict) else {"value": value}


def _arguments(raw: Any) -> Any:
    """A tool call's arguments as JSON when the model wrote JSON, else as written."""
    if not isinstance(raw, str):
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def part_frames(parts: list[dict[str, Any]]) -> bytes:
    """The SSE frames of ``parts``: one ``data:`` line of compact JSON each."""
    return b"".join(
        b"data: " + json.dumps(p, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"
        for p in parts
    )


class ChatEventStream(RunEventStream):
    """A run's event stream written as UI message stream parts (see :class:`UIParts`).

    Every write of the run's stream (whole koda frames) is parsed back and translated;
    the order, replay and gap rules are the run stream's own.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.init_headers(
            {
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
                PROTOCOL_HEADER: PROTOCOL_VERSION,
            }
        )
        self.parts = UIParts(self.run_id)
        self._parser = EventParser()
        self._started = False

    async def _write(self, body: bytes) -> None:
        out = bytearray()
        if not self._started:
            self._started = True
            out += part_frames(self.parts.start())
        was_ended = self.parts.ended
        for event in self._parser.feed(body):
            content = None
            if event.data:
                try:
                    content = event.json().get("content")
                except (ValueError, AttributeError):
                    content = None
            out += part_frames(self.parts.event(event.seq, event.event, content))
        if self.parts.ended and not was_ended:
            out += DONE_FRAME
        if not out:
            out += comment("keep-alive")
        await super()._write(bytes(out))


# --- routes -----------------------------------------------------------------------------


def _chat_not_found() -> NotFound:
    return NotFound("chat not found: check the chat id and the token's user", field="id")


async def answer_start(gw: Components, run_id: str) -> int:
    """The seq the current answer starts after: the run's last ``reset``, else -1."""
    seq = await gw.reads.last_reset(run_id)
    return -1 if seq is None else seq


async def _stream(request: Request, gw: Components, user_id: str, run_id: str) -> Response:
    """The run's current answer, then its live events, as UI message parts."""
    slot = stream_slots(request).acquire(user_id)
    viewer = gw.feed.subscribe(run_id, gw.settings.sse_queue_bytes)  # before any read
    try:
        after = await answer_start(gw, run_id)
        if await gw.reads.stream_head(run_id, user_id) is None:
            raise _chat_not_found()
    except BaseException:
        gw.feed.unsubscribe(viewer)
        slot.release()
        raise
    return ChatEventStream(gw=gw, viewer=viewer, after=after, user_id=user_id, slot=slot)


async def _active_run(gw: Components, user_id: str, chat_id: str) -> str | None:
    """The chat's newest run if it has not ended; NotFound for another user's chat."""
    if not SESSION_ID.fullmatch(chat_id) or not await gw.control.session_owned(chat_id, user_id):
        raise _chat_not_found()
    rows = await gw.control.list_runs(
        user_id, session_id=chat_id, status=None, limit=1, before=None
    )
    if not rows:
        return None
    return None if RunStatus(rows[0].status).terminal else rows[0].run_id


@router.post(
    "/v1/chat",
    response_class=Response,
    responses={200: _STREAM_200, **_ERRORS},
    # Authenticated in the handler, so that a refused token is counted like every refusal.
    dependencies=[Security(BEARER)],
    summary="useChat: send the chat's new message; the answer streams as UI message parts",
)
async def chat(request: Request, gw: Gateway) -> Response:
    user_id: str | None = None
    try:
        user_id = authenticate_request(request, gw.auth)
        take_rate_token(gw, user_id)
        check_content_type(request.headers.get("content-type"))
        body = await read_body_within(
            request, gw.settings.body_limit_bytes, gw.settings.body_read_timeout_s
        )
        asked = parse_chat_request(decode_json(body))
        try:
            run = await gw.admissions.submit(
                user_id, asked.run_request(), None, merge_caps=MergeCaps.of(gw.settings)
            )
        except SessionNotOwned:
            raise _chat_not_found() from None
    except DatabaseError:
        metrics.ADMISSIONS_REJECTED.labels(reason="unavailable").inc()
        raise
    except CapReached as exc:
        raise _rejected(user_id, limit_reached(exc)) from None
    except GatewayError as exc:
        _rejected(user_id, exc)
        raise
    except Refused as exc:
        _rejected(user_id, http_error(exc))
        raise
    log.info(
        "event=chat_message user_id=%s chat_id=%s run_id=%s merged=%s",
        user_id,
        asked.chat_id,
        run.run_id,
        run.merged,
    )
    return await _stream(request, gw, user_id, run.run_id)


def _rejected(user_id: str | None, refusal: GatewayError) -> GatewayError:
    metrics.ADMISSIONS_REJECTED.labels(reason=refusal.code).inc()
    log.info(
        "event=admission_rejected route=chat user_id=%s reason=%s field=%s",
        user_id or "-",
        refusal.code,
        refusal.field or "-",
    )
    return refusal


@router.get(
    "/v1/chat/{chat_id}/stream",
    response_class=Response,
    responses={
        200: _STREAM_200,
        204: {"description": "Nothing is running in this chat"},
        **{k: _ERRORS[k] for k in (401, 404, 429, 503)},
    },
    summary="useChat's resume: the chat's running answer from its start, or 204",
)
async def resume_chat(chat_id: str, request: Request, gw: Gateway, user_id: User) -> Response:
    run_id = await _active_run(gw, user_id, chat_id)
    if run_id is None:
        return Response(status_code=204)
    return await _stream(request, gw, user_id, run_id)


@router.delete(
    "/v1/chat/{chat_id}/stream",
    responses={
        200: {"description": "The run had already ended (see POST /v1/runs/{id}/cancel)"},
        202: {"description": "Running: the worker ends it cancelled"},
        204: {"description": "Nothing is running in this chat (or message_id is not it)"},
        **{k: _ERRORS[k] for k in (401, 404, 503)},
    },
    summary="Stop the chat's running answer: the run ends cancelled",
)
async def stop_chat(
    chat_id: str,
    request: Request,
    gw: Gateway,
    user_id: User,
    message_id: str | None = Query(
        None,
        description="The assistant message being stopped (its id is the run id): a stop "
        "that arrives after a newer answer started then cancels nothing.",
    ),
) -> Response:
    run_id = await _active_run(gw, user_id, chat_id)
    if run_id is None or (message_id is not None and message_id != run_id):
        return Response(status_code=204)
    return await cancel_run(request=request, gw=gw, user_id=user_id, run_id=run_id)
