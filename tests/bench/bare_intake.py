"""The floor for W3: a bare ASGI app whose ``POST /v1/runs`` only produces to Kafka.

No FastAPI, no validation, no Postgres: read the body, produce ``run.requested``
keyed by the bearer's user with koda's producer configuration, wait for the
broker's acknowledgement (as the gateway does), answer 202. Served by uvicorn
with the gateway's server settings.

    python -m tests.bench.bare_intake     # reads APP_ENV, KODA_* like the gateway
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import uvicorn
from confluent_kafka import Producer

from koda_runtime.kafka import producer_config
from koda_runtime.lifecycle.ids import uuid7
from koda_runtime.settings import Settings
from koda_runtime.topics.catalogue import RUNS
from koda_runtime.topics.records.codec import RUN_REQUESTED, RunRequested, headers_for


def build(settings: Settings) -> Any:
    topic = settings.names.topic(RUNS)
    producer = Producer(producer_config(settings, "bare"))
    headers = headers_for(RUN_REQUESTED)
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            producer.poll(0.1)

    threading.Thread(target=poll, daemon=True).start()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    stop.set()
                    producer.flush(5)
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        if scope["path"] != "/v1/runs" or scope["method"] != "POST":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})
            return
        auth = dict(scope["headers"]).get(b"authorization", b"")
        user = auth.rpartition(b":")[2].decode() or "anonymous"
        json.loads(body)
        run_id = uuid7()
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        def settle(err: Any) -> None:
            if done.done():
                return
            if err:
                done.set_exception(RuntimeError(str(err)))
            else:
                done.set_result(None)

        def delivered(err: Any, _msg: Any) -> None:
            loop.call_soon_threadsafe(settle, err)

        producer.produce(
            topic,
            key=user.encode(),
            value=RunRequested(run_id, user, f"s-{user}", "").encode(),
            headers=list(headers),
            on_delivery=delivered,
        )
        await done
        out = json.dumps({"run_id": run_id, "status": "pending"}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 202,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": out})

    return app


def main() -> None:
    settings = Settings.from_env()
    uvicorn.run(
        build(settings),
        host=settings.gateway_host,
        port=settings.gateway_port,
        lifespan="on",
        log_config=None,
        access_log=False,
        server_header=False,
    )


if __name__ == "__main__":
    main()
