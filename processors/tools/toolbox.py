"""Running the tools users add, with the journal that makes a side effect happen once.

One :class:`Toolbox` per worker holds the declared tools and the journal; the executor
binds each attempt's fence to it (:meth:`Toolbox.bind`) and the model loop asks it
for the attempt's :class:`Steps`. A call's answer is always text for the model:

* arguments that do not fit the schema: an error naming what was wrong (the tool is
  not called, nothing is journaled);
* a tool that raises or passes its ``timeout_s``: called again up to ``retries``
  times (same idempotency key), then an error result;
* a value that is not JSON, or over :data:`MAX_RESULT_BYTES`: an error result.

The journal rule (docs/decisions/0022-tools-journal-and-waiting.md): a side-effect (or
approval) tool's call is the next *position* of the run's live line of journaled
calls. While the calls of a rerun match the live line in order (same tool, same
arguments as canonical JSON) their results are replayed from the journal, or, for a
step found ``initiated`` and never finished, the tool is called again with the same
idempotency key. From the first call that does not match, the rest of the live line
is superseded and new steps are recorded. Read-only tools are not journaled.

A tool declared ``approval=True`` is journaled too. Its new step is recorded
``awaiting`` and the attempt stops with :class:`AwaitingApproval`: the executor makes
the run ``waiting`` (docs/decisions/0022-tools-journal-and-waiting.md). The resumed
attempt replays up to
that step, then calls the tool if it was approved, or gives the model
:data:`REJECTED` if it was rejected (:data:`TIMED_OUT` once ``KODA_APPROVAL_TIMEOUT_S``
passed).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from koda_runtime.errors import HandlerError
from koda_runtime.lifecycle.chunks import content_bytes, storable
from koda_runtime.lifecycle.handler import RunContext
from koda_runtime.processors.tools.journal import Journal
from koda_runtime.processors.tools.registry import Tool, ToolArgumentError, ToolContext
from koda_runtime.schemas.epochs import Fence
from koda_runtime.schemas.journal import APPROVED, AWAITING, INITIATED, Journaled, Step

log = logging.getLogger("koda.tools")

# The most UTF-8 bytes of one tool result the model is given (its `tool` chunk must
# stay one storable chunk; koda_runtime.lifecycle.chunks.MAX_CHUNK_BYTES).
MAX_RESULT_BYTES = 32 * 1024
# What the model is told of a call a person rejected (or nobody approved in time).
REJECTED = "error: the user rejected this call; it was not made. Do not retry it."
TIMED_OUT = (
    "error: nobody approved this call in time (KODA_APPROVAL_TIMEOUT_S); it was not made. "
    "Do not retry it."
)


class AwaitingApproval(HandlerError):
    """The model called an approval tool: the attempt stops and the run waits."""

    def __init__(self, step: int, name: str, arguments: str, call_id: str) -> None:
        super().__init__(f"tool {name!r} (step {step}) waits for approval")
        self.step = step
        self.name = name
        self.arguments = arguments
        self.call_id = call_id

    def event(self) -> str:
        """The ``approval_required`` chunk's JSON."""
        return json.dumps(
            {
                "call_id": self.call_id,
                "name": self.name,
                "arguments": json.loads(self.arguments),
                "step": self.step,
            },
            separators=(",", ":"),
        )


@dataclass(frozen=True)
class ToolOutcome:
    """A call's answer for the model; ``replayed``: taken from the journal, the tool was
    not called; ``step``: its journal step (None: not journaled)."""

    result: str
    replayed: bool = False
    step: int | None = None


def canonical(raw: str) -> str:
    """The model's JSON arguments as the journal compares them: sorted keys, no spaces."""
    return json.dumps(json.loads(raw) if raw.strip() else {}, sort_keys=True, separators=(",", ":"))


class Toolbox:
    """The worker's tools, its journal, and the fence of each attempt in progress."""

    def __init__(
        self,
        tools: dict[str, Tool],
        journal: Journal | None = None,
        *,
        approval_timeout_s: float = 3600.0,
    ) -> None:
        self.tools = tools
        self.journal = journal
        self.approval_timeout_s = approval_timeout_s
        self._fences: dict[str, tuple[int, Fence]] = {}

    def definitions(self) -> list[dict[str, Any]]:
        return [t.definition() for t in self.tools.values()]

    def bind(self, run_id: str, attempt: int, fence: Fence) -> None:
        """The executor's attempt ``attempt`` of ``run_id`` writes under ``fence``."""
        self._fences[run_id] = (attempt, fence)

    def release(self, run_id: str) -> None:
        self._fences.pop(run_id, None)

    def fence_of(self, ctx: RunContext) -> Fence | None:
        bound = self._fences.get(ctx.run_id)
        return bound[1] if bound is not None and bound[0] == ctx.attempt else None

    def attempt(self, ctx: RunContext) -> Steps:
        return Steps(self, ctx)


class Steps:
    """The tool calls of one attempt, in order."""

    def __init__(self, box: Toolbox, ctx: RunContext) -> None:
        self.box = box
        self.ctx = ctx
        self.position = 0  # journaled calls so far
        self.diverged = False  # a call left the journal's live line: record from here
        self._journaled: Journaled | None = None

    async def call(self, name: str, raw_arguments: str, call_id: str = "") -> ToolOutcome:
        t = self.box.tools[name]
        try:
            kwargs = t.parse(raw_arguments)
        except ToolArgumentError as exc:
            return ToolOutcome(f"error: {exc}")
        journal, fence = self.box.journal, self.box.fence_of(self.ctx)
        if t.approval and (journal is None or fence is None):
            return ToolOutcome(
                f"error: {name} needs a person's approval, which cannot be asked here"
            )
        if not t.journaled or journal is None or fence is None:
            return ToolOutcome(await execute(t, kwargs, self._context(None)))
        arguments = canonical(raw_arguments)
        run_id = self.ctx.run_id
        self.position += 1
        position = self.position
        if self._journaled is None:
            self._journaled = await journal.load(run_id)
        j = self._journaled
        live = j.steps[position - 1] if not self.diverged and position <= len(j.steps) else None
        if live is not None and (live.tool, live.arguments) == (name, arguments):
            if live.finished:
                log.info("tool step replayed run_id=%s step=%d tool=%s", run_id, live.step, name)
                return ToolOutcome(live.result or "", replayed=True, step=live.step)
            if live.status == AWAITING:
                decided = await self._decided(journal, fence, live, call_id)
                if decided is not None:
                    return decided
            # Initiated, never finished: its call may or may not have happened. Called
            # again with the same idempotency key, which the service downstream dedupes.
            step = live.step
            if live.status == INITIATED:
                await journal.call_again(fence, run_id, step=step, attempt=self.ctx.attempt)
                log.info("tool step called again run_id=%s step=%d tool=%s", run_id, step, name)
        else:
            if live is not None:  # the model asked something else: the rest is not asked
                await journal.supersede(fence, run_id, position=position)
                log.info(
                    "tool journal left run_id=%s position=%d: the model asked %s, not %s",
                    run_id,
                    position,
                    name,
                    live.tool,
                )
            self.diverged = True
            j.last_step += 1
            step = j.last_step
            if t.approval:
                await journal.await_approval(
                    fence,
                    run_id,
                    step=step,
                    position=position,
                    tool=name,
                    arguments=arguments,
                    attempt=self.ctx.attempt,
                )
                log.info("tool step awaits approval run_id=%s step=%d tool=%s", run_id, step, name)
                raise AwaitingApproval(step, name, arguments, call_id)
            await journal.initiate(
                fence,
                run_id,
                step=step,
                position=position,
                tool=name,
                arguments=arguments,
                attempt=self.ctx.attempt,
            )
        result = await execute(t, kwargs, self._context(step))
        await journal.finish(fence, run_id, step=step, result=result)
        return ToolOutcome(result, step=step)

    async def _decided(
        self, journal: Journal, fence: Fence, live: Step, call_id: str
    ) -> ToolOutcome | None:
        """An ``awaiting`` step on a resumed attempt: still waiting (AwaitingApproval),
        rejected or timed out (the outcome, journaled), or approved (None: call it)."""
        run_id, step = self.ctx.run_id, live.step
        decision, by = live.decision, live.decided_by
        if decision is None and live.age_s >= self.box.approval_timeout_s:
            await journal.time_out(fence, run_id, step=step)
            decision, by = "rejected", "timeout"
        if decision is None:
            raise AwaitingApproval(step, live.tool, live.arguments, call_id)
        if decision == APPROVED:
            await journal.start_approved(fence, run_id, step=step, attempt=self.ctx.attempt)
            log.info("tool step approved run_id=%s step=%d tool=%s", run_id, step, live.tool)
            return None
        result = TIMED_OUT if by == "timeout" else REJECTED
        await journal.finish(fence, run_id, step=step, result=result)
        log.info(
            "tool step rejected run_id=%s step=%d tool=%s by=%s",
            run_id,
            step,
            live.tool,
            "timeout" if by == "timeout" else "user",
        )
        return ToolOutcome(result, step=step)

    def _context(self, step: int | None) -> ToolContext:
        ctx = self.ctx
        key = f"{ctx.run_id}:{step}" if step is not None else f"{ctx.run_id}:a{ctx.attempt}"
        return ToolContext(ctx.run_id, ctx.user_id, step, key, ctx.attempt)


async def execute(t: Tool, kwargs: dict[str, Any], context: ToolContext) -> str:
    """Call ``t`` with its timeout and retry rule; the result (or the error) as text."""
    if t.ctx_param is not None:
        kwargs = {**kwargs, t.ctx_param: context}
    error = ""
    tries = t.retries + 1
    for n in range(1, tries + 1):
        try:
            if inspect.iscoroutinefunction(t.fn):
                value = await asyncio.wait_for(t.fn(**kwargs), t.timeout_s)
            else:  # a blocking function runs in a thread (left running past its timeout)
                value = await asyncio.wait_for(asyncio.to_thread(t.fn, **kwargs), t.timeout_s)
        except TimeoutError:
            error = f"error: tool {t.name!r} did not answer within {t.timeout_s:g} s"
        except Exception as exc:  # noqa: BLE001 - a tool's failure is the model's to read
            error = f"error: tool {t.name!r} failed: {type(exc).__name__}: {str(exc)[:500]}"
        else:
            return serialized(t, value)
        log.warning(
            "tool call failed run_id=%s tool=%s try=%d of %d: %s",
            context.run_id,
            t.name,
            n,
            tries,
            error[:200],
        )
    return error + (f" (tried {tries} times)" if tries > 1 else "")


def serialized(t: Tool, value: Any) -> str:
    """A tool's return value as the model's text: a str as it is, a pydantic model or a
    JSON value as JSON; anything else (or too big) is an error result."""
    try:
        if isinstance(value, str):
            text = value
        elif isinstance(value, BaseModel):
            text = value.model_dump_json()
        else:
            text = json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        return (
            f"error: tool {t.name!r} returned a value that is not JSON "
            f"({type(value).__name__}): {str(exc)[:200]}"
        )
    text = storable(text)
    size = content_bytes(text)
    if size > MAX_RESULT_BYTES:
        return (
            f"error: tool {t.name!r} returned {size} bytes, over the cap of "
            f"{MAX_RESULT_BYTES} bytes per result"
        )
    return text
