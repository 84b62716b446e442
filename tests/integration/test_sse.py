"""GET /v1/runs/{id}/events against a real gateway process, worker, Kafka and Postgres.

One namespace, gateway and worker serve the whole module (runs are independent);
the keep-alive interval is short so idle catch-ups happen during the tests too.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import psutil
import pytest
from confluent_kafka import Producer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import text
from typer.testing import CliRunner

from koda_runtime import metrics
from koda_runtime.cli.runs import runs_app
from koda_runtime.gateway.app import create_app
from koda_runtime.gateway.eventstream import TERMINAL_KINDS, Event, EventParser
from koda_runtime.kafka import producer_config
from koda_runtime.lifecycle.chunks import chunk_key, visible_output
from koda_runtime.processors.handlers.demo import demo_tokens
from koda_runtime.schemas.migrate import upgrade
from koda_runtime.settings import Settings
from koda_runtime.topics.admin import apply_topics
from koda_runtime.topics.catalogue import RUN_CHUNKS, partition_for_key
from koda_runtime.topics.records.codec import chunk_value
from tests.fixtures.gateway import serve_app
from tests.fixtures.namespaces import delete_topics, drop_schema, make_settings
from tests.fixtures.processes import GatewayProcess, WorkerProcess
from tests.fixtures.runs import Submitter
from tests.sse_client import bearer, contents, follow_run, numbered, read_stream
from tests.support import async_wait_until, wait_until

GATEWAY_ENV = {
    "KODA_SSE_KEEPALIVE": "0.5",
    "KODA_SSE_RETRY_MS": "200",
    "KODA_SSE_QUEUE_BYTES": "65536",
    "KODA_SSE_WRITE_TIMEOUT": "1",
    "KODA_RATE_PER_S": "1000",
    "KODA_RATE_BURST": "1000",
}


@dataclass
class Live:
    settings: Settings
    gateway: GatewayProcess
    worker: WorkerProcess
    submitter: Submitter

    def run(self, user: str, inp: dict[str, Any], *, publish: bool = True) -> str:
        return self.submitter.submit(user, inp, publish=publish)

    def rows(self, run_id: str) -> list[Any]:
        return self.submitter.messages(run_id)

    def wait_terminal(self, run_id: str, timeout: float = 60) -> list[Any]:
        wait_until(
            lambda: self.submitter.all_terminal([run_id]),
            timeout=timeout,
            what=f"run {run_id} terminal",
        )
        return self.rows(run_id)

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.gateway.url, timeout=httpx.Timeout(30.0))

    def metric(self, name: str, **labels: str) -> float:
        """The sum of ``name``'s samples whose labels include ``labels``."""
        text = httpx.get(f"{self.gateway.url}/metrics", timeout=5).text
        wanted = [f'{k}="{v}"' for k, v in labels.items()]
        total = 0.0
        for line in text.splitlines():
            series, _, value = line.rpartition(" ")
            metric, _, label_text = series.partition("{")
            if metric == name and all(w in label_text for w in wanted):
                total += float(value)
        return total


@pytest.fixture(scope="module")
def live(stack) -> Iterator[Live]:
    settings = make_settings(stack, max_inflight=16)
    upgrade(settings)
    apply_topics(settings)
    sub = Submitter(settings)
    gateway = GatewayProcess(settings, dict(GATEWAY_ENV))
    worker = WorkerProcess(settings, "sse-w1")
    try:
        gateway.start()
        worker.start()
        # Warm up: the worker owns its partitions before the tests start timing.
        warm = sub.submit("warm", {"text": "warm", "demo": {"tokens": 1, "delay_ms": 0}})
        wait_until(lambda: sub.all_terminal([warm]), timeout=90, what="warm-up run")
        yield Live(settings, gateway, worker, sub)
    finally:
        worker.stop()
        gateway.stop()
        sub.close()
        delete_topics(settings)
        drop_schema(settings)


def assert_exact(stream_events: list[Any], rows: list[Any], after: int = -1) -> None:
    """The events are exactly rows after+1 .. end, in order, with the stored contents."""
    got = [(s, k, c) for s, k, c in contents(stream_events)]
    want = [(r.seq, r.kind, r.content) for r in rows if r.seq > after]
    assert got == want


# --- requests that are refused -------------------------------------------------------


async def test_refusals_name_the_problem(live: Live) -> None:
    run_id = live.run("owner", {"text": "mine", "demo": {"tokens": 2, "delay_ms": 0}})
    live.wait_terminal(run_id)
    async with live.client() as c:
        r = await c.get(f"/v1/runs/{run_id}/events")
        assert r.status_code == 401
        for header, params, field in [
            ({"Last-Event-ID": "abc"}, None, "Last-Event-ID"),
            ({"Last-Event-ID": "-1"}, None, "Last-Event-ID"),
            ({}, {"after": "x1"}, "after"),
            ({}, {"after": "-5"}, "after"),
        ]:
            r = await c.get(
                f"/v1/runs/{run_id}/events", headers={**bearer("owner"), **header}, params=params
            )
            assert r.status_code == 400, r.text
            assert r.json()["error"]["field"] == field
        other = await c.get(f"/v1/runs/{run_id}/events", headers=bearer("intruder"))
        unknown = await c.get(
            "/v1/runs/01900000-0000-7000-8000-000000000000/events", headers=bearer("owner")
        )
        assert other.status_code == unknown.status_code == 404
        assert other.json() == unknown.json()
        # Without a header, EventSource-style: the token in the query string.
        s = await read_stream(c, run_id, params={"access_token": "dev:owner"})
        assert s.status == 200 and s.closed_by_server
        s = await read_stream(c, run_id, params={"access_token": "dev:intruder"})
        assert s.status == 404


# --- viewers ------------------------------------------------------------------------


async def test_two_viewers_get_everything_and_a_late_viewer_gets_it_all_then_close(
    live: Live,
) -> None:
    inp = {"text": "two viewers", "demo": {"tokens": 30, "delay_ms": 20}}
    run_id = live.run("viewer-user", inp, publish=False)
    async with live.client() as c:
        first = asyncio.create_task(read_stream(c, run_id, headers=bearer("viewer-user")))
        second = asyncio.create_task(read_stream(c, run_id, headers=bearer("viewer-user")))
        await async_wait_until(
            lambda: _async(live.metric("koda_sse_connections") >= 2),
            timeout=10,
            what="both viewers connected",
        )
        live.submitter.publish(run_id, "viewer-user")
        streams = await asyncio.wait_for(asyncio.gather(first, second), 60)
        rows = live.rows(run_id)
        for s in streams:
            assert s.status == 200 and s.closed_by_server and s.retry == 200
            assert_exact(s.events, rows)
        assert visible_output(numbered(contents(streams[0].events))) == "".join(demo_tokens(inp))
        late = await read_stream(c, run_id, headers=bearer("viewer-user"))
        assert late.closed_by_server
        assert_exact(late.events, rows)
        resumed = await read_stream(c, run_id, headers=bearer("viewer-user"), last_event_id=12)
        assert_exact(resumed.events, rows, after=12)
        # Past the terminal event: 204, which tells an EventSource to stop reconnecting.
        over = await read_stream(
            c, run_id, headers=bearer("viewer-user"), last_event_id=rows[-1].seq
        )
        assert over.status == 204


async def _async(value: Any) -> Any:
    return value


async def test_keepalive_comments_while_a_run_waits(live: Live) -> None:
    run_id = live.run(
        "patient", {"text": "wait", "demo": {"tokens": 3, "delay_ms": 0}}, publish=False
    )
    async with live.client() as c:
        async with c.stream(
            "GET", f"/v1/runs/{run_id}/events", headers=bearer("patient")
        ) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            assert response.headers["cache-control"] == "no-cache"
            chunks = response.aiter_bytes()
            seen = b""
            started = time.monotonic()
            while seen.count(b": keep-alive") < 2:
                seen += await anext(chunks)
            assert time.monotonic() - started < 5  # keep-alive every 0.5 s here
            live.submitter.publish(run_id, "patient")
            parser = EventParser()
            events = parser.feed(seen)
            async for chunk in chunks:
                events += parser.feed(chunk)
            assert [e.event for e in events] == ["chunk"] * 3 + ["done"]


# --- the property: any disconnects, any resume points ----------------------------------

TOKENS = 24


@st.composite
def client_plans(draw: Any) -> dict[str, Any]:
    return {
        "start": draw(st.integers(min_value=-1, max_value=TOKENS + 1)),
        "via_query": draw(st.booleans()),
        "cuts": draw(st.lists(st.integers(min_value=1, max_value=9), max_size=4)),
        "delay_ms": draw(st.integers(min_value=0, max_value=400)),
        "pause_ms": draw(st.integers(min_value=0, max_value=150)),
    }


@settings(
    max_examples=10,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(plans=st.lists(client_plans(), min_size=2, max_size=3))
def test_any_disconnects_and_resume_points_give_exactly_the_output(
    live: Live, plans: list[dict[str, Any]]
) -> None:
    inp = {"text": f"property {time.monotonic_ns()}", "demo": {"tokens": TOKENS, "delay_ms": 15}}
    run_id = live.run("prop-user", inp)

    async def client(plan: dict[str, Any]) -> tuple[int, list[Any]]:
        await asyncio.sleep(plan["delay_ms"] / 1000)  # the plan's drawn join time, not a wait
        start, last = plan["start"], plan["start"]
        received: list[Any] = []
        async with live.client() as c:
            for i, cut in enumerate([*plan["cuts"], None]):
                kwargs: dict[str, Any] = {}
                if last >= 0 and (i > 0 or not plan["via_query"]):
                    kwargs["last_event_id"] = last
                elif last >= 0:
                    kwargs["params"] = {"after": str(last)}
                s = await read_stream(
                    c, run_id, headers=bearer("prop-user"), max_events=cut, **kwargs
                )
                if s.status == 204:
                    break  # the run is over and we are past its end
                assert s.status == 200
                for e in s.events:
                    assert e.seq == last + 1, f"seq {e.seq} after {last}"
                    last = e.seq
                received += s.events
                if s.terminal or (cut is None and s.closed_by_server):
                    break
                await asyncio.sleep(plan["pause_ms"] / 1000)  # the drawn pause between cuts
        return start, received

    async def scenario() -> list[tuple[int, list[Any]]]:
        return await asyncio.wait_for(asyncio.gather(*(client(p) for p in plans)), 90)

    results = asyncio.run(scenario())
    rows = live.wait_terminal(run_id)
    expected = "".join(demo_tokens(inp))
    assert visible_output((r.seq, r.kind, r.content) for r in rows) == expected
    for start, received in results:
        had = [(r.seq, r.kind, r.content) for r in rows if r.seq <= start]
        got = contents(received)
        assert [s for s, _, _ in had + got] == [r.seq for r in rows]  # +1 each, no gap
        assert visible_output(had + got) == expected
        if got:
            assert got[-1][1] in TERMINAL_KINDS


# --- a viewer that stops reading -------------------------------------------------------


def _stalled_client(url: str, run_id: str, user: str) -> socket.socket:
    """Open the stream, read the response head, then never read again."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    sock.sendall(
        f"GET /v1/runs/{run_id}/events HTTP/1.1\r\nHost: {host}\r\n"
        f"Authorization: Bearer dev:{user}\r\nAccept: text/event-stream\r\n\r\n".encode()
    )
    head = b""
    while b"\r\n\r\n" not in head:
        head += sock.recv(1024)
    assert head.startswith(b"HTTP/1.1 200"), head
    return sock


async def test_a_viewer_that_stops_reading_is_cut_off_and_memory_stays_bounded(
    live: Live,
) -> None:
    tokens, token_bytes = 4000, 8000  # about 32 MB of output
    inp = {"text": "flood", "demo": {"tokens": tokens, "delay_ms": 0, "token_bytes": token_bytes}}
    user = "flood-user"
    run_id = live.run(user, inp, publish=False)
    gateway = psutil.Process(live.gateway.proc.pid)  # type: ignore[union-attr]
    cut_before = live.metric("koda_sse_viewers_cut_total")
    stalled = _stalled_client(live.gateway.url, run_id, user)
    try:
        async with live.client() as c:
            reader = asyncio.create_task(follow_run(c, run_id, headers=bearer(user)))
            await async_wait_until(
                lambda: _async(live.metric("koda_sse_connections") >= 2),
                timeout=10,
                what="both viewers connected",
            )
            baseline = gateway.memory_info().rss
            peak = baseline
            stop = threading.Event()

            def sample() -> None:
                nonlocal peak
                while not stop.is_set():
                    peak = max(peak, gateway.memory_info().rss)
                    stop.wait(0.05)

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            live.submitter.publish(run_id, user)
            try:
                full = await asyncio.wait_for(reader, 120)
            finally:
                stop.set()
                sampler.join()
        rows = live.rows(run_id)
        # The reading viewer got everything, unblocked (resuming if it was too slow itself).
        assert_exact(full.events, rows)
        assert live.metric("koda_sse_viewers_cut_total") >= cut_before + 1
        assert live.metric("koda_sse_queued_bytes") == 0
        wait_until(
            lambda: live.metric("koda_sse_connections") == 0,
            timeout=10,
            what="the stalled stream was closed",
        )
        output_bytes = tokens * token_bytes
        growth = peak - baseline
        assert growth < output_bytes / 2, f"gateway RSS grew by {growth / 1e6:.1f} MB"
        # The stalled client, reading again, finds the end of its connection.
        stalled.settimeout(10)
        received = 0
        while chunk := stalled.recv(1 << 16):
            received += len(chunk)
        assert received < output_bytes / 2
        # Cut for overflow (its queue filled) or stalled (a write timed out), by timing;
        # either is expected, neither is an error.
        log = live.gateway.log()
        assert "event=sse_viewer_cut" in log
        assert "level=ERROR" not in log, log[-3000:]
    finally:
        stalled.close()


def test_follow_command_prints_the_output_and_reports_how_the_run_ended(live: Live) -> None:
    ok = {"text": "follow me", "demo": {"tokens": 5, "delay_ms": 10}}
    good = live.run("cli-user", ok)
    bad = live.run(
        "cli-user", {"text": "x", "demo": {"tokens": 2, "delay_ms": 1, "fail_attempts": 99}}
    )
    runner = CliRunner()
    base = ["--user", "cli-user", "--gateway", live.gateway.url]
    result = runner.invoke(runs_app, ["follow", good, *base])
    assert result.exit_code == 0, result.output
    assert result.stdout == "".join(demo_tokens(ok)) + "\n"
    resumed = runner.invoke(runs_app, ["follow", good, "--after", "2", *base])
    assert resumed.stdout == "".join(demo_tokens(ok)[3:]) + "\n"
    assert runner.invoke(runs_app, ["follow", good, "--after", "99", *base]).exit_code == 0
    failed = runner.invoke(runs_app, ["follow", bad, *base])
    assert failed.exit_code == 1 and "[error]" in failed.stderr
    other = runner.invoke(
        runs_app, ["follow", good, "--user", "intruder", "--gateway", live.gateway.url]
    )
    assert other.exit_code == 2 and "404" in other.stderr


async def test_a_live_seq_that_skips_ahead_is_backfilled_from_postgres(live: Live) -> None:
    """The feed missed seqs 3 and 4 (only 5 reaches the topic): Postgres fills the gap."""
    user = "gap-user"
    run_id = live.run(user, {"text": "gap"}, publish=False)
    insert = text(
        "INSERT INTO messages (run_id, seq, kind, content, attempt) VALUES (:r, :s, :k, :c, 1)"
    )

    def store(seq: int, kind: str) -> None:
        with live.submitter.engine.begin() as conn:
            conn.execute(insert, {"r": run_id, "s": seq, "k": kind, "c": f"c{seq}"})

    for seq in range(3):
        store(seq, "chunk")
    gaps = metrics.SSE_BACKFILLS.labels(reason="gap")
    gaps_before = gaps._value.get()
    # No idle catch-up during this test: only a gap can bring seqs 3 and 4.
    app = create_app(live.settings.with_(sse_keepalive_s=60), run_sweeper=False)
    with serve_app(app) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            async with c.stream("GET", f"/v1/runs/{run_id}/events", headers=bearer(user)) as r:
                parser, events = EventParser(), list[Event]()
                chunks = r.aiter_bytes()
                while len(events) < 3:  # the replay is done once 0..2 arrived
                    events += parser.feed(await anext(chunks))
                store(3, "chunk")
                store(4, "chunk")
                store(5, "done")
                produce_chunk(live.settings, run_id, 5, "done", "c5")
                async for chunk in chunks:
                    events += parser.feed(chunk)
    assert [(e.seq, e.event) for e in events] == [(i, "chunk") for i in range(5)] + [(5, "done")]
    assert gaps._value.get() == gaps_before + 1


def produce_chunk(settings: Settings, run_id: str, seq: int, kind: str, content: str) -> None:
    producer = Producer(producer_config(settings, "test"))
    producer.produce(
        settings.names.topic(RUN_CHUNKS),
        key=chunk_key(run_id, seq).encode(),
        value=chunk_value(run_id, seq, kind, content, 1),
        partition=partition_for_key(b"gap-user", settings.partitions),
    )
    assert producer.flush(10) == 0


def test_the_gateway_stayed_clean_through_the_module(live: Live) -> None:
    assert live.gateway.proc is not None and live.gateway.proc.poll() is None
    log = live.gateway.log()
    assert "Traceback" not in log, log[-3000:]
    assert live.metric("koda_sse_connections") == 0
