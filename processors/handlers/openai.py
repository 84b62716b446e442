"""Stream from any OpenAI-compatible ``/v1/chat/completions`` endpoint.

Input: ``{"text": "..."}`` or ``{"messages": [{"role": ..., "content": ...}, ...]}``.
Usage comes from the final chunk (``stream_options.include_usage``). A stream cut
before it (a broken connection, a stream ending without ``[DONE]``) is still billed:
the handler yields an estimated usage record (completion tokens = content pieces
streamed, prompt tokens ~ 4 characters each) and then fails the attempt.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx

from koda.errors import ConfigError, HandlerError
from koda.lifecycle.handler import RunContext, Usage

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


class OpenAIHandler:
    name = "openai"

    @property
    def model(self) -> str:
        return self._model

    def __init__(self, *, base_url: str, api_key: str | None, model: str) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ConfigError(f"KODA_OPENAI_BASE_URL={base_url!r} must be an http(s) URL")
        self._model = model
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(
            base_url=base_url.rstrip("/"),
            headers=headers,
            timeout=httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S),
        )

    async def stream(self, ctx: RunContext) -> AsyncIterator[str | Usage]:
        body = {
            "model": self._model,
            "messages": request_messages(ctx.input),
            "stream": True,
            "stream_options": {"include_usage": True},
        }
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
                    for item in parse_event(data, self._model):
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
        chars = sum(len(m["content"]) for m in body["messages"])
        return Usage(self._model, (chars + 3) // 4, streamed, estimated=True)

    async def aclose(self) -> None:
        await self._client.aclose()


def parse_event(data: str, default_model: str) -> list[str | Usage]:
    """Turn one ``data:`` payload into chunk texts and usage records."""
    try:
        obj = json.loads(data)
    except json.JSONDecodeError as exc:
        raise HandlerError(f"model endpoint sent invalid JSON: {exc}") from exc
    out: list[str | Usage] = []
    for choice in obj.get("choices") or []:
        content = (choice.get("delta") or {}).get("content")
        if content:
            out.append(content)
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
