"""A session's earlier turns as a run sees them, and the context budget (docs/design.md,
"A run sees its session").

A turn is one earlier run of the session: the user's messages (the first one and each
merged into it, in order) and the run's final answer. A ``cancelled`` run is a turn
whose answer is ``cut`` (what it streamed before the cancel, possibly nothing); a
``failed`` run is no turn. Pure: the query is in schemas/runs/reads.py.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from koda_runtime.lifecycle.control import MERGE_SEPARATOR

# An estimate of the tokens of text no model reported on: ~4 characters a token, the
# rule of thumb for English text with OpenAI's tokenizers (other scripts take more).
CHARS_PER_TOKEN = 4
# Added to a cut answer where it was stopped, so the model knows it was not finished.
CUT_MARK = "[answer cut off: the user stopped it here]"


def estimate_tokens(text: str) -> int:
    """``ceil(len(text) / 4)``: the estimate for text no model call counted."""
    return -(-len(text) // CHARS_PER_TOKEN)


@dataclass(frozen=True)
class Turn:
    """One earlier run of the session, oldest first in a context.

    ``messages``: the user's messages of the run (more than one when messages were
    merged into it); ``answer``: its final output; ``cut``: it was cancelled, the
    answer is partial; ``tokens``: what the turn costs in a prompt (see
    :func:`turn_tokens`).
    """

    run_id: str
    messages: tuple[str, ...]
    answer: str
    cut: bool = False
    tokens: int = 0

    @property
    def user_text(self) -> str:
        """The user's side as the run saw it: merged messages joined by a blank line."""
        return MERGE_SEPARATOR.join(self.messages)

    @property
    def answer_text(self) -> str:
        """The assistant's side; a cut answer ends with :data:`CUT_MARK`."""
        if not self.cut:
            return self.answer
        return f"{self.answer}\n\n{CUT_MARK}" if self.answer else CUT_MARK


def _text(inp: dict[str, Any]) -> str | None:
    text = inp.get("text", inp.get("prompt"))
    return text if isinstance(text, str) else None


def _user_contents(messages: list[Any]) -> list[str]:
    return [
        str(m.get("content") or "")
        for m in messages
        if isinstance(m, dict) and m.get("role", "user") == "user"
    ]


def user_messages(inp: dict[str, Any]) -> list[str]:
    """The user's messages of a run's input, the first one and then each merged one.

    A chat-form input (``messages``) gives its user messages; a text input its text. A
    merged input (koda/lifecycle/control.py ``merge_inputs``) holds the joined text and
    the merged messages under ``merged``: the first message is the joined text less
    their suffix.
    """
    merged = inp.get("merged")
    extras = [m for m in merged if isinstance(m, dict)] if isinstance(merged, list) else []
    msgs = inp.get("messages")
    if isinstance(msgs, list):
        return [c for c in _user_contents(msgs) if c]
    whole = _text(inp) or ""
    extra_texts = [t for t in (_text(e) or "\n".join(_user_contents_of(e)) for e in extras) if t]
    suffix = MERGE_SEPARATOR.join(extra_texts)
    if extra_texts and whole.endswith(suffix):
        first = whole[: len(whole) - len(suffix)].removesuffix(MERGE_SEPARATOR)
        return [t for t in (first, *extra_texts) if t]
    return [whole] if whole else []


def _user_contents_of(inp: dict[str, Any]) -> list[str]:
    msgs = inp.get("messages")
    return _user_contents(msgs) if isinstance(msgs, list) else []


def turn_tokens(messages: Sequence[str], answer: str, cut: bool, answer_tokens: int) -> int:
    """What a turn costs in a prompt: the user's text estimated (:func:`estimate_tokens`),
    plus the answer's tokens as the ledger counted them (``answer_tokens``: completion
    tokens of the run's last attempt), or estimated when the ledger holds none (a run
    cancelled before its model reported, a handler that reports no usage)."""
    turn = Turn("", tuple(messages), answer, cut)
    user = estimate_tokens(turn.user_text)
    if answer_tokens > 0:
        return user + answer_tokens + (estimate_tokens(CUT_MARK) if cut else 0)
    return user + estimate_tokens(turn.answer_text)


def fit_budget(turns: Iterable[Turn], budget: int, reserved: int = 0) -> tuple[Turn, ...]:
    """The newest turns whose tokens, with ``reserved`` (the run's own input), fit in
    ``budget``; oldest first. The oldest are dropped first, whole: a turn is never
    split, and one that does not fit ends the context (older ones are not tried)."""
    kept: list[Turn] = []
    left = budget - reserved
    for turn in reversed(list(turns)):
        if turn.tokens > left:
            break
        left -= turn.tokens
        kept.append(turn)
    kept.reverse()
    return tuple(kept)


def input_tokens(inp: dict[str, Any]) -> int:
    """The estimate of the run's own input, reserved in the budget before any turn."""
    return estimate_tokens(MERGE_SEPARATOR.join(user_messages(inp)))
