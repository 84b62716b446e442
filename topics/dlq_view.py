"""Dead letters for people: one line each (``koda dlq list``) or every detail (``show``)."""

from __future__ import annotations

import base64
import json
from datetime import UTC, datetime

from koda_runtime.topics.dlq import LetterAt

PREVIEW = 60


def _text(data: bytes | None, limit: int | None = None) -> str:
    """Bytes as text when they are UTF-8, else as base64 (marked)."""
    if data is None:
        return "(none)"
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        text = "base64:" + base64.b64encode(data).decode()
    if limit is not None and len(text) > limit:
        return text[: limit - 1] + "…"
    return text


def run_id_of(at: LetterAt) -> str | None:
    """The run the original record names, when its value is a JSON object with a run_id."""
    if at.letter is None or at.letter.value is None:
        return None
    try:
        obj = json.loads(at.letter.value)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    run_id = obj.get("run_id") if isinstance(obj, dict) else None
    return run_id if isinstance(run_id, str) else None


def list_line(at: LetterAt) -> str:
    """``ID  time  reason  run  key  error`` on one line."""
    when = datetime.fromtimestamp(at.timestamp_ms / 1000, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    if at.letter is None:
        return f"{str(at.id):<10} {when}  (not a dead letter)"
    letter = at.letter
    error = " ".join(letter.error.split())
    return (
        f"{str(at.id):<10} {when}  {letter.reason:<24} run={run_id_of(at) or '-'}"
        f"  key={_text(letter.key, 32)}  {error[:PREVIEW]}"
    )


def detail_lines(at: LetterAt) -> list[str]:
    """Every field of one dead letter, the original value pretty-printed when it is JSON."""
    if at.letter is None:
        return [f"id:        {at.id}", "not a dead letter (its value does not decode as one)"]
    letter = at.letter
    out = [
        f"id:        {at.id}",
        f"at:        {letter.at or '-'}",
        f"reason:    {letter.reason}",
        f"error:     {letter.error}",
        f"attempts:  {letter.attempts}",
        f"original:  {letter.topic} [{letter.partition}] @ {letter.offset}",
        f"run:       {run_id_of(at) or '-'}",
        f"key:       {_text(letter.key)}",
        f"size:      {letter.original_size if letter.original_size is not None else '-'} bytes"
        + (" (value truncated: cannot be replayed)" if letter.truncated else ""),
        f"sha256:    {letter.original_sha256 or '-'}",
        "headers:",
    ]
    out += [f"  {name}: {_text(value)}" for name, value in letter.headers] or ["  (none)"]
    out.append("value:")
    value = _text(letter.value)
    try:
        value = json.dumps(json.loads(letter.value or b""), indent=2, ensure_ascii=False)
    except (UnicodeDecodeError, json.JSONDecodeError):
        pass
    out += [f"  {line}" for line in value.splitlines()] or ["  (empty)"]
    return out
