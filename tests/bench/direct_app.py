"""W4's rival: the assistant endpoint a developer would write without koda.

A FastAPI app whose ``POST /v1/chat`` (``{"text": ...}``) calls the model endpoint
with httpx, as koda's openai handler does (the same request body, the same line
parsing), and streams each token to the client as a Server-Sent Event the moment it
arrives. No Kafka, no Postgres, no queue: nothing survives a crash and nothing can
be resumed, which is what koda adds. The frames:

    event: started    data: {"queue_s": ...}   request received -> model call started
    event: chunk      data: {"content": "..."}  one per token
    event: done       data: {}                  (``error`` with a message on failure)

The httpx client's pool holds up to 1,000 connections (what the ``openai`` SDK's
client allows); the app runs in uvicorn with its defaults, as the gateway does.

    python -m tests.bench.direct_app --port 8282 --model-url http://127.0.0.1:8181
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

MODEL = "w4-model"
MAX_CONNECTIONS = 1000


def frame(kind: str, data: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def create_app(model_url: str) -> FastAPI:
    """The app, calling the model at ``model_url`` (``/v1/chat/completions`` below it)."""
    clients: dict[str, httpx.AsyncClient] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        clients["model"] = httpx.AsyncClient(
            base_url=model_url.rstrip("/"),
            timeout=httpx.Timeout(60.0, connect=10.0),
            limits=httpx.Limits(max_connections=MAX_CONNECTIONS, max_keepalive_connections=100),
        )
        yield
        await clients["model"].aclose()

    app = FastAPI(lifespan=lifespan)

    @app.post("/v1/chat")
    async def chat(request: Request) -> StreamingResponse:
        received = time.time()
        text = str((await request.json())["text"])

        async def events() -> AsyncIterator[bytes]:
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": text}],
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            started = time.time()
            yield frame("started", {"queue_s": started - received})
            try:
                async with clients["model"].stream(
                    "POST", "/v1/chat/completions", json=body
                ) as resp:
                    if resp.status_code != 200:
                        yield frame("error", {"message": f"model answered {resp.status_code}"})
                        return
                    async for line in resp.aiter_lines():
                        if not line.startswith("data:"):
                            continue
                        data = line[5:].strip()
                        if data == "[DONE]":
                            break
                        for choice in json.loads(data).get("choices") or []:
                            content = (choice.get("delta") or {}).get("content")
                            if content:
                                yield frame("chunk", {"content": content})
            except httpx.HTTPError as exc:
                yield frame("error", {"message": f"{type(exc).__name__}: {exc}"})
                return
            yield frame("done", {})

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--model-url", required=True)
    args = ap.parse_args()
    uvicorn.run(
        create_app(args.model_url),
        host=args.host,
        port=args.port,
        log_level="warning",
        access_log=False,
        server_header=False,
        backlog=4096,
    )


if __name__ == "__main__":
    main()
