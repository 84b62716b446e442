"""Stream from any OpenAI-compatible ``/v1/chat/completions`` endpoint.

Input: ``{"text": "..."}`` or ``{"messages": [{"role": ..., "content": ...}, ...]}``.
Usage comes from the final chunk (``stream_options.include_usage``): one usage row
per model call, plus one per embedding call (kind ``embedding``). A stream cut before
its usage (a broken connection, a stream ending without ``[DONE]``) is still billed:
the handler yields an estimated usage record (completion tokens = content pieces
streamed, prompt tokens ~ 4 characters each) and then fails the attempt.

With memory on (``KODA_MEMORY``, the default) the model is offered the built-in
``memory_search`` tool, may get the user's most relevant memories in a system message
(``KODA_MEMORY_AUTO_INJECT``), and after the answer one more model call distils what
the user said into memories.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx

from koda_runtime.errors import ConfigError, HandlerError
from koda_runtime.lifecycle.handler import Item, RunContext, RunFailed, ToolActivity, Usage
from koda_runtime.processors.handlers.tools import ToolCall, ToolCallAssembler, activity
from koda_runtime.processors.memory import tool as tool_module
from koda_runtime.processors.memory.service import MemoryService

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 60.0


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
    'anything not stated by the user. Answer with JSON only: {"statements": [...]}'
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
    ) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ConfigError(f"KODA_OPENAI_BASE_URL={base_url!r} must be an http(s) URL")
        self._model = model
        self._memory = memory
        self._max_turns = max_tool_turns
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

    async def stream(self, ctx: RunContext) -> AsyncIterator[Item]:
        """The model loop: stream a completion; when it asks for tools, run them, feed
        the results back and stream the next completion, up to ``max_tool_turns``
        completions. Then distil what the user said into memories."""
        messages: list[dict[str, Any]] = list(request_messages(ctx.input))
        tools = [tool_module.DEFINITION] if self._memory is not None else []
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
                result, usage = await self._run_tool(ctx, call)
                for u in usage:
                    yield u
                yield ToolActivity(activity(call_id=call.id, name=call.name, result=result))
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        else:
            raise RunFailed(
                f"the model asked for tools in all {self._max_turns} model turns allowed "
                "(KODA_MAX_TOOL_TURNS) without giving a final answer"
            )
        if self._memory is not None:
            # The answer is complete: a memory that cannot be made is logged and
            # skipped, never a reason to fail (and re-run) the user's run.
            try:
                statements, usage = await self._distil(ctx)
            except HandlerError as exc:
                log.warning("memory not written run_id=%s: %s", ctx.run_id, str(exc)[:300])
                return
            for u in usage:
                yield u
            try:
                remembered = await self._memory.remember(ctx, statements)
            except HandlerError as exc:  # the embedder failed; a database error propagates
                log.warning("memory not written run_id=%s: %s", ctx.run_id, str(exc)[:300])
                return
            for u in remembered:
                yield u

    async def _run_tool(self, ctx: RunContext, call: ToolCall) -> tuple[str, list[Usage]]:
        if call.name == tool_module.NAME and self._memory is not None:
            return await self._memory.search_tool(ctx, call.arguments)
        return f"error: there is no tool named {call.name!r}", []

    async def _complete(
        self,
        ctx: RunContext,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]],
        assembler: ToolCallAssembler,
    ) -> AsyncIterator[str | Usage]:
        body: dict[str, Any] = {
            "model": self._model,
            "messages": messages,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if tools:
            body["tools"] = tools
        streamed = 0
        reported = False
        try:
            async with self._client.stream("POST", "/v1/chat/completions", json=body) as resp:
                if resp.status_code != 200:
                    detail = (await resp.aread())[:300].decode("utf-8", "replace")
                    raise HandlerError(f"model endpoint answered {resp.status_code}: {detail}")
                async for line in resp.aiter_lines():
                    if ctx.cancel.cancelled:
                        if streamed and not reported:
                            yield self._estimate(body, streamed)
                        return
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        return
                    for item in parse_event(data, self._model, assembler):
                        if isinstance(item, Usage):
                            reported = True
                        else:
                            streamed += 1
                        yield item
                cut = "the stream ended before [DONE]"
        except httpx.HTTPError as exc:
            cut = f"model endpoint failed: {type(exc).__name__}: {exc}"
        if streamed and not reported:
            yield self._estimate(body, streamed)
        raise HandlerError(cut)

    def _estimate(self, body: dict[str, Any], streamed: int) -> Usage:
        chars = sum(len(str(m.get("content") or "")) for m in body["messages"])
        return Usage(self._model, (chars + 3) // 4, streamed, estimated=True)

    async def _distil(self, ctx: RunContext) -> tuple[list[str], list[Usage]]:
        """One model call: the statements worth remembering from the user's messages."""
        said = [m["content"] for m in request_messages(ctx.input) if m["role"] == "user"]
        if not any(s.strip() for s in said):
            return [], []
        body = {
            "model": self._model,
            "messages": [
                {"role": "system", "content": DISTIL_PROMPT},
                {"role": "user", "content": "\n\n".join(said)},
            ],
            "response_format": {"type": "json_object"},
        }
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
        usage = [
            Usage(
                str(obj.get("model") or self._model),
                int(usage_obj.get("prompt_tokens", 0)),
                int(usage_obj.get("completion_tokens", 0)),
            )
        ]
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
        return [str(s) for s in statements if isinstance(s, str) and s.strip()], usage

    async def aclose(self) -> None:
        await self._client.aclose()


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
        out.append(
            Usage(
                str(obj.get("model") or default_model),
                int(usage.get("prompt_tokens", 0)),
                int(usage.get("completion_tokens", 0)),
            )
        )
    return out
