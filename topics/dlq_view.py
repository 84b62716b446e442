"""Dead letters for people: one line each (``koda dlq list``) or every detail (``show``)."""

from __future__ import annotations

import base64
import json
from datetime import UTC, datetime

from koda_runtime.topics.dlq import LetterAt
from koda_runtime.topics.records.dead_letters import DeadLetter

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


def _size(n: int | None) -> str:
    return "-" if n is None else f"{n} bytes"


def _cut(flag: bool | None) -> str:
    return " (truncated)" if flag else ""


def _truncated(letter: DeadLetter) -> str:
    """Which parts of the original the letter cut; a letter written before the parts
    were told apart says only whether anything was."""
    if not letter.truncated:
        return "no"
    return f"{', '.join(letter.cut_parts) or 'yes'} (cannot be replayed)"


def _headers(letter: DeadLetter) -> str:
    kept = f"{len(letter.headers)} kept"
    if letter.headers_count is None or letter.headers_size is None:
        return kept
    return f"{letter.headers_count} ({letter.headers_size} bytes), {kept}"


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
        f"key size:  {_size(letter.key_size)}" + _cut(letter.key_truncated),
        f"size:      {_size(letter.original_size)}" + _cut(letter.value_truncated),
        f"sha256:    {letter.original_sha256 or '-'}",
        f"truncated: {_truncated(letter)}",
        f"headers:   {_headers(letter)}" + _cut(letter.headers_truncated),
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
