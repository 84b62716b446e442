"""A worker is killed mid-run: its viewers see ``reset``, then the successor's output."""

from __future__ import annotations

import asyncio
import json

import httpx

from koda_runtime.lifecycle.chunks import visible_output
from koda_runtime.processors.handlers.demo import demo_tokens
from koda_runtime.settings import Settings
from tests.fixtures.processes import GatewayProcess, WorkerProcess
from tests.fixtures.runs import Submitter
from tests.sse_client import bearer, contents, follow_run, numbered, read_stream
from tests.support import wait_until


async def test_viewers_follow_a_run_across_a_worker_kill(env: Settings) -> None:
    sub = Submitter(env)
    gateway = GatewayProcess(env, {"KODA_SSE_KEEPALIVE": "0.5"}).start()
    w1 = WorkerProcess(env, "w1").start()
    w2: WorkerProcess | None = None
    user = "handoff-user"
    inp = {"text": "survive the kill", "demo": {"tokens": 30, "delay_ms": 150}}
    try:
        run_id = sub.submit(user, inp)
        async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as client:
            steady = asyncio.create_task(follow_run(client, run_id, headers=bearer(user)))
            first = await read_stream(client, run_id, headers=bearer(user), max_events=5)
            assert [e.seq for e in first.events] == [0, 1, 2, 3, 4]
            await asyncio.to_thread(
                wait_until,
                lambda: len(sub.messages(run_id)) >= 8,
                timeout=60,
                what="run streaming",
            )
            w1.kill()
            # Reconnect while no worker owns the run, then again after the successor starts.
            gap = await read_stream(
                client, run_id, headers=bearer(user), last_event_id=4, max_events=2
            )
            w2 = WorkerProcess(env, "w2").start()
            last = gap.events[-1].seq
            assert last is not None
            rest = await follow_run(client, run_id, headers=bearer(user), after=last)
            steady_result = await asyncio.wait_for(steady, 90)
        rows = sub.messages(run_id)
        assert [r.seq for r in rows] == list(range(len(rows)))
        kinds = [r.kind for r in rows]
        assert kinds.count("reset") == 1 and kinds[-1] == "done"
        stored = [(r.seq, r.kind, r.content) for r in rows]
        resumed = contents(first.events) + contents(gap.events) + contents(rest.events)
        for got in (resumed, contents(steady_result.events)):
            assert got == stored  # every seq once, in order, reset included
            assert visible_output(numbered(got)) == "".join(demo_tokens(inp))
        reset = next(e for e in steady_result.events if e.event == "reset")
        assert json.loads(reset.data)["attempt"] == 2
    finally:
        for w in (w1, w2):
            if w is not None:
                w.stop()
        gateway.stop()
        sub.close()


async def test_sigterm_cuts_open_streams_with_a_reconnect_hint(env: Settings) -> None:
    sub = Submitter(env)
    gateway = GatewayProcess(env, {"KODA_SSE_KEEPALIVE": "0.5"}).start()
    try:
        run_id = sub.submit("waiting", {"text": "never published"}, publish=False)
        async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
            reader = asyncio.create_task(read_stream(client, run_id, headers=bearer("waiting")))
            await asyncio.to_thread(
                wait_until,
                lambda: "koda_sse_connections 1.0" in httpx.get(f"{gateway.url}/metrics").text,
                timeout=10,
                what="stream open",
            )
            started = asyncio.get_running_loop().time()
            status = await asyncio.to_thread(gateway.stop)
            stream = await asyncio.wait_for(reader, 10)
        assert status == 0
        assert asyncio.get_running_loop().time() - started < 8  # not the 15 s grace period
        assert stream.closed_by_server
        assert [e.event for e in stream.events] == ["reconnect"]
        assert json.loads(stream.events[0].data)["reason"] == "shutdown"
    finally:
        gateway.stop()
        sub.close()
