"""Stream from any OpenAI-compatible ``/v1/chat/completions`` endpoint.

Input: ``{"text": "..."}`` or ``{"messages": [{"role": ..., "content": ...}, ...]}``.
Usage comes from the final chunk (``stream_options.include_usage``): one usage row
per model call, plus one per embedding call (kind ``embedding``). A stream cut before
its usage (a broken connection, a stream ending without ``[DONE]``) is still billed:
the handler yields an estimated usage record (completion tokens = content pieces
streamed, prompt tokens ~ 4 characters each) and then fails the attempt. A provider's
faults (429, 5xx, a 4xx, a cut) and the fallback model are handled per call by the
rules of processors/handlers/provider.py.

With memory on (``KODA_MEMORY``, the default) the model is offered the built-in
``memory_search`` tool, may get the user's most relevant memories in a system message
(``KODA_MEMORY_AUTO_INJECT``), and after the answer one more model call distils what
the user said into memories.

Tools users add (processors/tools/, given by the worker through ``use_tools``) are
offered too; their calls go through the toolbox (argument checks, timeouts, retries,
and the journal that replays a side effect's result on a rerun).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import httpx

from koda_runtime import tracing
from koda_runtime.errors import ConfigError, HandlerError
from koda_runtime.lifecycle.handler import Item, RunContext, RunFailed, Status, ToolActivity, Usage
from koda_runtime.metrics import (
    MODEL_CALL_SECONDS,
    MODEL_CALLS,
    MODEL_TIME_TO_FIRST_TOKEN_SECONDS,
    RUN_PHASE_SECONDS,
)
from koda_runtime.processors.handlers.conversation import with_turns
from koda_runtime.processors.handlers.provider import (
    Breaker,
    CallOutcome,
    CallPolicy,
    Route,
    classify,
    error_excerpt,
    retry_after_s,
)
from koda_runtime.processors.handlers.tools import ToolCall, ToolCallAssembler, activity
from koda_runtime.processors.memory import tool as tool_module
from koda_runtime.processors.memory.distil import Statement, statement
from koda_runtime.processors.memory.service import MemoryService

if TYPE_CHECKING:
    from koda_runtime.processors.tools import Steps, Toolbox

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 60.0
# The most UTF-8 bytes of arguments one tool call may have: a call over it ends the run
# `failed` naming this cap (its `tool` event must stay one storable chunk).
MAX_TOOL_ARGUMENT_BYTES = 16 * 1024


def request_messages(inp: dict[str, Any]) -> list[dict[str, str]]:
    messages = inp.get("messages")
    if isinstance(messages, list) and messages:
        return [{"role": str(m.get("role")), "content": str(m.get("content"))} for m in messages]
    text = inp.get("text", inp.get("prompt"))
    if not isinstance(text, str) or not text:
        raise HandlerError("input has neither 'messages' nor 'text'")
    return [{"role": "user", "content": text}]


DISTIL_PROMPT = (
    "From the user's messages below, list the durable facts the user stated about "
    "themselves, their life, preferences or plans, each as one short sentence in the "
    'third person ("The user lives in Lisbon."). Leave out questions, greetings and '
    "anything not stated by the user. Give each fact a subject: a short key naming what "
    'it is about, the same key for any later fact that would replace it ("home", '
    '"occupation", "employer", "diet", "favourite colour", "sister home", "dog name"). '
    'Answer with JSON only: {"statements": [{"text": "...", "subject": "..."}]}'
)


class OpenAIHandler:
    name = "openai"

    @property
    def model(self) -> str:
        return self._model

    def __init__(
        self,
        *,
        base_url: str,
        api_key: str | None,
        model: str,
        memory: MemoryService | None = None,
        max_tool_turns: int = 8,
        max_connections: int = 256,
        fallback_model: str | None = None,
        call_policy: CallPolicy | None = None,
    ) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ConfigError(f"KODA_OPENAI_BASE_URL={base_url!r} must be an http(s) URL")
        if fallback_model is not None and fallback_model == model:
            raise ConfigError(
                f"KODA_FALLBACK_MODEL={fallback_model!r} is KODA_OPENAI_MODEL itself: name "
                "another model, or leave it unset for no fallback"
            )
        self._policy = call_policy or CallPolicy()
        self._breaker = Breaker(model, fallback_model, self._policy)
        # The model each attempt's last call went to, by (run_id, attempt), so a switch is
        # announced once (a `status` chunk); bounded, oldest forgotten first.
        self._announced: OrderedDict[tuple[str, int], str] = OrderedDict()
        self._model = model
        self._memory = memory
        self._max_turns = max_tool_turns
        # The tools users add (processors/tools/), given by the worker: use_tools().
        self._toolbox: Toolbox | None = None
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(
            base_url=base_url.rstrip("/"),
            headers=headers,
            timeout=httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S),
            # One connection per model call the worker may make at once: httpx's default
            # of 100 would queue the runs past it inside the handler, unseen, as a
            # longer time to first token.
            limits=httpx.Limits(
                max_connections=max_connections, max_keepalive_connections=max_connections
            ),
        )

    def use_tools(self, toolbox: Toolbox) -> None:
        """Offer ``toolbox``'s tools to the model (besides ``memory_search``)."""
        self._toolbox = toolbox

    async def stream(self, ctx: RunContext) -> AsyncIterator[Item]:
        """The model loop: stream a completion; when it asks for tools, run them, feed
        the results back and stream the next completion, up to ``max_tool_turns``
        completions. The run's memories are distilled after it is done (:meth:`distil`)."""
        messages: list[dict[str, Any]] = with_turns(ctx.turns, request_messages(ctx.input))
        tools = [tool_module.DEFINITION] if self._memory is not None else []
        steps = None
        if self._toolbox is not None and self._toolbox.tools:
            tools += self._toolbox.definitions()
            steps = self._toolbox.attempt(ctx)
        if self._memory is not None:
            recalled, usage = await self._memory.for_prompt(ctx, _last_user_text(messages))
            for u in usage:
                yield u
            if recalled:
                lines = "\n".join(f"- {text}" for text in recalled)
                messages.insert(
                    0,
                    {
                        "role": "system",
                        "content": "What this user told you in earlier conversations "
                        f"(their long-term memory):\n{lines}",
                    },
                )
        for _turn in range(self._max_turns):
            assembler = ToolCallAssembler()
            text: list[str] = []
            async for item in self._complete(ctx, messages, tools, assembler):
                if isinstance(item, str):
                    text.append(item)
                yield item
            if ctx.cancel.cancelled:
                return
            calls = assembler.calls()
            if not calls:
                break
            _check_arguments(calls)
            messages.append(
                {
                    "role": "assistant",
                    "content": "".join(text) or None,
                    "tool_calls": [c.message() for c in calls],
                }
            )
            for call in calls:
                yield ToolActivity(
                    activity(call_id=call.id, name=call.name, arguments=call.arguments)
                )
                with tracing.span(f"execute_tool {call.name[:80]}", attributes=_tool_attrs(call)):
                    result, usage, replayed = await self._run_tool(ctx, call, steps)
                for u in usage:
                    yield u
                yield ToolActivity(
                    activity(call_id=call.id, name=call.name, result=result)
                    if not replayed
                    else activity(call_id=call.id, name=call.name, result=result, replayed=True)
                )
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        else:
            raise RunFailed(
                f"the model asked for tools in all {self._max_turns} model turns allowed "
                "(KODA_MAX_TOOL_TURNS) without giving a final answer"
            )

    @property
    def memory(self) -> MemoryService | None:
        return self._memory

    async def distil(self, ctx: RunContext, tries: int) -> tuple[list[Statement], list[Usage]]:
        """The run's statements worth remembering, with their subjects: one model call,
        made by the worker's distiller after the run is done (processors/memory/
        distiller.py), never on the run's path. HandlerError: try again later."""
        return await self._distil(ctx)

    async def _run_tool(
        self, ctx: RunContext, call: ToolCall, steps: Steps | None
    ) -> tuple[str, list[Usage], bool]:
        """The call's result for the model, its usage, and whether the journal replayed
        it (processors/tools/toolbox.py)."""
        if call.name == tool_module.NAME and self._memory is not None:
            result, usage = await self._memory.search_tool(ctx, call.arguments)
            return result, usage, False
        if steps is not None and call.name in steps.box.tools:
            outcome = await steps.call(call.name, call.arguments, call.id)
            return outcome.result, [], outcome.replayed
        return f"error: there is no tool named {call.name!r}", [], False

    async def _complete(
        self,
        ctx: RunContext,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]],
        assembler: ToolCallAssembler,
    ) -> AsyncIterator[str | Usage | Status]:
        body: dict[str, Any] = {
            "model": self._model,
            "messages": messages,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if ctx.max_output_tokens is not None:  # KODA_MAX_OUTPUT_TOKENS
            body["max_completion_tokens"] = ctx.max_output_tokens
        if tools:
            body["tools"] = tools
        async for item in self._call(ctx, body, assembler):
            yield item

    # -- one model call: tries, faults, the fallback (processors/handlers/provider.py) --

    async def _call(
        self, ctx: RunContext, body: dict[str, Any], assembler: ToolCallAssembler
    ) -> AsyncIterator[str | Usage | Status]:
        """Stream one completion of ``body``, trying again after a 429, a 5xx or a
        connection error within ``KODA_MODEL_RETRY_WINDOW``, on the model the breaker
        routes each try to (a switch is announced in a ``status`` chunk). RunFailed for
        a refusal (4xx); HandlerError for a stream cut mid-answer or a window spent."""
        deadline = time.monotonic() + self._policy.window_s
        tries = backoffs = 0
        while True:
            route = self._breaker.route()
            switched = self._announce(ctx, route)
            if switched is not None:
                yield switched
            tries += 1
            t = _Try()
            started = time.monotonic()
            t.span = _call_span(route.model, tries)
            try:
                async for item in self._try(ctx, {**body, "model": route.model}, assembler, t):
                    yield item
            except BaseException:
                t.outcome = CallOutcome.CANCELLED if ctx.cancel.cancelled else CallOutcome.CUT
                self._tried(route, t, started)
                raise
            self._tried(route, t, started)
            if t.outcome in (CallOutcome.OK, CallOutcome.CANCELLED):
                return
            if t.outcome is CallOutcome.REFUSED:
                raise RunFailed(
                    f"model provider refused the call (model {route.model}): HTTP {t.detail}"
                    " (not retried: the request or the API key must change)"
                )
            if t.outcome is CallOutcome.CUT:
                raise HandlerError(
                    f"model stream stopped mid-answer (model {route.model}): {t.detail}"
                )
            now = time.monotonic()
            if now >= deadline:
                raise HandlerError(
                    f"model endpoint still failing after {tries} tries in "
                    f"{self._policy.window_s:g} s (KODA_MODEL_RETRY_WINDOW): model "
                    f"{route.model} {t.outcome.value}: {t.detail}"
                )
            if route.primary and self._breaker.open and self._breaker.fallback is not None:
                wait, backoffs = 0.0, 0  # the breaker is open: on to the fallback at once
            else:
                backoffs += 1
                wait = self._policy.wait_s(t.outcome, backoffs, t.retry_after)
            wait = min(wait, deadline - now)
            log.warning(
                "model call failed run_id=%s model=%s outcome=%s try=%d retry_in=%.2fs: %s",
                ctx.run_id,
                route.model,
                t.outcome.value,
                tries,
                wait,
                t.detail[:200],
            )
            if await _cancelled_within(ctx, wait):
                return

    async def _try(
        self, ctx: RunContext, body: dict[str, Any], assembler: ToolCallAssembler, t: _Try
    ) -> AsyncIterator[str | Usage]:
        """One HTTP request of a call; what it came to goes to ``t``. A stream cut after
        it said something yields its estimated usage (unless the provider reported it)."""
        model = str(body["model"])
        watched = _Watched(assembler)
        started = time.monotonic()
        try:
            async with self._client.stream("POST", "/v1/chat/completions", json=body) as resp:
                if resp.status_code != 200:
                    t.outcome = classify(resp.status_code)
                    t.detail = f"{resp.status_code}: {error_excerpt(await resp.aread())}"
                    t.retry_after = retry_after_s(resp.headers)
                    return
                async for line in resp.aiter_lines():
                    if ctx.cancel.cancelled:
                        t.outcome = CallOutcome.CANCELLED
                        if t.streamed and not t.reported:
                            yield self._estimate(body, t.streamed)
                        return
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        if t.first_token_at is not None:
                            streaming = time.monotonic() - t.first_token_at
                            RUN_PHASE_SECONDS.labels(phase="streaming").observe(streaming)
                        return
                    for item in parse_event(data, model, watched):
                        if isinstance(item, Usage):
                            t.reported, t.usage = True, item
                        else:
                            if not t.streamed:
                                t.first_token_at = time.monotonic()
                                MODEL_TIME_TO_FIRST_TOKEN_SECONDS.labels(model=model).observe(
                                    t.first_token_at - started
                                )
                            t.streamed += 1
                        yield item
                    t.fed = watched.fed
                t.detail = "the stream ended before [DONE]"
        except httpx.HTTPError as exc:
            t.detail = f"{type(exc).__name__}: {str(exc)[:200]}"
        # Cut: before anything was said, the call can simply be made again.
        t.outcome = CallOutcome.CUT if t.progressed else CallOutcome.CONNECTION_ERROR
        if t.streamed and not t.reported:
            yield self._estimate(body, t.streamed)

    def _tried(self, route: Route, t: _Try, started: float) -> None:
        """A try's outcome on the metrics, in the breaker and on its span."""
        outcome = t.outcome
        MODEL_CALLS.labels(model=route.model, outcome=outcome.value).inc()
        MODEL_CALL_SECONDS.labels(model=route.model).observe(time.monotonic() - started)
        self._breaker.record(route, outcome)
        if t.span.is_recording():
            _end_call_span(t, started)

    def _announce(self, ctx: RunContext, route: Route) -> Status | None:
        """A ``status`` chunk when this attempt's call goes to another model than its
        last one did (the primary, at first): which model now answers, and why."""
        key = (ctx.run_id, ctx.attempt)
        last = self._announced.get(key, self._model)
        if route.model == last:
            return None
        self._announced[key] = route.model
        self._announced.move_to_end(key)
        while len(self._announced) > ANNOUNCED_KEPT:
            self._announced.popitem(last=False)
        content: dict[str, Any] = {"model": route.model, "fallback": not route.primary}
        if not route.primary:
            content["reason"] = f"the primary model {self._model} is failing"
        return Status(json.dumps(content))

    def _estimate(self, body: dict[str, Any], streamed: int) -> Usage:
        chars = sum(len(str(m.get("content") or "")) for m in body["messages"])
        return Usage(str(body["model"]), (chars + 3) // 4, streamed, estimated=True)

    async def _distil(self, ctx: RunContext) -> tuple[list[Statement], list[Usage]]:
        """One model call: the statements worth remembering from the user's messages."""
        said = [m["content"] for m in request_messages(ctx.input) if m["role"] == "user"]
        if not any(s.strip() for s in said):
            return [], []
        body: dict[str, Any] = {
            "model": self._breaker.current_model(),
            "messages": [
                {"role": "system", "content": DISTIL_PROMPT},
                {"role": "user", "content": "\n\n".join(said)},
            ],
            "response_format": {"type": "json_object"},
        }
        if ctx.max_output_tokens is not None:  # KODA_MAX_OUTPUT_TOKENS
            body["max_completion_tokens"] = ctx.max_output_tokens
        try:
            resp = await self._client.post("/v1/chat/completions", json=body)
        except httpx.HTTPError as exc:
            raise HandlerError(f"memory distillation failed: {type(exc).__name__}: {exc}") from exc
        if resp.status_code != 200:
            raise HandlerError(
                f"memory distillation answered {resp.status_code}: {resp.text[:200]}"
            )
        try:
            obj = resp.json()
        except ValueError as exc:
            raise HandlerError(f"memory distillation answer is not JSON: {exc}") from exc
        if not isinstance(obj, dict):
            raise HandlerError("memory distillation answer is not a JSON object")
        raw_usage = obj.get("usage")
        usage_obj: dict[str, Any] = raw_usage if isinstance(raw_usage, dict) else {}
        # The call was made and answered: it is a usage row whatever its content.
        usage = [usage_of(usage_obj, str(obj.get("model") or body["model"]))]
        try:
            content = obj["choices"][0]["message"]["content"]
            statements = json.loads(content)["statements"]
            if not isinstance(statements, list):
                raise TypeError("'statements' is not a list")
        except (KeyError, IndexError, TypeError, json.JSONDecodeError) as exc:
            log.warning(
                "memory not written run_id=%s: distillation answer is not the JSON asked for (%r)",
                ctx.run_id,
                exc,
            )
            return [], usage
        return _statements(statements), usage

    async def aclose(self) -> None:
        await self._client.aclose()


def _call_span(model: str, tries: int) -> tracing.Span:
    """One try's span, a child of the attempt's (not made current: the try spans the
    generator's yields). Named as OpenTelemetry's GenAI conventions name a chat call."""
    if not tracing.ON:
        return tracing.INVALID_SPAN
    return tracing.start(
        f"chat {model}",
        kind=tracing.SpanKind.CLIENT,
        attributes={
            "gen_ai.operation.name": "chat",
            "gen_ai.provider.name": "openai",
            "gen_ai.request.model": model,
            "koda.model.try": tries,
        },
    )


def _end_call_span(t: _Try, started: float) -> None:
    """The try's outcome, time to first token (an attribute and an event) and tokens."""
    span = t.span
    span.set_attribute("koda.model.outcome", t.outcome.value)
    if t.first_token_at is not None:
        span.set_attribute("gen_ai.response.time_to_first_token", t.first_token_at - started)
        tracing.event_at(span, "first_token", t.first_token_at)
    if t.usage is not None:
        span.set_attributes(
            {
                "gen_ai.response.model": t.usage.model,
                "gen_ai.usage.input_tokens": t.usage.prompt_tokens,
                "gen_ai.usage.output_tokens": t.usage.completion_tokens,
            }
        )
    if t.outcome not in (CallOutcome.OK, CallOutcome.CANCELLED):
        tracing.failed(span, f"{t.outcome.value}: {t.detail}")
    span.end()


def _tool_attrs(call: ToolCall) -> dict[str, str] | None:
    if not tracing.ON:
        return None
    return {"gen_ai.tool.name": call.name[:80], "gen_ai.tool.call.id": call.id[:80]}


def _statements(raw: list[Any]) -> list[Statement]:
    """The distillation's statements: objects with ``text`` and ``subject``, or plain
    strings (their subject found by processors/memory/truth.py's rules)."""
    out: list[Statement] = []
    for item in raw:
        if isinstance(item, str) and item.strip():
            out.append(statement(item))
        elif isinstance(item, dict) and isinstance(item.get("text"), str) and item["text"].strip():
            subject = item.get("subject")
            out.append(statement(item["text"], subject if isinstance(subject, str) else None))
    return out


def _check_arguments(calls: list[ToolCall]) -> None:
    """RunFailed naming the cap when a call's arguments are over MAX_TOOL_ARGUMENT_BYTES."""
    for call in calls:
        size = len(call.arguments.encode("utf-8", "replace"))
        if size > MAX_TOOL_ARGUMENT_BYTES:
            raise RunFailed(
                f"tool_arguments: the model's call of {call.name[:80]!r} has {size} bytes of "
                f"arguments, over the cap of {MAX_TOOL_ARGUMENT_BYTES} bytes per tool call"
            )


def _last_user_text(messages: list[dict[str, Any]]) -> str:
    for m in reversed(messages):
        if m.get("role") == "user":
            return str(m.get("content") or "")
    return ""


def parse_event(
    data: str, default_model: str, assembler: ToolCallAssembler | None = None
) -> list[str | Usage]:
    """Turn one ``data:`` payload into chunk texts and usage records; ``tool_calls``
    fragments go to ``assembler``."""
    try:
        obj = json.loads(data)
    except json.JSONDecodeError as exc:
        raise HandlerError(f"model endpoint sent invalid JSON: {exc}") from exc
    out: list[str | Usage] = []
    for choice in obj.get("choices") or []:
        delta = choice.get("delta") or {}
        content = delta.get("content")
        if content:
            out.append(content)
        if delta.get("tool_calls") is not None:
            if assembler is None:
                raise HandlerError("model sent tool_calls but no tools were offered")
            assembler.feed(delta["tool_calls"])
    usage = obj.get("usage")
    if usage:
        out.append(usage_of(usage, str(obj.get("model") or default_model)))
    return out


# -- a model provider's faults (the rules are processors/handlers/provider.py's) --------

# How many attempts' last model (for the `status` chunk of a switch) a worker keeps.
ANNOUNCED_KEPT = 4096


def usage_of(usage: Any, model: str) -> Usage:
    """A call's ``usage`` object as a record: prompt and completion tokens, and the
    cached input (``prompt_tokens_details.cached_tokens``) and reasoning
    (``completion_tokens_details.reasoning_tokens``) parts of them. A missing or
    malformed count is 0; a part is never more than its total."""
    if not isinstance(usage, dict):
        usage = {}

    def count(obj: Any, key: str) -> int:
        value = obj.get(key) if isinstance(obj, dict) else None
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0

    pt, ct = count(usage, "prompt_tokens"), count(usage, "completion_tokens")
    cached = count(usage.get("prompt_tokens_details"), "cached_tokens")
    reasoning = count(usage.get("completion_tokens_details"), "reasoning_tokens")
    return Usage(model, pt, ct, cached_tokens=min(cached, pt), reasoning_tokens=min(reasoning, ct))


class _Try:
    """What one try of a model call came to (filled in by ``OpenAIHandler._try``)."""

    def __init__(self) -> None:
        self.outcome = CallOutcome.OK
        self.detail = ""
        self.retry_after: float | None = None
        self.streamed = 0  # content pieces yielded
        self.first_token_at: float | None = None  # monotonic time of the first piece
        self.reported = False  # the usage came
        self.fed = False  # tool-call fragments came
        self.usage: Usage | None = None  # the provider's usage record, once it came
        self.span: tracing.Span = tracing.INVALID_SPAN  # the try's span (koda/tracing.py)

    @property
    def progressed(self) -> bool:
        """Whether the try said anything: then it cannot be made again unseen."""
        return bool(self.streamed or self.reported or self.fed)


class _Watched(ToolCallAssembler):
    """Feeds ``inner`` and notes that a tool-call fragment came."""

    def __init__(self, inner: ToolCallAssembler) -> None:
        super().__init__()
        self.inner = inner
        self.fed = False

    def feed(self, fragments: Any) -> None:
        self.fed = True
        self.inner.feed(fragments)


async def _cancelled_within(ctx: RunContext, seconds: float) -> bool:
    """Wait ``seconds`` unless the attempt is cancelled first; whether it was."""
    if seconds > 0:
        try:
            await asyncio.wait_for(ctx.cancel.wait(), timeout=seconds)
        except TimeoutError:
            pass
    return ctx.cancel.cancelled
