"""A run's chat messages: its session's earlier turns, then its own input.

Each earlier turn is a ``user`` message (its messages, merged ones joined by a blank
line) and the ``assistant`` answer; a cut answer (the run was cancelled) ends with
:data:`~koda_runtime.lifecycle.turns.CUT_MARK`. The turns go after the input's leading
``system`` messages and before the rest of it, so the new message comes last.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from koda_runtime.lifecycle.turns import Turn


def turn_messages(turns: Sequence[Turn]) -> list[dict[str, Any]]:
    """The user/assistant pairs of ``turns``, oldest first."""
    out: list[dict[str, Any]] = []
    for turn in turns:
        out.append({"role": "user", "content": turn.user_text})
        out.append({"role": "assistant", "content": turn.answer_text})
    return out


def with_turns(turns: Sequence[Turn], own: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """``own`` (the run's messages) with the earlier turns after its system messages."""
    lead = 0
    while lead < len(own) and own[lead].get("role") == "system":
        lead += 1
    return [*own[:lead], *turn_messages(turns), *own[lead:]]
