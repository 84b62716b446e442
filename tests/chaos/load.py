"""The traffic of a chaos run: users submitting through the gateway, SSE viewers, poison.

* Each user submits its runs one after another (the next POST only after the previous
  one was answered 202), so a user's submission order is well defined. A POST that
  fails (gateway killed, Postgres down: 503) is retried with the same
  ``Idempotency-Key`` until it is answered, so a retry never makes a second run.
* A viewer follows one run over SSE as a browser does: on a cut stream or a failed
  connection it reconnects with ``Last-Event-ID``; it keeps every event with an id,
  in arrival order, across connections.
* Poison comes in two forms: runs whose handler always fails (they must end
  ``failed`` with one dead letter each) and records written straight to the runs
  topic by an outside producer (garbage bytes, an unknown schema version, a null
  key), each of which must end up as a dead letter and nothing else.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from random import Random
from typing import Any

import httpx
from confluent_kafka import Producer

from koda_runtime.gateway.eventstream import TERMINAL_KINDS, EventParser
from koda_runtime.kafka import producer_config
from koda_runtime.settings import Settings
from koda_runtime.topics.catalogue import RUNS


@dataclass
class PlannedRun:
    """One run a user will submit, and what it must end as."""

    user: str
    index: int
    key: str
    input: dict[str, Any]
    poison: bool = False
    watch: bool = False
    run_id: str | None = None
    accepted_at: float | None = None
    attempts: int = 0  # POSTs it took
    refused: str | None = None


@dataclass
class Viewer:
    """What one SSE follower of a run received."""

    run_id: str
    user: str
    events: list[tuple[int, str, dict[str, Any]]] = field(default_factory=list)
    connections: int = 0
    errors: int = 0
    finished: bool = False
    problem: str | None = None


def plan_runs(
    rng: Random,
    *,
    runs: int,
    users: int,
    min_s: float,
    max_s: float,
    poison_runs: int,
    flaky_fraction: float,
    watch_fraction: float,
) -> dict[str, list[PlannedRun]]:
    """Runs per user: durations uniform in [min_s, max_s] seconds, a few flaky and poison."""
    nonce = uuid.uuid4().hex[:8]
    names = [f"u{i:04d}-{nonce}" for i in range(users)]
    plan: dict[str, list[PlannedRun]] = {u: [] for u in names}
    poison_at = set(rng.sample(range(runs), min(poison_runs, runs)))
    for i in range(runs):
        user = names[i % users]
        duration = rng.uniform(min_s, max_s)
        tokens = rng.randint(2, 20)
        demo: dict[str, Any] = {
            "tokens": tokens,
            "delay_ms": max(1, int(duration * 1000 / tokens)),
        }
        poison = i in poison_at
        if poison:
            demo = {"tokens": 4, "delay_ms": 20, "fail_attempts": 99}
        elif rng.random() < flaky_fraction:
            demo["fail_attempts"] = 1
        inp = {"text": f"chaos {user} #{len(plan[user])} {rng.random():.9f}", "demo": demo}
        plan[user].append(
            PlannedRun(
                user,
                len(plan[user]),
                f"chaos-{nonce}-{i}",
                inp,
                poison=poison,
                watch=rng.random() < watch_fraction,
            )
        )
    return plan


async def submit(client: httpx.AsyncClient, run: PlannedRun, deadline: float) -> None:
    """POST until answered 202 (retrying failures with the same key) or ``deadline``."""
    headers = {"Authorization": f"Bearer dev:{run.user}", "Idempotency-Key": run.key}
    last = ""
    while time.monotonic() < deadline:
        run.attempts += 1
        try:
            resp = await client.post("/v1/runs", json={"input": run.input}, headers=headers)
        except httpx.HTTPError as exc:
            last = f"{type(exc).__name__}: {exc}"
            await asyncio.sleep(0.5)
            continue
        if resp.status_code == 202:
            run.run_id = resp.json()["run_id"]
            run.accepted_at = time.time()
            return
        last = f"HTTP {resp.status_code}: {resp.text[:200]}"
        if resp.status_code in (429, 503) or resp.status_code >= 500:
            wait = float(resp.headers.get("retry-after", "0.5") or 0.5)
            await asyncio.sleep(min(wait, 2.0))
            continue
        break  # a 4xx other than 429 is final
    run.refused = last or "deadline"


async def user_session(
    client: httpx.AsyncClient,
    runs: list[PlannedRun],
    rng: Random,
    gap_s: float,
    deadline: float,
    on_accepted: Any,
) -> None:
    """Submit ``runs`` in order, about ``gap_s`` seconds apart (exponential gaps)."""
    await asyncio.sleep(rng.uniform(0, gap_s))
    for run in runs:
        await submit(client, run, deadline)
        if run.run_id is not None:
            on_accepted(run)
        await asyncio.sleep(rng.expovariate(1.0 / gap_s) if gap_s > 0 else 0)


async def follow(client: httpx.AsyncClient, viewer: Viewer, deadline: float) -> None:
    """Follow ``viewer.run_id`` to its terminal event, reconnecting with Last-Event-ID."""
    headers = {"Authorization": f"Bearer dev:{viewer.user}"}
    last = -1
    while time.monotonic() < deadline:
        viewer.connections += 1
        hdrs = dict(headers)
        if last >= 0:
            hdrs["Last-Event-ID"] = str(last)
        try:
            async with client.stream(
                "GET", f"/v1/runs/{viewer.run_id}/events", headers=hdrs
            ) as resp:
                if resp.status_code == 204:
                    viewer.finished = True
                    return
                if resp.status_code != 200:
                    await resp.aread()
                    viewer.errors += 1
                    await asyncio.sleep(0.5)
                    continue
                parser = EventParser()
                async for chunk in resp.aiter_bytes():
                    for e in parser.feed(chunk):
                        if e.seq is None:
                            continue  # reconnect hints and id-less terminal frames
                        data = json.loads(e.data) if e.data else {}
                        viewer.events.append((e.seq, e.event, data))
                        last = max(last, e.seq)
                        if e.event in TERMINAL_KINDS:
                            viewer.finished = True
                            return
        except (httpx.HTTPError, json.JSONDecodeError):
            viewer.errors += 1
            await asyncio.sleep(0.5)
    viewer.problem = f"not finished by the deadline after {viewer.connections} connections"


@dataclass
class InjectedPoison:
    """One record written straight to the runs topic; where it landed."""

    kind: str
    partition: int | None = None
    offset: int | None = None


POISON_RECORDS: list[tuple[str, bytes | None, bytes, list[tuple[str, bytes]] | None]] = [
    ("undecodable", b"chaos-poison", b"\xff\xfe garbage \x00\x01", None),
    (
        "unknown_schema_version",
        b"chaos-poison",
        b'{"run_id": "x", "user_id": "chaos-poison", "session_id": "s"}',
        [("schema", b"run.requested/7")],
    ),
    ("null_key", None, b'{"run_id": "x", "user_id": "chaos-poison", "session_id": "s"}', None),
]


def inject_poison(settings: Settings) -> list[InjectedPoison]:
    """Write one record of each poison kind to the runs topic; wait for the broker."""
    producer = Producer(producer_config(settings, "chaos-poison") | {"log_level": 0})
    out: list[InjectedPoison] = []
    for kind, key, value, headers in POISON_RECORDS:
        item = InjectedPoison(kind)

        def delivered(err: Any, msg: Any, item: InjectedPoison = item) -> None:
            if err is None:
                item.partition, item.offset = msg.partition(), msg.offset()

        producer.produce(
            settings.names.topic(RUNS),
            key=key,
            value=value,
            headers=None if headers is None else list(headers),
            on_delivery=delivered,
        )
        out.append(item)
    producer.flush(60)
    return out
