"""The OpenAI Responses API as koda maps it: request fields, the response object and the
stream's events (docs/design.md §9). Pure: no I/O; gateway/responses.py serves it.

**Ids.** A response is a run: its id is ``resp_<run_id>``, so any gateway maps it back.
The answer's message item is ``msg_<run_id>_<k>``, ``k`` the resets before it.

**Sequence numbers** are a function of the run's events (``messages``, seq 0..end) and
nothing else, so two gateways number one run's stream alike and ``starting_after=N``
resumes exactly after event N:

* 0 ``response.created``; 1 ``response.in_progress``, 2 ``response.output_item.added``,
  3 ``response.content_part.added`` (written when the run's first event is);
* then each koda event in seq order adds its events: a ``chunk`` one
  ``response.output_text.delta``; a ``reset`` five (the partial message closed
  ``incomplete``: text done, part done, item done; the next message opened: item added,
  part added); ``tool`` and ``status`` none (they are not answer text; koda's own
  ``/v1/runs/{id}/events`` shows them); the terminal event four (text done, part done,
  item done, then ``response.completed``, ``response.failed`` or ``response.incomplete``).

A cancelled run ends with ``response.incomplete`` whose response has status
``cancelled``: the Responses stream defines no event of its own for a cancellation.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from koda_runtime.errors import KodaError
from koda_runtime.gateway.intake import json_type
from koda_runtime.schemas.runs.reads import RunState

RESPONSE_PREFIX = "resp_"
MESSAGE_PREFIX = "msg_"
# Fields koda takes, with OpenAI's meaning. ``store`` is accepted only as true (koda
# always keeps a response, as long as it keeps the run).
FIELDS = (
    "input",
    "instructions",
    "model",
    "previous_response_id",
    "background",
    "stream",
    "metadata",
    "store",
)
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
MAX_INPUT_ITEMS = 1000
# Message roles of an input list; ``developer`` is a system message for koda's handlers.
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = ("input_text", "output_text")
# Where koda keeps the request's Responses fields in the run's input (handlers ignore it).
INPUT_KEY = "responses_api"
# A run that stops at KODA_MAX_OUTPUT_BYTES ends failed with this error prefix; the
# Responses API calls that an incomplete response (max_output_tokens).
OUTPUT_CAP_ERROR = "output_bytes:"
PREAMBLE = 4  # response.created, response.in_progress, output_item.added, part.added
_RUN_ID = re.compile(r"[A-Za-z0-9._:@-]{1,128}")


class RequestError(KodaError):
    """A request refused in OpenAI's shape: ``param`` names the field at fault."""

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str = "invalid_value",
        status: int = 400,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.status = status


def response_id(run_id: str) -> str:
    return RESPONSE_PREFIX + run_id


def run_id_of(resp_id: str) -> str | None:
    """The run of a response id; None for anything that is not ``resp_<run id>``."""
    if not resp_id.startswith(RESPONSE_PREFIX):
        return None
    run_id = resp_id[len(RESPONSE_PREFIX) :]
    return run_id if _RUN_ID.fullmatch(run_id) else None


def message_id(run_id: str, resets: int) -> str:
    return f"{MESSAGE_PREFIX}{run_id}_{resets}"


def served_model(handler: str, openai_model: str) -> str:
    """The model a deployment's workers answer with (KODA_HANDLER, KODA_OPENAI_MODEL):
    the only ``model`` a request may name. A plugin handler is named by itself."""
    if handler == "openai":
        return openai_model
    if handler == "demo":
        return "demo-1"  # processors/handlers/demo.py MODEL
    return handler


@dataclass(frozen=True)
class CreateRequest:
    """A validated ``POST /v1/responses`` body."""

    run_input: dict[str, Any]
    instructions: str | None
    previous_response_id: str | None
    background: bool
    stream: bool
    metadata: dict[str, str] | None


def parse_create(body: Any, model: str) -> CreateRequest:
    """Validate a decoded body; ``model`` is :func:`served_model`. RequestError names the
    first field koda does not support or that is wrong."""
    if not isinstance(body, dict):
        raise RequestError(f"the body must be a JSON object, got {json_type(body)}", param=None)
    for name in body:
        if name not in FIELDS:
            raise RequestError(
                f"koda does not support the parameter {name[:64]!r}; supported: "
                f"{', '.join(FIELDS)}",
                param=name[:64],
                code="unsupported_parameter",
            )
    given = {k: v for k, v in body.items() if v is not None}
    if given.get("store", True) is not True:
        raise RequestError(
            "store must be true: koda keeps every response as long as it keeps the run",
            param="store",
            code="unsupported_parameter",
        )
    asked = given.get("model")
    if asked is not None and asked != model:
        shown = asked[:64] if isinstance(asked, str) else json_type(asked)
        raise RequestError(
            f"model {shown!r} is not served here: this koda answers with {model!r} "
            "(omit model, or name that one)",
            param="model",
            code="model_not_found",
        )
    background = _flag(given, "background")
    stream = _flag(given, "stream")
    instructions = given.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise RequestError(
            f"instructions must be a string, got {json_type(instructions)}",
            param="instructions",
        )
    previous = given.get("previous_response_id")
    if previous is not None and (not isinstance(previous, str) or run_id_of(previous) is None):
        raise RequestError(
            "previous_response_id must be the id of one of your responses (resp_...)",
            param="previous_response_id",
        )
    if "input" not in given:
        raise RequestError("input is required: a string or a list of messages", param="input")
    messages = _input_messages(given["input"])
    metadata = _metadata(given.get("metadata"))
    lead = [{"role": "system", "content": instructions}] if instructions else []
    run_input: dict[str, Any]
    if not lead and isinstance(given["input"], str):
        run_input = {"text": given["input"]}
    else:
        run_input = {"messages": [*lead, *messages]}
    run_input[INPUT_KEY] = {
        "background": background,
        "instructions": instructions,
        "previous_response_id": previous,
    }
    return CreateRequest(run_input, instructions, previous, background, stream, metadata)


def _flag(given: Mapping[str, Any], name: str) -> bool:
    value = given.get(name, False)
    if not isinstance(value, bool):
        raise RequestError(f"{name} must be a boolean, got {json_type(value)}", param=name)
    return value


def _input_messages(raw: Any) -> list[dict[str, str]]:
    """The input as chat messages: a string is one user message; a list holds messages
    (``{"role", "content"}``, ``type`` "message" optional) whose content is a string or
    a list of ``input_text`` parts."""
    if isinstance(raw, str):
        if not raw.strip():
            raise RequestError("input must not be empty", param="input")
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise RequestError(
            f"input must be a string or a non-empty list of messages, got {json_type(raw)}",
            param="input",
        )
    if len(raw) > MAX_INPUT_ITEMS:
        raise RequestError(f"input holds more than {MAX_INPUT_ITEMS} items", param="input")
    out = []
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise RequestError(f"{where} must be a message object", param=where)
        for key in item:
            if key not in ("role", "content", "type"):
                raise RequestError(
                    f"{where}.{str(key)[:64]} is not supported: a message has role, content "
                    "and type",
                    param=f"{where}.{str(key)[:64]}",
                    code="unsupported_parameter",
                )
        if item.get("type", "message") != "message":
            raise RequestError(
                f"{where}.type {str(item.get('type'))[:64]!r} is not supported: koda takes "
                "messages only",
                param=f"{where}.type",
                code="unsupported_parameter",
            )
        role = item.get("role")
        if role not in ROLES:
            raise RequestError(
                f"{where}.role must be one of {', '.join(ROLES)}", param=f"{where}.role"
            )
        out.append({"role": ROLES[role], "content": _content(item.get("content"), where)})
    if not any(m["role"] == "user" for m in out):
        raise RequestError("input must hold at least one user message", param="input")
    return out


def _content(raw: Any, where: str) -> str:
    if isinstance(raw, str):
        return raw
    if not isinstance(raw, list):
        raise RequestError(
            f"{where}.content must be a string or a list of input_text parts",
            param=f"{where}.content",
        )
    texts = []
    for j, part in enumerate(raw):
        at = f"{where}.content[{j}]"
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS:
            kind = part.get("type") if isinstance(part, dict) else json_type(part)
            raise RequestError(
                f"{at} of type {str(kind)[:64]!r} is not supported: koda takes text parts "
                "(input_text) only",
                param=f"{at}.type",
                code="unsupported_parameter",
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise RequestError(f"{at}.text must be a string", param=f"{at}.text")
        texts.append(text)
    return "".join(texts)


def _metadata(raw: Any) -> dict[str, str] | None:
    """OpenAI's rule: at most 16 pairs, keys up to 64 chars, string values up to 512."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise RequestError(f"metadata must be an object, got {json_type(raw)}", param="metadata")
    if len(raw) > MAX_METADATA_PAIRS:
        raise RequestError(
            f"metadata holds {len(raw)} pairs, at most {MAX_METADATA_PAIRS}", param="metadata"
        )
    for key, value in raw.items():
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise RequestError(
                f"metadata key {key[:64]!r}... is longer than {MAX_METADATA_KEY_CHARS} chars",
                param="metadata",
            )
        if not isinstance(value, str) or len(value) > MAX_METADATA_VALUE_CHARS:
            raise RequestError(
                f"metadata.{key} must be a string of at most {MAX_METADATA_VALUE_CHARS} chars",
                param=f"metadata.{key}",
            )
    return dict(raw)


# --- the response object ------------------------------------------------------------------


def response_status(run_status: str, error: str | None) -> str:
    """koda's run status as a Responses status."""
    if run_status == "pending":
        return "queued"
    if run_status in ("running", "streaming", "waiting"):
        # waiting: for a person's approval (POST /v1/runs/{id}/approve); the Responses
        # API has no such status, and the run is still under way.
        return "in_progress"
    if run_status == "done":
        return "completed"
    if run_status == "failed" and (error or "").startswith(OUTPUT_CAP_ERROR):
        return "incomplete"
    return run_status  # failed, cancelled


def _item_status(status: str) -> str:
    if status == "completed":
        return "completed"
    if status in ("queued", "in_progress"):
        return "in_progress"
    return "incomplete"


def message_item(run_id: str, resets: int, text: str, status: str) -> dict[str, Any]:
    return {
        "id": message_id(run_id, resets),
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [_text_part(text)],
    }


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def response_object(state: RunState, *, status: str | None = None) -> dict[str, Any]:
    """The Responses API object of a run (``status`` overrides the mapped one)."""
    shown = status or response_status(state.status, state.error)
    extra = state.input.get(INPUT_KEY)
    asked: Mapping[str, Any] = extra if isinstance(extra, dict) else {}
    output: list[dict[str, Any]] = []
    if state.output or shown in ("completed", "incomplete"):
        output = [message_item(state.run_id, state.resets, state.output, _item_status(shown))]
    error = None
    if shown == "failed":
        error = {"code": "server_error", "message": state.error or "the run failed"}
    usage = None
    if state.usage is not None:
        prompt, completion, cached, reasoning = state.usage
        usage = {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": prompt + completion,
        }
    return {
        "id": response_id(state.run_id),
        "object": "response",
        "created_at": int(state.created_at.timestamp()),
        "status": shown,
        "background": bool(asked.get("background", False)),
        "completed_at": (
            int(state.finished_at.timestamp())
            if shown == "completed" and state.finished_at is not None
            else None
        ),
        "error": error,
        "incomplete_details": ({"reason": "max_output_tokens"} if shown == "incomplete" else None),
        "instructions": asked.get("instructions"),
        "max_output_tokens": None,
        "metadata": dict(state.metadata or {}),
        "model": state.model,
        "output": output,
        "parallel_tool_calls": False,
        "previous_response_id": asked.get("previous_response_id"),
        "temperature": None,
        "text": {"format": {"type": "text"}},
        "tool_choice": "auto",
        "tools": [],
        "top_p": None,
        "truncation": "auto",
        "usage": usage,
        "user": None,
    }


# --- the stream -------------------------------------------------------------------------

# The last event of a run's stream, by its terminal event's kind (and Responses status).
_END_EVENT = {
    "completed": "response.completed",
    "failed": "response.failed",
    "incomplete": "response.incomplete",
    "cancelled": "response.incomplete",
}


class EventNumbering:
    """A run's Responses events, numbered, from its koda events fed in seq order from 0.

    ``opening`` is the response object at the stream's start (its status is shown in
    ``response.created``). :meth:`created` comes first, always; every method returns
    the events (dicts with their ``sequence_number``) it makes, and the caller drops
    those at or below the client's ``starting_after``.
    """

    def __init__(self, run_id: str, opening: Mapping[str, Any]) -> None:
        self.run_id = run_id
        self.opening = dict(opening, output=[], usage=None)
        self.number = 0
        self.resets = 0
        self.text: list[str] = []
        self.started = False
        self.ended = False

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.number, **fields}
        self.number += 1
        return event

    def created(self) -> list[dict[str, Any]]:
        status = self.opening["status"]
        shown = "queued" if status == "queued" else "in_progress"
        return [self._event("response.created", response=dict(self.opening, status=shown))]

    def _start(self) -> list[dict[str, Any]]:
        if self.started:
            return []
        self.started = True
        return [
            self._event("response.in_progress", response=dict(self.opening, status="in_progress")),
            *self._open_item(),
        ]

    def _open_item(self) -> list[dict[str, Any]]:
        item = message_item(self.run_id, self.resets, "", "in_progress")
        item["content"] = []
        return [
            self._event("response.output_item.added", output_index=self.resets, item=item),
            self._event(
                "response.content_part.added",
                item_id=item["id"],
                output_index=self.resets,
                content_index=0,
                part=_text_part(""),
            ),
        ]

    def _close_item(self, status: str) -> list[dict[str, Any]]:
        text = "".join(self.text)
        item_id = message_id(self.run_id, self.resets)
        where = {"item_id": item_id, "output_index": self.resets, "content_index": 0}
        return [
            self._event("response.output_text.done", text=text, logprobs=[], **where),
            self._event("response.content_part.done", part=_text_part(text), **where),
            self._event(
                "response.output_item.done",
                output_index=self.resets,
                item=message_item(self.run_id, self.resets, text, status),
            ),
        ]

    def feed(self, kind: str, content: str) -> list[dict[str, Any]]:
        """The events of one non-terminal koda event."""
        if self.ended:
            return []
        out = self._start()
        if kind == "chunk":
            self.text.append(content)
            out.append(
                self._event(
                    "response.output_text.delta",
                    item_id=message_id(self.run_id, self.resets),
                    output_index=self.resets,
                    content_index=0,
                    delta=content,
                    logprobs=[],
                )
            )
        elif kind == "reset":
            out += self._close_item("incomplete")
            self.resets += 1
            self.text = []
            out += self._open_item()
        return out

    def end(self, final: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The events of the run's end; ``final`` is its response object (terminal)."""
        if self.ended:
            return []
        out = self._start()
        status = str(final["status"])
        out += self._close_item(_item_status(status))
        self.ended = True
        out.append(self._event(_END_EVENT.get(status, "response.failed"), response=dict(final)))
        return out


def sse_frame(event: Mapping[str, Any]) -> bytes:
    """One Responses event as Server-Sent Events: ``event:`` its type, ``data:`` its JSON
    (no ``id:`` line: a client resumes with ``starting_after``)."""
    data = json.dumps(event, separators=(",", ":"), ensure_ascii=False)
    return f"event: {event['type']}\ndata: {data}\n\n".encode()


def error_body(message: str, *, param: str | None, code: str, status: int) -> dict[str, Any]:
    """OpenAI's error shape."""
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
