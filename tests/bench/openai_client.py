"""The openai handler's client: the official ``openai`` SDK versus koda's httpx parser.

A local server streams chat-completion chunks (``--chunks`` per completion, each a
few characters as a model sends them); both clients consume the same streams and the
script prints CPU time per chunk and chunks/s, median of ``--repeat`` runs. It needs
the SDK installed (``pip install -c constraints.txt .[bench]``).

    python -m tests.bench.openai_client --chunks 5000 --repeat 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from koda_runtime.lifecycle.handler import RunContext
from koda_runtime.processors.handlers.openai import OpenAIHandler
from tests.bench.common import Table

CHUNKS = 5000


class Stream(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    body = b""

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Content-Length", str(len(Stream.body)))
        self.end_headers()
        self.wfile.write(Stream.body)

    def log_message(self, *args: object) -> None:
        return


def build_body(chunks: int) -> bytes:
    out = []
    for i in range(chunks):
        event = {
            "id": "chatcmpl-1",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "m",
            "choices": [{"index": 0, "delta": {"content": f"tok{i % 10} "}, "finish_reason": None}],
        }
        out.append(f"data: {json.dumps(event)}\n\n")
    usage = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [],
        "usage": {"prompt_tokens": 1, "completion_tokens": chunks, "total_tokens": chunks + 1},
    }
    out.append(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n")
    return "".join(out).encode()


async def with_httpx(url: str) -> tuple[int, float]:
    handler = OpenAIHandler(base_url=url, api_key="k", model="m")
    t0 = time.process_time()
    n = 0
    async for item in handler.stream(RunContext("r", "u", {"text": "x"}, 1)):
        n += isinstance(item, str)
    took = time.process_time() - t0
    await handler.aclose()
    return n, took


async def with_sdk(url: str) -> tuple[int, float]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url + "/v1", api_key="k")
    t0 = time.process_time()
    n = 0
    stream = await client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "x"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    async for event in stream:
        for choice in event.choices:
            if choice.delta.content:
                n += 1
    took = time.process_time() - t0
    await client.close()
    return n, took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--chunks", type=int, default=CHUNKS)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    Stream.body = build_body(args.chunks)
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Stream)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    table = Table(
        f"streamed completion of {args.chunks} chunks, median of {args.repeat}",
        ["client", "CPU us/chunk", "chunks/s of one core"],
    )
    for name, fn in (("httpx (koda's parser)", with_httpx), ("openai SDK", with_sdk)):
        took = []
        for _ in range(args.repeat):
            n, cpu = asyncio.run(fn(url))
            assert n == args.chunks, (name, n)
            took.append(cpu)
        per = statistics.median(took) / args.chunks
        table.add(name, f"{per * 1e6:.1f}", f"{1 / per:,.0f}")
    httpd.shutdown()
    print(table.render())


if __name__ == "__main__":
    main()
