"""The pluggable job: an async iterator of chunk texts and usage records.

A handler gets a :class:`RunContext` and yields ``str`` (a chunk of the answer),
:class:`Usage` (one model or embedding call's token counts), :class:`ToolActivity`
(a ``tool`` chunk: a tool call or its result, for viewers) or :class:`Status` (a
``status`` chunk). It must check
``ctx.cancel.cancelled`` between steps and return early when set (a user's cancel,
or a merged message that makes the worker start over); the worker also cancels the
task then, and at the handoff ceiling.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from koda_runtime.errors import HandlerError
from koda_runtime.lifecycle.turns import Turn


class CancelToken:
    """Cooperative cancellation shared by the worker and a handler."""

    def __init__(self) -> None:
        self._event = asyncio.Event()
        self.reason: str | None = None

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()

    def cancel(self, reason: str) -> None:
        if not self._event.is_set():
            self.reason = reason
            self._event.set()

    async def wait(self) -> None:
        await self._event.wait()


CALL_KINDS = ("chat", "embedding")


@dataclass(frozen=True)
class Usage:
    """One billable model call: token counts; the cost is priced when its ledger row is
    written, from the price in force then.

    ``kind`` is ``chat`` or ``embedding``. ``estimated``: the stream was cut before the
    model reported its usage, so the counts are what the handler saw (chunks streamed,
    its own guess at the prompt); a handler whose stream breaks yields such a record
    before it raises.

    ``cached_tokens`` is the part of ``prompt_tokens`` the provider served from its
    prompt cache, ``reasoning_tokens`` the part of ``completion_tokens`` spent on
    reasoning: parts of the totals (as the OpenAI API reports them), priced apart.
    """

    model: str
    prompt_tokens: int
    completion_tokens: int
    kind: str = "chat"
    estimated: bool = False
    cached_tokens: int = 0
    reasoning_tokens: int = 0

    def __post_init__(self) -> None:
        if self.kind not in CALL_KINDS:
            raise ValueError(f"usage kind {self.kind!r} is not one of {', '.join(CALL_KINDS)}")
        if self.prompt_tokens < 0 or self.completion_tokens < 0:
            raise ValueError("token counts cannot be negative")
        if not 0 <= self.cached_tokens <= self.prompt_tokens:
            raise ValueError("cached_tokens must be between 0 and prompt_tokens")
        if not 0 <= self.reasoning_tokens <= self.completion_tokens:
            raise ValueError("reasoning_tokens must be between 0 and completion_tokens")


@dataclass(frozen=True)
class ToolActivity:
    """A visible ``tool`` chunk; ``content`` is JSON (see docs/design.md, section 5)."""

    content: str


@dataclass(frozen=True)
class Status:
    """A visible ``status`` chunk: JSON about how the answer is being made (e.g. the
    model a fallback switched to; docs/design.md, section 5), not part of the answer."""

    content: str


class RunFailed(HandlerError):
    """The run cannot succeed by trying again (e.g. the tool-turn limit): it ends
    ``failed`` with this message at once, without using the retry budget."""


Item = str | Usage | ToolActivity | Status


@dataclass(frozen=True)
class RunContext:
    """One attempt of one run, as a handler sees it.

    ``input`` is the submitted JSON object; ``attempt`` numbers the run's attempts from
    1; ``cancel`` is set when the attempt must stop (see the module docstring).
    ``turns``: the session's earlier turns, oldest first, within the context budget
    (koda/lifecycle/turns.py); the run's own input is not among them.
    ``max_output_tokens`` (``KODA_MAX_OUTPUT_TOKENS``; None: no limit): the most tokens
    a handler asks its model to write per call (OpenAI's ``max_completion_tokens``).
    """

    run_id: str
    user_id: str
    input: dict[str, Any]
    attempt: int
    cancel: CancelToken = field(default_factory=CancelToken)
    turns: tuple[Turn, ...] = ()
    max_output_tokens: int | None = None


class Handler(Protocol):
    """The job a worker runs: ``stream`` once per attempt, ``aclose`` once at shutdown.

    ``name`` identifies it in logs, and prices an estimated call of a handler without a
    ``model`` attribute. koda/handlers.py exports this API and says how to plug one in.
    """

    name: str

    def stream(self, ctx: RunContext) -> AsyncIterator[Item]:
        """Yield the run's chunks in order, and usage records."""
        ...

    async def aclose(self) -> None:
        """Release connections (called once at worker shutdown)."""
        ...
