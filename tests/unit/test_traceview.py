"""``koda traces show``'s drawing (cli/traces.py), on traces shaped as Jaeger's query
API returns them; the real receiver is tests/e2e/test_tracing.py's."""

from __future__ import annotations

import socket

import pytest

from koda_runtime.cli import traces as traceview

TRACE = "ab" * 16


def span(span_id: str, name: str, start: int, took: int, parent: str | None = None, **kw):
    refs = [{"refType": "CHILD_OF", "traceID": TRACE, "spanID": parent}] if parent else []
    refs += kw.get("links", [])
    return {
        "traceID": TRACE,
        "spanID": span_id,
        "operationName": name,
        "startTime": start,
        "duration": took,
        "references": refs,
        "processID": kw.get("pid", "p1"),
        "tags": [{"key": k, "value": v} for k, v in kw.get("tags", {}).items()],
    }


def trace(*spans):
    return {
        "traceID": TRACE,
        "spans": list(spans),
        "processes": {"p1": {"serviceName": "gw"}, "p2": {"serviceName": "worker"}},
    }


def body(line: str) -> str:
    return line[9 + 1 + 9 + 2 + traceview.BAR_WIDTH + 2 :]


def test_children_are_drawn_under_their_parents_in_start_order() -> None:
    lines = traceview.render(
        trace(
            span("c2", "second", 1_500, 100, "r", pid="p2"),
            span("r", "root", 1_000, 2_000),
            span("c1", "first", 1_100, 100, "r", pid="p2", tags={"koda.attempt": 2}),
            span("g", "grandchild", 1_120, 10, "c1", pid="p2"),
        )
    )
    assert lines[0] == f"trace {TRACE}: 4 spans, 2.0 ms, services gw, worker"
    assert [body(x) for x in lines[2:]] == [
        "gw: root",
        "  worker: first  [koda.attempt=2]",
        "    worker: grandchild",
        "  worker: second",
    ]
    assert lines[2].startswith("      0.0       2.0  ")


def test_a_span_whose_parent_is_missing_is_a_root_and_links_are_named() -> None:
    link = {"refType": "FOLLOWS_FROM", "traceID": "cd" * 16, "spanID": "s9"}
    lines = traceview.render(
        trace(span("v", "viewer", 0, 5, parent="gone", links=[link]), span("r", "root", 1, 1))
    )
    assert [body(x) for x in lines[2:]] == [
        "gw: viewer (linked to cdcdcdcd…/s9)",
        "gw: root",
    ]


def test_a_traceparent_names_its_trace_and_anything_else_is_refused() -> None:
    assert traceview.trace_id_of(f"00-{TRACE}-b7ad6b7169203331-01") == TRACE
    assert traceview.is_trace_id(TRACE) and not traceview.is_trace_id("run-1")
    with pytest.raises(ValueError, match="traceparent"):
        traceview.trace_id_of("00-short-b7ad-01")


def test_a_receiver_that_does_not_answer_is_named() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(traceview.TraceNotFound, match=f"127.0.0.1:{port}.*did not answer"):
        traceview.fetch(f"http://127.0.0.1:{port}", TRACE, timeout_s=2)
