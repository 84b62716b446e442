"""The model loop's tool calls: assembling streamed fragments, running built-in tools.

OpenAI-compatible servers stream a tool call in pieces: the first delta of a call
carries its ``index``, ``id`` and ``function.name``, later deltas only the ``index``
and more ``function.arguments`` text. Fragments are joined by ``index``; a server that
leaves the index out is joined by ``id`` (a fragment with neither continues the last
call).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from koda_runtime.errors import HandlerError


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""

    def message(self) -> dict[str, Any]:
        """The call as the assistant message's ``tool_calls`` entry."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class ToolCallAssembler:
    """Joins the ``tool_calls`` deltas of one streamed completion."""

    _calls: dict[str, ToolCall] = field(default_factory=dict)
    _last: str | None = None

    def feed(self, fragments: Any) -> None:
        if not isinstance(fragments, list):
            raise HandlerError(f"model sent tool_calls that are not a list: {fragments!r:.200}")
        for fragment in fragments:
            if not isinstance(fragment, dict):
                raise HandlerError(
                    f"model sent a tool_calls entry that is not an object: {fragment!r:.200}"
                )
            call_id = fragment.get("id")
            index = fragment.get("index")
            if index is not None:
                key = f"index:{index}"
            elif call_id:
                key = f"id:{call_id}"
            elif self._last is not None:
                key = self._last
            else:
                raise HandlerError("model sent a tool_calls fragment with neither index nor id")
            function = fragment.get("function") or {}
            call = self._calls.get(key)
            if call is None:
                call = self._calls[key] = ToolCall(
                    str(call_id or ""), str(function.get("name") or "")
                )
            elif call_id and not call.id:
                call.id = str(call_id)
            if function.get("name") and not call.name:
                call.name = str(function["name"])
            call.arguments += str(function.get("arguments") or "")
            self._last = key

    def calls(self) -> list[ToolCall]:
        """The assembled calls in arrival order; each must have a name, and gets an id
        (``call_<n>``) when the server sent none."""
        out = list(self._calls.values())
        for n, call in enumerate(out):
            if not call.name:
                raise HandlerError(f"model sent tool call {n} without a function name")
            if not call.id:
                call.id = f"call_{n}"
        return out


def activity(**fields: Any) -> str:
    """A ``tool`` chunk's JSON content."""
    return json.dumps(fields, separators=(",", ":"))
