"""The work of one run, done without koda, for the comparison pipelines.

Imports only the standard library and psycopg, so the Quix Streams rival can use
it from its own virtualenv (Quix Streams pins an older confluent-kafka than
koda). Every rival writes the rows koda writes for a demo run (claim, the chunks
with the ``streaming`` transition, then the terminal chunk, usage and ``done``)
and produces the records koda produces (a transition event, one record per
chunk, the ``done`` chunk, the ``done`` event and a usage event).

Two shapes:

* ``batched``: koda's batching (claim; chunks + ``streaming``; terminal chunk +
  usage + ``done``: three transactions per run), no fencing, no state machine.
* ``naive``: one transaction per chunk and per transition, the obvious code.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable
from typing import Any

WORDS = (
    "the quick brown fox jumps over lazy dogs while kafka keeps every partition in order "
    "and postgres remembers what was said"
).split()
SEQ_WIDTH = 10
MODEL = "demo-1"

Out = tuple[str, bytes, bytes]  # ("chunk" | "event", key, value)

CLAIM = (
    "UPDATE runs SET status = 'running', attempt = attempt + 1, worker_id = %s,"
    " partition = %s, started_at = COALESCE(started_at, now())"
    " WHERE id = %s AND status IN ('pending', 'running', 'streaming')"
    " RETURNING attempt, input, user_id"
)
STREAMING = (
    "UPDATE runs SET status = 'streaming', first_chunk_at = COALESCE(first_chunk_at, now())"
    " WHERE id = %s AND status IN ('running', 'streaming')"
)
INSERT_MANY = (
    "INSERT INTO messages (run_id, seq, kind, content, attempt)"
    " SELECT %s, s.seq, s.kind, s.content, s.attempt"
    " FROM unnest(%s::int[], %s::text[], %s::text[], %s::int[]) AS s(seq, kind, content, attempt)"
    " ON CONFLICT (run_id, seq) DO NOTHING"
)
INSERT_ONE = (
    "INSERT INTO messages (run_id, seq, kind, content, attempt) VALUES (%s, %s, %s, %s, %s)"
    " ON CONFLICT (run_id, seq) DO NOTHING"
)
USAGE = (
    "INSERT INTO usage (run_id, call_index, model, prompt_tokens, completion_tokens, cost_usd)"
    " VALUES (%s, 0, %s, %s, %s, 0) ON CONFLICT (run_id, call_index) DO NOTHING"
)
DONE = (
    "UPDATE runs SET status = 'done', finished_at = now(), error = NULL"
    " WHERE id = %s AND status IN ('running', 'streaming')"
)


def tokens_for(inp: dict[str, Any]) -> list[str]:
    """The demo model's tokens (same algorithm as processors/handlers/demo.py)."""
    demo = inp.get("demo")
    opts: dict[str, Any] = demo if isinstance(demo, dict) else {}
    n, size = int(opts.get("tokens", 12)), int(opts.get("token_bytes", 6))
    rng = random.Random(hashlib.sha256(str(inp.get("text", "")).encode()).digest())  # noqa: S311
    out = []
    for _ in range(n):
        word = WORDS[rng.randrange(len(WORDS))]
        out.append(
            (word + " ") if size <= len(word) + 1 else (word + " ") * (size // (len(word) + 1))
        )
    return out


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def chunk_record(run_id: str, seq: int, kind: str, content: str, attempt: int) -> Out:
    key = f"{run_id}:{seq:0{SEQ_WIDTH}d}".encode()
    return (
        "chunk",
        key,
        _dumps(
            {"run_id": run_id, "seq": seq, "kind": kind, "content": content, "attempt": attempt}
        ),
    )


def event_record(run_id: str, event: str, **fields: Any) -> Out:
    return ("event", run_id.encode(), _dumps({"run_id": run_id, "event": event, **fields}))


def connect(dsn: str, schema: str) -> Any:
    import psycopg

    conn = psycopg.connect(dsn, autocommit=False)
    conn.execute("SELECT set_config('search_path', %s, false)", (f'"{schema}"',))
    conn.commit()
    return conn


async def aconnect(dsn: str, schema: str) -> Any:
    import psycopg

    conn = await psycopg.AsyncConnection.connect(dsn, autocommit=False)
    await conn.execute("SELECT set_config('search_path', %s, false)", (f'"{schema}"',))
    await conn.commit()
    return conn


def run_batched(
    conn: Any, run_id: str, partition: int, worker: str, emit: Callable[[Out], None]
) -> None:
    """koda's three transactions per run; ``emit`` is called only after each commit."""
    with conn.transaction():
        row = conn.execute(CLAIM, (worker, partition, run_id)).fetchone()
    if row is None:
        return
    attempt, inp, user_id = row
    emit(event_record(run_id, "transition", to="running", attempt=attempt, worker_id=worker))
    toks = tokens_for(inp)
    n = len(toks)
    with conn.transaction():
        conn.execute(STREAMING, (run_id,))
        conn.execute(INSERT_MANY, (run_id, list(range(n)), ["chunk"] * n, toks, [attempt] * n))
    for seq, tok in enumerate(toks):
        emit(chunk_record(run_id, seq, "chunk", tok, attempt))
    done = json.dumps({"status": "done"})
    with conn.transaction():
        conn.execute(INSERT_ONE, (run_id, n, "done", done, attempt))
        conn.execute(USAGE, (run_id, MODEL, len(str(inp.get("text", "")).split()), n))
        conn.execute(DONE, (run_id,))
    emit(chunk_record(run_id, n, "done", done, attempt))
    emit(event_record(run_id, "transition", to="done", attempt=attempt))
    emit(event_record(run_id, "usage", call_index=0, model=MODEL, completion_tokens=n))


async def arun_batched(
    conn: Any, run_id: str, partition: int, worker: str, emit: Callable[[Out], None]
) -> None:
    """:func:`run_batched` on an async connection."""
    async with conn.transaction():
        row = await (await conn.execute(CLAIM, (worker, partition, run_id))).fetchone()
    if row is None:
        return
    attempt, inp, user_id = row
    emit(event_record(run_id, "transition", to="running", attempt=attempt, worker_id=worker))
    toks = tokens_for(inp)
    n = len(toks)
    async with conn.transaction():
        await conn.execute(STREAMING, (run_id,))
        await conn.execute(
            INSERT_MANY, (run_id, list(range(n)), ["chunk"] * n, toks, [attempt] * n)
        )
    for seq, tok in enumerate(toks):
        emit(chunk_record(run_id, seq, "chunk", tok, attempt))
    done = json.dumps({"status": "done"})
    async with conn.transaction():
        await conn.execute(INSERT_ONE, (run_id, n, "done", done, attempt))
        await conn.execute(USAGE, (run_id, MODEL, len(str(inp.get("text", "")).split()), n))
        await conn.execute(DONE, (run_id,))
    emit(chunk_record(run_id, n, "done", done, attempt))
    emit(event_record(run_id, "transition", to="done", attempt=attempt))
    emit(event_record(run_id, "usage", call_index=0, model=MODEL, completion_tokens=n))
