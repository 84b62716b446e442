"""A deterministic demo model: reproducible tokens from the input.

Switches, read from ``input["demo"]`` (all optional):

    tokens          number of chunks (default 12)
    delay_ms        pause before each chunk (default 20)
    fail_attempts   attempts 1..N raise after emitting half their chunks, reporting
                    an estimated usage record for them first (default 0)
    hang            never finish (until cancelled)
    token_bytes     approximate size of each chunk (default 6); 2000000 with
                    ``tokens: 1`` is one 2 MB chunk, which the worker writes as several
    dirty           each chunk carries a NUL and a lone surrogate (``\x00``, ``\ud800``)
                    after its first character, as a broken model's output may: the
                    worker stores them as U+FFFD (default false)
    usage_each      one model call per chunk: a usage record (1 prompt token, 1
                    completion token) after each chunk, as an agent making a call
                    per step reports them (default false)
    stamp           prefix each chunk with the wall-clock time of its yield
                    (``<unix seconds> ``), for latency benchmarks (default false)
    distil_pause_ms on the first try of the run's memory distillation (after the run
                    is done: processors/memory/distiller.py), wait this long first
                    (for tests that kill the worker there or run the next run meanwhile)
    distil_fail_tries  the first N tries of that distillation fail (default 0)
    outage_until    a downstream outage for drills: until this wall-clock time (unix
                    seconds) every chunk fails (``outage: "fail"``, the default) or
                    waits ``outage_delay_ms`` more (``outage: "slow"``, default 1000);
                    after it the handler is healthy again, with no action by anyone
    echo_turns      first chunk says what the run sees of its session: the number of
                    earlier turns and each turn's user text (``turns=2 | a | b``
                    then a newline); the other chunks are as without it

When memory is on, the worker's distiller asks :meth:`DemoHandler.distil` for the
run's memories after the run is done: the first-person statements of the input
(processors/memory/distil.py has the rule).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import time
from collections.abc import AsyncIterator
from typing import Any

from koda_runtime.errors import HandlerError
from koda_runtime.lifecycle.handler import RunContext, Usage
from koda_runtime.processors.memory.distil import Statement, demo_statements, statement
from koda_runtime.processors.memory.service import MemoryService

log = logging.getLogger(__name__)

MODEL = "demo-1"
WORDS = (
    "the quick brown fox jumps over lazy dogs while kafka keeps every partition in order "
    "and postgres remembers what was said"
).split()


def _opts(raw: Any) -> dict[str, Any]:
    return raw if isinstance(raw, dict) else {}


def prompt_text(inp: dict[str, Any]) -> str:
    text = inp.get("text", inp.get("prompt", ""))
    return text if isinstance(text, str) else str(text)


def demo_tokens(inp: dict[str, Any]) -> list[str]:
    """The exact chunks the demo model produces for ``inp`` (any attempt), ``dirty``
    ones as they are yielded (before the worker cleans them)."""
    opts = _opts(inp.get("demo"))
    n = int(opts.get("tokens", 12))
    size = int(opts.get("token_bytes", 6))
    seed = hashlib.sha256(prompt_text(inp).encode()).digest()
    rng = random.Random(seed)  # noqa: S311 - deterministic text, not crypto
    out = []
    for _ in range(n):
        word = WORDS[rng.randrange(len(WORDS))]
        token = (word + " ") if size <= len(word) + 1 else (word + " ") * (size // (len(word) + 1))
        out.append(token[:1] + "\x00\ud800" + token[1:] if opts.get("dirty") else token)
    return out


def echo_turns(ctx: RunContext) -> str:
    """The ``echo_turns`` chunk: the earlier turns the run was given."""
    said = "".join(f" | {t.user_text}{' (cut)' if t.cut else ''}" for t in ctx.turns)
    return f"turns={len(ctx.turns)}{said}\n"


class DemoHandler:
    name = "demo"
    model = MODEL

    def __init__(self, memory: MemoryService | None = None) -> None:
        self._memory = memory

    async def stream(self, ctx: RunContext) -> AsyncIterator[str | Usage]:
        opts = _opts(ctx.input.get("demo"))
        tokens = demo_tokens(ctx.input)
        delay = float(opts.get("delay_ms", 20)) / 1000.0
        fail_attempts = int(opts.get("fail_attempts", 0))
        stamp = bool(opts.get("stamp", False))
        usage_each = bool(opts.get("usage_each", False))
        fail_at = len(tokens) // 2 if ctx.attempt <= fail_attempts else None
        outage_until = float(opts.get("outage_until", 0))
        slow_outage = opts.get("outage") == "slow"
        outage_delay = float(opts.get("outage_delay_ms", 1000)) / 1000.0
        if opts.get("echo_turns"):
            yield echo_turns(ctx)
        for i, token in enumerate(tokens):
            if ctx.cancel.cancelled:
                return
            if time.time() < outage_until:
                if not slow_outage:
                    raise HandlerError("demo downstream outage (outage_until)")
                await asyncio.sleep(outage_delay)
            if fail_at is not None and i == fail_at:
                # The cut call was billed for what it streamed: say so, then fail.
                yield Usage(MODEL, len(prompt_text(ctx.input).split()), i, estimated=True)
                raise HandlerError(f"demo failure on attempt {ctx.attempt} (fail_attempts)")
            if delay:
                await asyncio.sleep(delay)
            yield f"{time.time():.6f} {token}" if stamp else token
            if usage_each:
                yield Usage(MODEL, 1, 1)
        if fail_at is not None:
            raise HandlerError(f"demo failure on attempt {ctx.attempt} (fail_attempts)")
        if opts.get("hang"):
            await ctx.cancel.wait()
            return
        if not usage_each:
            yield Usage(MODEL, len(prompt_text(ctx.input).split()), len(tokens))

    @property
    def memory(self) -> MemoryService | None:
        return self._memory

    async def distil(self, ctx: RunContext, tries: int) -> tuple[list[Statement], list[Usage]]:
        """The run's statements worth remembering (no model call: no usage)."""
        opts = _opts(ctx.input.get("demo"))
        pause_ms = float(opts.get("distil_pause_ms", 0))
        if tries == 1 and pause_ms > 0:
            log.info("demo distil pause run_id=%s try=%d ms=%.0f", ctx.run_id, tries, pause_ms)
            await asyncio.sleep(pause_ms / 1000.0)
        if tries <= int(opts.get("distil_fail_tries", 0)):
            raise HandlerError(f"demo distillation failure on try {tries} (distil_fail_tries)")
        return [statement(s) for s in demo_statements(prompt_text(ctx.input))], []

    async def aclose(self) -> None:
        return None
