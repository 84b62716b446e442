"""One run's trace across processes, as a real OTLP receiver (Jaeger) stores it.

The module starts Jaeger (the binary `make install` builds into build/), a worker with
the openai handler against the local OpenAI-wire model server, and gateways A and B,
all exporting to Jaeger. A run submitted through A and followed through B must be one
trace in Jaeger's own query API: the gateway's request span, the worker's run span
under it, the claim, the model call (with its time to first token and token counts)
and the group writes under that; B's viewer span linked to it. With tracing disabled a
gateway exports nothing and passes only a client's traceparent on. A worker whose
receiver is down still finishes its runs and stops on SIGTERM.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from koda_runtime.cli import traces as traceview
from koda_runtime.localstack import jaeger
from koda_runtime.schemas.db import sync_engine
from koda_runtime.schemas.migrate import upgrade
from koda_runtime.settings import Settings
from koda_runtime.topics.admin import apply_topics
from koda_runtime.topics.catalogue import RUNS
from koda_runtime.topics.records.codec import RUN_REQUESTED, RunRequested, header_value, headers_for
from tests.fixtures.model_server import PIECES, FakeCompletions, serve_model
from tests.fixtures.namespaces import delete_topics, drop_schema, make_settings
from tests.fixtures.processes import GatewayProcess, WorkerProcess
from tests.fixtures.runs import Submitter, read_topic
from tests.sse_client import bearer, follow_run
from tests.support import wait_until

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
CLIENT_TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"


def otel_env(endpoint: str, service: str) -> dict[str, str]:
    # A short batch delay: the test waits for spans through the query API.
    return {
        "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
        "OTEL_SERVICE_NAME": service,
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Traced:
    settings: Settings
    jaeger: jaeger.Ports
    sub: Submitter
    a: GatewayProcess
    b: GatewayProcess
    off: GatewayProcess
    worker: WorkerProcess
    services: dict[str, str]

    def trace(self, trace_id: str) -> list[dict[str, Any]]:
        """The trace's spans as Jaeger returns them (empty until it has any)."""
        r = httpx.get(f"{self.jaeger.url}/api/traces/{trace_id}", timeout=5)
        if r.status_code == 404:
            return []
        r.raise_for_status()
        data = r.json()["data"]
        if not data:
            return []
        trace = data[0]
        names = {pid: p["serviceName"] for pid, p in trace["processes"].items()}
        spans: list[dict[str, Any]] = trace["spans"]
        for span in spans:
            span["service"] = names[span["processID"]]
            span["tagmap"] = {t["key"]: t["value"] for t in span["tags"]}
        return spans

    def service_names(self) -> set[str]:
        r = httpx.get(f"{self.jaeger.url}/api/services", timeout=5)
        r.raise_for_status()
        return set(r.json()["data"] or [])


@pytest.fixture(scope="module")
def traced(stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Traced]:
    state = Path(tmp_path_factory.mktemp("jaeger"))
    ports = jaeger.start(state, preferred=False)
    cfg = make_settings(stack)
    apply_topics(cfg)
    upgrade(cfg)
    model_url, model = serve_model(FakeCompletions)
    ns = cfg.namespace
    services = {k: f"koda-{k}-{ns}" for k in ("a", "b", "off", "worker")}
    sub = Submitter(cfg)
    procs: list[Any] = []
    try:
        worker = WorkerProcess(
            cfg,
            "traced-w1",
            {
                "KODA_HANDLER": "openai",
                "KODA_OPENAI_BASE_URL": model_url,
                "KODA_MEMORY": "false",
                **otel_env(ports.endpoint, services["worker"]),
            },
        ).start()
        procs.append(worker)
        a = GatewayProcess(cfg, otel_env(ports.endpoint, services["a"])).start()
        procs.append(a)
        b = GatewayProcess(cfg, otel_env(ports.endpoint, services["b"])).start()
        procs.append(b)
        off = GatewayProcess(
            cfg, {**otel_env(ports.endpoint, services["off"]), "OTEL_SDK_DISABLED": "true"}
        ).start()
        procs.append(off)

        def assigned() -> bool:
            worker.check()
            rows = sub.query(
                "SELECT count(*) AS n FROM partition_epochs WHERE worker_id = 'traced-w1'"
            )
            return bool(rows[0].n == cfg.partitions)

        wait_until(assigned, timeout=60, what="the worker holds every partition")
        yield Traced(cfg, ports, sub, a, b, off, worker, services)
    finally:
        for p in procs:
            p.stop()
        sub.close()
        model.shutdown()
        model.server_close()
        jaeger.stop(state)
        delete_topics(cfg)
        drop_schema(cfg)


def submit(gw: GatewayProcess, user: str, headers: dict[str, str] | None = None) -> str:
    r = httpx.post(
        f"{gw.url}/v1/runs",
        json={"input": {"text": "hello"}},
        headers={**bearer(user), **(headers or {})},
        timeout=10,
    )
    assert r.status_code == 202, r.text
    return str(r.json()["run_id"])


def follow(gw: GatewayProcess, user: str, run_id: str) -> list[str]:
    async def watch() -> list[str]:
        async with httpx.AsyncClient(base_url=gw.url, timeout=30) as client:
            followed = await follow_run(client, run_id, headers=bearer(user))
        return [e.event for e in followed.events]

    return asyncio.run(watch())


def stored_traceparent(t: Traced, run_id: str) -> str | None:
    rows = t.sub.query("SELECT traceparent FROM runs WHERE id = :r", r=run_id)
    return None if rows[0].traceparent is None else str(rows[0].traceparent)


def record_traceparent(t: Traced, run_id: str) -> bytes | None:
    records = [
        m
        for m in read_topic(t.settings, t.settings.names.topic(RUNS), timeout=5)
        if json.loads(m.value())["run_id"] == run_id
    ]
    assert len(records) == 1, records
    return header_value(records[0].headers(), "traceparent")


def one(spans: list[dict[str, Any]], name: str) -> dict[str, Any]:
    found = [s for s in spans if s["operationName"] == name]
    assert len(found) == 1, (name, [s["operationName"] for s in spans])
    return found[0]


def parent_of(span: dict[str, Any]) -> str | None:
    refs = [r["spanID"] for r in span["references"] if r["refType"] == "CHILD_OF"]
    return refs[0] if refs else None


def test_a_run_is_one_trace_from_the_gateway_through_the_worker_to_the_model(
    traced: Traced,
) -> None:
    t = traced
    user = "trace-user-1"
    run_id = submit(t.a, user)
    events = follow(t.b, user, run_id)
    assert events[-1] == "done", events
    assert t.sub.output(run_id) == "".join(PIECES)

    traceparent = stored_traceparent(t, run_id)
    assert traceparent is not None
    assert record_traceparent(t, run_id) == traceparent.encode()
    _, trace_id, request_span_id, _ = traceparent.split("-")

    wanted = {"POST /v1/runs", "koda.run", "koda.claim", "chat gpt-4o-mini", "koda.finish"}

    def complete() -> bool:
        return wanted <= {s["operationName"] for s in t.trace(trace_id)}

    wait_until(complete, timeout=30, what=f"the run's spans in Jaeger's trace {trace_id}")
    spans = t.trace(trace_id)
    request = one(spans, "POST /v1/runs")
    run = one(spans, "koda.run")
    claim = one(spans, "koda.claim")
    call = one(spans, "chat gpt-4o-mini")
    finish = one(spans, "koda.finish")

    assert request["spanID"] == request_span_id
    assert request["service"] == t.services["a"]
    assert request["tagmap"]["koda.run_id"] == run_id
    assert parent_of(request) is None  # the client sent no traceparent: a new trace

    assert run["service"] == t.services["worker"]
    assert parent_of(run) == request["spanID"]
    assert run["tagmap"]["koda.run_id"] == run_id
    assert run["tagmap"]["koda.attempt"] == 1
    assert run["tagmap"]["koda.worker_id"] == "traced-w1"
    assert "messaging.kafka.offset" in run["tagmap"]

    for child in (claim, call, finish):
        assert parent_of(child) == run["spanID"], child["operationName"]
    assert call["tagmap"]["gen_ai.request.model"] == "gpt-4o-mini"
    assert call["tagmap"]["gen_ai.usage.input_tokens"] == 7
    assert call["tagmap"]["gen_ai.usage.output_tokens"] == 5
    assert call["tagmap"]["gen_ai.response.time_to_first_token"] > 0
    assert [log["fields"][0]["value"] for log in call["logs"]] == ["first_token"]
    # Chunk batches, not tokens: the five pieces came in far fewer writes.
    writes = [s for s in spans if s["operationName"] == "koda.chunks.write"]
    assert all(parent_of(w) == run["spanID"] for w in writes)
    assert len(writes) < len(PIECES)

    # B's viewer: a span of its own trace, linked to the run's.
    def viewer() -> dict[str, Any] | None:
        r = httpx.get(
            f"{t.jaeger.url}/api/traces",
            params={"service": t.services["b"], "limit": 20},
            timeout=5,
        )
        r.raise_for_status()
        for trace in r.json()["data"] or []:
            for span in trace["spans"]:
                tags = {x["key"]: x["value"] for x in span["tags"]}
                if tags.get("koda.run_id") == run_id:
                    return dict(span)
        return None

    wait_until(lambda: viewer() is not None, timeout=30, what="the viewer's span in Jaeger")
    seen = viewer()
    assert seen is not None
    assert seen["operationName"] == "GET /v1/runs/{run_id}/events"
    assert seen["traceID"] != trace_id
    linked = [(r["traceID"], r["spanID"]) for r in seen["references"]]
    assert (trace_id, request_span_id) in linked

    # The worker's log lines of the run carry the trace id.
    assert f"trace_id={trace_id}" in t.worker.log()

    # `koda traces show`: the same trace drawn as a tree, from the run id alone.
    engine = sync_engine(t.settings)
    try:
        assert traceview.run_trace_id(engine, run_id) == trace_id
    finally:
        engine.dispose()
    drawn = traceview.render(traceview.fetch(t.jaeger.url, trace_id))
    print("\n".join(drawn))
    assert drawn[0].startswith(f"trace {trace_id}: ")
    rows = drawn[2:]

    def depth_of(name: str) -> int:
        (line,) = [r for r in rows if f": {name}" in r and (r.endswith(name) or f"{name}  [" in r)]
        body = line[9 + 1 + 9 + 2 + traceview.BAR_WIDTH + 2 :]  # after offset, took, bar
        return (len(body) - len(body.lstrip(" "))) // 2

    assert depth_of("POST /v1/runs") == 0
    assert depth_of("koda.run") == 1
    assert depth_of("chat gpt-4o-mini") == 2
    assert depth_of("koda.claim") == 2


def test_with_tracing_disabled_nothing_is_exported_and_only_a_client_trace_passes_on(
    traced: Traced,
) -> None:
    t = traced
    plain = submit(t.off, "trace-off-1")
    carried = submit(t.off, "trace-off-2", {"traceparent": CLIENT_TRACEPARENT})
    wait_until(lambda: t.sub.all_terminal([plain, carried]), timeout=30, what="both runs ended")
    assert stored_traceparent(t, plain) is None
    assert record_traceparent(t, plain) is None
    assert stored_traceparent(t, carried) == CLIENT_TRACEPARENT
    assert record_traceparent(t, carried) == CLIENT_TRACEPARENT.encode()

    # The traced worker continued the client's trace: its run span's parent is the
    # client's span. Once Jaeger has it, the disabled gateway would have been seen too.
    def continued() -> bool:
        return any(s["operationName"] == "koda.run" for s in t.trace(CLIENT_TRACE))

    wait_until(continued, timeout=30, what="the worker's span in the client's trace")
    run = one(t.trace(CLIENT_TRACE), "koda.run")
    assert parent_of(run) == CLIENT_SPAN
    assert t.services["off"] not in t.service_names()
    assert t.services["worker"] in t.service_names()


def produce_traced(sub: Submitter, user: str, run_id: str, traceparent: str) -> None:
    """The run's ``run.requested`` record with a ``traceparent`` header, as a gateway sends."""
    sub.produce_raw(
        user.encode(),
        RunRequested(run_id, user, f"s-{user}", "").encode(),
        [*headers_for(RUN_REQUESTED), ("traceparent", traceparent.encode())],
    )


def test_a_rerun_after_a_handoff_joins_the_same_trace(traced: Traced, stack) -> None:
    """A worker killed mid-run: the next owner reads the same record, so its attempt 2
    is a child of the record's trace context, beside what the first worker exported."""
    cfg = make_settings(stack)
    apply_topics(cfg)
    upgrade(cfg)
    sub = Submitter(cfg)
    trace_id, span_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    env = otel_env(traced.jaeger.endpoint, f"koda-handoff-{cfg.namespace}")
    first = WorkerProcess(cfg, "handoff-w1", env).start()
    second: WorkerProcess | None = None
    try:
        user = "trace-handoff-1"
        run_id = sub.submit(
            user, {"text": "x", "demo": {"tokens": 100, "delay_ms": 20}}, publish=False
        )
        produce_traced(sub, user, run_id, f"00-{trace_id}-{span_id}-01")
        wait_until(lambda: len(sub.messages(run_id)) >= 3, timeout=60, what="the run streams")
        first.kill()  # its attempt's span never ends: lost with the process
        second = WorkerProcess(cfg, "handoff-w2", env).start()
        wait_until(lambda: sub.all_terminal([run_id]), timeout=90, what="the rerun ended")
        assert sub.statuses([run_id]) == {run_id: "done"}

        def rerun() -> list[dict[str, Any]]:
            return [
                s
                for s in traced.trace(trace_id)
                if s["operationName"] == "koda.run" and s["tagmap"].get("koda.attempt") == 2
            ]

        wait_until(lambda: rerun() != [], timeout=30, what="attempt 2's span in the trace")
        (span,) = rerun()
        assert parent_of(span) == span_id
        assert span["tagmap"]["koda.worker_id"] == "handoff-w2"
        assert span["tagmap"]["koda.run_id"] == run_id
    finally:
        first.kill()
        if second is not None:
            second.stop()
        sub.close()
        delete_topics(cfg)
        drop_schema(cfg)


def test_a_receiver_that_is_down_never_blocks_a_run(stack) -> None:
    """A worker exporting to a closed port: its runs end, and it stops on SIGTERM."""
    cfg = make_settings(stack)
    apply_topics(cfg)
    upgrade(cfg)
    sub = Submitter(cfg)
    dead = f"http://127.0.0.1:{closed_port()}"
    worker = WorkerProcess(cfg, "dead-exporter", otel_env(dead, "koda-dead")).start()
    try:
        user = "trace-dead-1"
        run_ids = [sub.submit(user, {"text": "x", "demo": {"tokens": 20, "delay_ms": 1}},
                              publish=False) for _ in range(3)]  # fmt: skip
        for run_id in run_ids:  # traced records: every span is sampled and exported
            produce_traced(sub, user, run_id, CLIENT_TRACEPARENT)
        wait_until(lambda: sub.all_terminal(run_ids), timeout=60, what="runs ended")
        assert set(sub.statuses(run_ids).values()) == {"done"}
        assert worker.stop() == 0
        assert "event=tracing_on" in worker.log()
    finally:
        worker.kill()
        sub.close()
        delete_topics(cfg)
        drop_schema(cfg)
