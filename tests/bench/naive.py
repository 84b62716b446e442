"""The obvious implementation: one Faust agent, one Postgres transaction per chunk
and per transition, records handled one after the other.

Same rows and records as koda's demo run (see tests/bench/rivals.py); Faust acks
each event after the agent body returns, so offsets follow the work.

    python -m tests.bench.naive --bootstrap H:P --dsn URL --schema S \\
        --runs-topic T --chunks-topic T --events-topic T --group G --worker W
"""

from __future__ import annotations

import json
import tempfile
from typing import Any

import faust

from tests.bench.ceiling import cli
from tests.bench.rivals import (
    CLAIM,
    DONE,
    INSERT_ONE,
    MODEL,
    STREAMING,
    USAGE,
    aconnect,
    chunk_record,
    event_record,
    tokens_for,
)


def main() -> None:
    args = cli()
    datadir = tempfile.mkdtemp(prefix="naive-faust-")
    app = faust.App(
        args.group,
        broker=f"kafka://{args.bootstrap}",
        key_serializer="raw",
        value_serializer="raw",
        topic_allow_declare=False,
        topic_disable_leader=True,
        web_enabled=False,
        datadir=datadir,
        consumer_auto_offset_reset="earliest",
        producer_acks=-1,
    )
    source = app.topic(args.runs_topic, key_type=bytes, value_type=bytes)
    chunks = app.topic(args.chunks_topic, key_type=bytes, value_type=bytes)
    events = app.topic(args.events_topic, key_type=bytes, value_type=bytes)
    state: dict[str, Any] = {}

    async def send(out: tuple[str, bytes, bytes], partition: int) -> Any:
        topic = chunks if out[0] == "chunk" else events
        return await topic.send(key=out[1], value=out[2], partition=partition)

    @app.agent(source)
    async def runs(stream: Any) -> None:
        async for event in stream.events():
            if "conn" not in state:
                state["conn"] = await aconnect(args.dsn, args.schema)
            conn = state["conn"]
            run_id = json.loads(event.value)["run_id"]
            part = event.message.partition
            futures = []
            async with conn.transaction():
                row = await (await conn.execute(CLAIM, (args.worker, part, run_id))).fetchone()
            if row is None:
                continue
            attempt, inp, _user = row
            futures.append(
                await send(event_record(run_id, "transition", to="running", attempt=attempt), part)
            )
            toks = tokens_for(inp)
            for seq, tok in enumerate(toks):
                if seq == 0:
                    async with conn.transaction():
                        await conn.execute(STREAMING, (run_id,))
                async with conn.transaction():
                    await conn.execute(INSERT_ONE, (run_id, seq, "chunk", tok, attempt))
                futures.append(await send(chunk_record(run_id, seq, "chunk", tok, attempt), part))
            done = json.dumps({"status": "done"})
            n = len(toks)
            async with conn.transaction():
                await conn.execute(INSERT_ONE, (run_id, n, "done", done, attempt))
            futures.append(await send(chunk_record(run_id, n, "done", done, attempt), part))
            async with conn.transaction():
                await conn.execute(USAGE, (run_id, MODEL, 2, n))
            async with conn.transaction():
                await conn.execute(DONE, (run_id,))
            futures.append(await send(event_record(run_id, "transition", to="done"), part))
            futures.append(
                await send(
                    event_record(run_id, "usage", call_index=0, model=MODEL, completion_tokens=n),
                    part,
                )
            )
            for fut in futures:
                await fut

    worker = faust.Worker(
        app, loglevel="WARNING", quiet=True, redirect_stdouts=False, override_logging=False
    )
    print("naive ready", flush=True)
    try:
        worker.execute_from_commandline()
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise


if __name__ == "__main__":
    main()
