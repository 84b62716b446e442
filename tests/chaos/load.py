"""The traffic of a chaos run: users submitting through the gateway, SSE viewers, poison.

* Each user submits its runs one after another (the next POST only after the previous
  one was answered 202), so a user's submission order is well defined. A POST that
  fails (gateway killed, Postgres down: 503) is retried with the same
  ``Idempotency-Key`` until it is answered, so a retry never makes a second run.
* A viewer follows one run over SSE as a browser does: on a cut stream or a failed
  connection it reconnects with ``Last-Event-ID``; it keeps every event with an id,
  in arrival order, across connections.
* A few runs are **cancelled** by their user a moment after the 202 (while the faults
  go on), and a few are followed by a **second message in the same session**, sent
  while the first is likely streaming: the gateway merges it into that run (the answer
  starts over on both messages) or, when the run is not running any more (or not yet),
  makes it a run of its own. Either answer is recorded and checked.
* A few runs carry a first-person statement, which the demo handler stores as a
  memory of the user before the run's `done`: runs retried after a fault write it
  again, and it must be there exactly once.
* A few users have a daily budget of one or two runs' cost (the demo model is priced at
  $1 a completion token): once it is spent their next runs are refused 402.
* Poison comes in two forms: runs whose handler always fails (they must end
  ``failed`` with one dead letter each) and records written straight to the runs
  topic by an outside producer (garbage bytes, an unknown schema version, a null
  key), each of which must end up as a dead letter and nothing else.
* The users share a few HTTP clients, :data:`USERS_PER_CLIENT` each. One client for
  a thousand users and their viewers starved the harness itself: when the gateway
  slowed, requests queued in httpcore's pool, which assigns them by scanning every
  connection for every queued request, and the one event loop spent its time there
  (py-spy: ``AsyncConnectionPool._assign_requests_to_connections``), so the fault
  probes timed out against a gateway that answered in 41 ms. :class:`LoopLag` puts
  the loop's own lateness in the table, so a harness that starves says so.
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

USERS_PER_CLIENT = 20
CONNECTIONS_PER_CLIENT = 16


def client_count(users: int) -> int:
    return max(1, -(-users // USERS_PER_CLIENT))


def load_client(url: str) -> httpx.AsyncClient:
    """One shard's client: a small pool, so that queueing in it stays cheap."""
    limits = httpx.Limits(
        max_connections=CONNECTIONS_PER_CLIENT, max_keepalive_connections=CONNECTIONS_PER_CLIENT
    )
    return httpx.AsyncClient(base_url=url, limits=limits, timeout=httpx.Timeout(30.0, read=20.0))


@dataclass
class LoopLag:
    """How late the harness's event loop wakes from a short sleep: a loop busy with its
    own work makes probes time out and faults overrun, which is the harness failing,
    not koda."""

    every_s: float = 0.5
    longest_s: float = 0.0
    late: int = 0  # wake-ups more than a second late

    async def watch(self, log: Any) -> None:
        while True:
            began = time.monotonic()
            await asyncio.sleep(self.every_s)
            lag = time.monotonic() - began - self.every_s
            self.longest_s = max(self.longest_s, lag)
            if lag > 1.0:
                self.late += 1
                if self.late <= 10 or self.late % 100 == 0:
                    log(f"  harness event loop woke {lag:.1f}s late ({self.late} so far)")


@dataclass
class PlannedRun:
    """One run a user will submit, and what it must end as."""

    user: str
    index: int
    key: str
    input: dict[str, Any]
    poison: bool = False
    watch: bool = False
    session_id: str = ""
    cancel_after_s: float | None = None  # the user cancels it this long after the 202
    follow_up: bool = False  # a second message into the previous run's session
    followed: bool = False  # the user's next run is a follow-up of this one
    memory: str | None = None  # the statement the run's handler must remember once
    run_id: str | None = None
    accepted_at: float | None = None
    attempts: int = 0  # POSTs it took
    refused: str | None = None
    merged: bool = False  # a follow-up the gateway merged into the previous run
    over_budget_at: float | None = None  # refused 402 budget_exceeded at this time
    cancel: CancelAnswer | None = None


@dataclass
class CancelAnswer:
    """What the user's cancel got: sent at ``at``, answered ``code`` with ``status``."""

    at: float
    code: int | None = None
    status: str | None = None
    answered_at: float | None = None
    problem: str | None = None

    @property
    def took(self) -> bool:
        """The run was cancelled at once (pending) or the cancel was recorded (running)."""
        return self.code == 202 or (self.code == 200 and self.status == "cancelled")


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
    cancel_fraction: float = 0.0,
    merge_fraction: float = 0.0,
    memory_fraction: float = 0.0,
) -> dict[str, list[PlannedRun]]:
    """Runs per user: durations uniform in [min_s, max_s] seconds, a few flaky and poison,
    a few cancelled, a few followed by a second message (``merge_fraction``; the
    follow-up is planned as the user's next run)."""
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
        text = f"chaos {user} #{len(plan[user])} {rng.random():.9f}"
        key = f"chaos-{nonce}-{i}"
        remembers = not poison and rng.random() < memory_fraction
        if remembers:
            # A first-person statement: the demo handler stores it as the user's memory.
            text = f"I keep note {key}. {text}"
        inp = {"text": text, "demo": demo}
        prev = plan[user][-1] if plan[user] else None
        follow_up = prev is not None and prev.followed and not poison
        run = PlannedRun(
            user,
            len(plan[user]),
            key,
            inp,
            poison=poison,
            watch=rng.random() < watch_fraction,
            session_id=prev.session_id if follow_up and prev is not None else f"s-{key}",
            follow_up=follow_up,
            memory=f"I keep note {key}." if remembers else None,
        )
        if not poison and not follow_up:
            if rng.random() < cancel_fraction:
                run.cancel_after_s = rng.uniform(0.0, min(2.0, max_s))
            elif rng.random() < merge_fraction:
                # The longest duration, so it likely still streams when the follow-up comes.
                run.followed = True
                demo["delay_ms"] = max(1, int(max_s * 1000 / tokens))
        plan[user].append(run)
    return plan


async def submit(client: httpx.AsyncClient, run: PlannedRun, deadline: float) -> None:
    """POST until answered 202 (retrying failures with the same key) or ``deadline``."""
    headers = {"Authorization": f"Bearer dev:{run.user}", "Idempotency-Key": run.key}
    body = {"session_id": run.session_id, "input": run.input}
    last = ""
    while time.monotonic() < deadline:
        run.attempts += 1
        try:
            resp = await client.post("/v1/runs", json=body, headers=headers)
        except httpx.HTTPError as exc:
            last = f"{type(exc).__name__}: {exc}"
            await asyncio.sleep(0.5)
            continue
        if resp.status_code == 202:
            answer = resp.json()
            run.run_id = answer["run_id"]
            run.merged = bool(answer.get("merged"))
            run.accepted_at = time.time()
            return
        last = f"HTTP {resp.status_code}: {resp.text[:200]}"
        if resp.status_code == 402:
            run.over_budget_at = time.time()
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
    window_s: float,
    deadline: float,
    on_accepted: Any,
) -> None:
    """Submit ``runs`` in order at random moments of the next ``window_s`` seconds (a
    Poisson process given its count: sorted uniform times, so every user is done by
    the window's end instead of a few stragglers' exponential gaps stretching it); a
    follow-up goes once the run before it has started, a cancel after its delay."""
    start = time.monotonic()
    times = sorted(rng.uniform(0, window_s) for _ in runs)
    for i, run in enumerate(runs):
        if not run.follow_up or i == 0:
            await asyncio.sleep(max(0.0, start + times[i] - time.monotonic()))
        await submit(client, run, deadline)
        if run.run_id is not None and not run.merged:
            on_accepted(run)
        if run.run_id is not None and run.cancel_after_s is not None:
            await asyncio.sleep(run.cancel_after_s)
            run.cancel = await cancel(client, run, deadline)
        nxt = runs[i + 1] if i + 1 < len(runs) else None
        if nxt is not None and nxt.follow_up and run.run_id is not None:
            await until_streaming(client, run, deadline)
            await asyncio.sleep(rng.uniform(0.0, 0.3))


async def until_streaming(client: httpx.AsyncClient, run: PlannedRun, deadline: float) -> None:
    """Wait (up to 10 s) until ``run`` is running or streaming, as a user who types the
    next message while the answer streams; a run that ended (or a failed probe) does
    not hold the user up any longer."""
    headers = {"Authorization": f"Bearer dev:{run.user}"}
    until = min(deadline, time.monotonic() + 10.0)
    while time.monotonic() < until:
        try:
            resp = await client.get(f"/v1/runs/{run.run_id}", headers=headers)
        except httpx.HTTPError:
            return
        if resp.status_code != 200 or resp.json().get("status") != "pending":
            return
        await asyncio.sleep(0.1)


async def cancel(client: httpx.AsyncClient, run: PlannedRun, deadline: float) -> CancelAnswer:
    """POST the run's cancel until answered 200/202 (a retry of a cancel is harmless)."""
    answer = CancelAnswer(at=time.time())
    headers = {"Authorization": f"Bearer dev:{run.user}"}
    while time.monotonic() < deadline:
        try:
            resp = await client.post(
                f"/v1/runs/{run.run_id}/cancel", json={"reason": "chaos"}, headers=headers
            )
        except httpx.HTTPError as exc:
            answer.problem = f"{type(exc).__name__}: {exc}"
            await asyncio.sleep(0.5)
            continue
        if resp.status_code in (200, 202):
            answer.code, answer.status = resp.status_code, resp.json().get("status")
            answer.answered_at = time.time()
            answer.problem = None
            return answer
        answer.problem = f"HTTP {resp.status_code}: {resp.text[:200]}"
        if resp.status_code >= 500 or resp.status_code == 429:
            await asyncio.sleep(0.5)
            continue
        return answer
    answer.problem = answer.problem or "deadline"
    return answer


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
