"""Run control records and the input merge rule (README "Steering a run").

A ``run.control`` record on ``<env>.koda.run-control`` (key user_id, so it lands in the
partition number of the user's runs) tells the worker executing ``run_id`` that the
run's row changed under it: ``cancel`` (a cancel request is durable in Postgres) or
``merge`` (a message was appended; ``input_version`` is the new version). The record is
only a wake-up: Postgres holds the request, and every claim and finish checks it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

CANCEL = "cancel"
MERGE = "merge"
ACTIONS = (CANCEL, MERGE)
MAX_REASON_CHARS = 500
MERGE_SEPARATOR = "\n\n"


@dataclass(frozen=True)
class ControlRecord:
    run_id: str
    user_id: str
    action: str
    reason: str | None = None
    input_version: int = 0

    def encode(self) -> bytes:
        return json.dumps(
            {
                "run_id": self.run_id,
                "user_id": self.user_id,
                "action": self.action,
                "reason": self.reason,
                "input_version": self.input_version,
            },
            separators=(",", ":"),
        ).encode()


def decode_control(value: bytes | None) -> ControlRecord | None:
    """The record, or None for anything that is not a well-formed control record."""
    try:
        obj = json.loads(value or b"")
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(obj, dict):
        return None
    run_id, user_id, action = obj.get("run_id"), obj.get("user_id"), obj.get("action")
    version = obj.get("input_version", 0)
    reason = obj.get("reason")
    if not (isinstance(run_id, str) and run_id and isinstance(user_id, str) and user_id):
        return None
    if action not in ACTIONS or not isinstance(version, int) or isinstance(version, bool):
        return None
    if reason is not None and not isinstance(reason, str):
        return None
    return ControlRecord(run_id, user_id, action, reason, version)


def _text(inp: dict[str, Any]) -> str | None:
    text = inp.get("text", inp.get("prompt"))
    return text if isinstance(text, str) else None


def merge_inputs(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """The input of a run after ``extra`` (a second message) was merged into it.

    * both carry ``messages`` (chat form): the lists are concatenated;
    * otherwise the texts are joined with a blank line into ``text`` (a ``messages``
      list on one side gets the other's text as one more user message);
    * every other key keeps the first message's value, so the run's options stay.
    The merged messages are also kept, in order, under ``merged`` for the record.
    """
    merged: dict[str, Any] = dict(base)
    base_msgs, extra_msgs = base.get("messages"), extra.get("messages")
    base_text, extra_text = _text(base), _text(extra)
    if isinstance(base_msgs, list):
        if isinstance(extra_msgs, list):
            merged["messages"] = [*base_msgs, *extra_msgs]
        else:
            merged["messages"] = [*base_msgs, {"role": "user", "content": extra_text or ""}]
    elif isinstance(extra_msgs, list):
        merged["messages"] = [{"role": "user", "content": base_text or ""}, *extra_msgs]
    else:
        parts = [t for t in (base_text, extra_text) if t]
        merged["text"] = MERGE_SEPARATOR.join(parts)
        merged.pop("prompt", None)
    history = base.get("merged")
    merged["merged"] = [*(history if isinstance(history, list) else []), extra]
    return merged
