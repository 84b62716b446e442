"""A model with a real model's timing, behind the OpenAI streaming chat-completions
wire format: W4's stand-in for the model endpoint (tests/bench/w4_assistant.py).

``POST /v1/chat/completions`` with ``"stream": true`` answers with Server-Sent Events
as the OpenAI API does: one ``data: {...chat.completion.chunk...}`` per token, a final
chunk with ``usage`` when ``stream_options.include_usage`` is set (the openai handler,
processors/handlers/openai.py, always sets it), then ``data: [DONE]``. The timing of
each answer comes from its :class:`Plan`: the first token after 300-800 ms, then 30-60
tokens/s, 200-800 tokens, drawn from a random generator seeded with the server's seed
and the prompt's plan key, so the load generator can compute the same plan for the
same prompt (the model's own time to first token, which W4 subtracts from the time to
first chunk).

Every token's text starts with the wall clock at the moment the server writes it
(``1733331234.123456 word ``): a viewer that stamps its receipt on the same clock
measures the yield -> viewer latency of whatever lies between.

``GET /stats`` answers the streams open now, the most open at once and the tokens
written since the last ``GET /stats?reset=1``, and how late the server wrote its
tokens against their plan (when it is late, its CPU is the limit, not the system
measured). The server runs in a process of its own so that its CPU is apart:

    python -m tests.bench.model_timing --port 8181 --seed 1
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import random
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

WORDS = (
    "the answer depends on what you measure and how long you wait for each token "
    "to reach the reader while the model keeps writing its reply one piece at a time"
).split()
# A prompt's plan key: ``plan=<key>`` anywhere in it, else the whole prompt. Two prompts
# with the same key get the same answer timing (W4 offers koda and the direct rival the
# same arrivals; koda's prompts differ in a nonce, its idempotency keys must not clash).
_PLAN_KEY = re.compile(r"plan=(\S+)")
# A prompt with this marker is a warm-up: one token, at once.
WARM = "w4-warm"


@dataclass(frozen=True)
class Shape:
    """The ranges a plan is drawn from (uniformly): seconds, tokens/s, tokens."""

    ttft_s: tuple[float, float] = (0.3, 0.8)
    tokens_per_s: tuple[float, float] = (30.0, 60.0)
    tokens: tuple[int, int] = (200, 800)


@dataclass(frozen=True)
class Plan:
    """One answer's timing: the first token ``ttft_s`` after the request, the others
    ``1 / tokens_per_s`` apart, ``tokens`` in all."""

    ttft_s: float
    tokens_per_s: float
    tokens: int

    def offset(self, k: int) -> float:
        """When token ``k`` (from 0) is due, seconds after the request."""
        return self.ttft_s + k / self.tokens_per_s

    @property
    def duration_s(self) -> float:
        return self.offset(self.tokens - 1) if self.tokens else 0.0


def plan_key(prompt: str) -> str:
    m = _PLAN_KEY.search(prompt)
    return m.group(1) if m else prompt


def plan_for(prompt: str, seed: int, shape: Shape = Shape()) -> Plan:
    """The timing of the answer to ``prompt`` on a server seeded with ``seed``."""
    if WARM in prompt:
        return Plan(0.0, 1000.0, 1)
    digest = hashlib.sha256(f"{seed}:{plan_key(prompt)}".encode()).digest()
    rng = random.Random(digest)  # noqa: S311 - a benchmark's timing, not a secret
    return Plan(
        ttft_s=rng.uniform(*shape.ttft_s),
        tokens_per_s=rng.uniform(*shape.tokens_per_s),
        tokens=rng.randint(*shape.tokens),
    )


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


@dataclass
class Lateness:
    """How late tokens were written against their plan."""

    tokens: int = 0
    late_10ms: int = 0  # written over 10 ms after they were due
    worst_s: float = 0.0

    def add(self, late_s: float) -> None:
        self.tokens += 1
        self.late_10ms += late_s > 0.010
        self.worst_s = max(self.worst_s, late_s)


async def completion(
    plan: Plan,
    model: str,
    *,
    prompt_tokens: int,
    include_usage: bool,
    now: Callable[[], float] = time.monotonic,
    wall: Callable[[], float] = time.time,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    lateness: Lateness | None = None,
) -> AsyncIterator[bytes]:
    """The SSE bytes of one streamed answer, each yielded when ``plan`` says it is due
    (``now`` is the clock the plan runs on, ``wall`` the clock of the token stamps)."""
    t0 = now()
    rng = random.Random(plan.tokens)  # noqa: S311 - the words only
    head = {"id": "chatcmpl-w4", "object": "chat.completion.chunk", "created": int(wall())}
    for k in range(plan.tokens):
        due = t0 + plan.offset(k)
        wait = due - now()
        if wait > 0:
            await sleep(wait)
        if lateness is not None:
            lateness.add(max(0.0, now() - due))
        word = WORDS[rng.randrange(len(WORDS))]
        delta = {"content": f"{wall():.6f} {word} "}
        if k == 0:
            delta["role"] = "assistant"
        choice = {"index": 0, "delta": delta, "finish_reason": None}
        yield _sse({**head, "model": model, "choices": [choice]})
    done = {"index": 0, "delta": {}, "finish_reason": "stop"}
    yield _sse({**head, "model": model, "choices": [done]})
    if include_usage:
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": plan.tokens,
            "total_tokens": prompt_tokens + plan.tokens,
        }
        yield _sse({**head, "model": model, "choices": [], "usage": usage})
    yield b"data: [DONE]\n\n"


@dataclass
class Server:
    """The aiohttp app's state: the seed, the shape and the counters of ``/stats``."""

    seed: int
    shape: Shape = field(default_factory=Shape)
    open: int = 0
    most_open: int = 0
    lateness: Lateness = field(default_factory=Lateness)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        messages = body.get("messages") or []
        said = [str(m.get("content") or "") for m in messages if m.get("role") == "user"]
        if not body.get("stream") or not said:
            return web.json_response(
                {"error": {"message": "this model only streams answers to a user message"}},
                status=400,
            )
        prompt = said[-1]
        plan = plan_for(prompt, self.seed, self.shape)
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        self.open += 1
        self.most_open = max(self.most_open, self.open)
        try:
            async for data in completion(
                plan,
                str(body.get("model") or "w4-model"),
                prompt_tokens=max(1, len(prompt) // 4),
                include_usage=include_usage,
                lateness=self.lateness,
            ):
                await resp.write(data)
            await resp.write_eof()
        except ConnectionResetError:
            pass  # the client went away (a cancelled run, a closed stream): nothing to finish
        finally:
            self.open -= 1
        return resp

    async def stats(self, request: web.Request) -> web.Response:
        out = {
            "open": self.open,
            "most_open": self.most_open,
            "tokens": self.lateness.tokens,
            "late_10ms": self.lateness.late_10ms,
            "worst_late_ms": self.lateness.worst_s * 1000,
        }
        if request.query.get("reset"):
            self.most_open = self.open
            self.lateness = Lateness()
        return web.json_response(out)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/stats", self.stats)
        return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    try:
        import uvloop

        loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    except ImportError:  # the standard loop serves too, at more CPU per token
        loop = asyncio.new_event_loop()
    web.run_app(
        Server(args.seed).app(),
        host=args.host,
        port=args.port,
        access_log=None,
        print=None,
        backlog=4096,
        shutdown_timeout=1.0,
        loop=loop,
    )


if __name__ == "__main__":
    main()
