"""``koda traces show``: one run's trace, as its OTLP receiver stores it, on a terminal.

The receiver is Jaeger (``koda services up --with-tracing`` starts one; a deployment
names its own with ``--query``), read through its query API: ``GET /api/traces/<id>``
answers ``{"data": [{"traceID", "spans": [...], "processes": {...}}]}``, each span with
``spanID``, ``operationName``, ``references`` (``CHILD_OF`` its parent, ``FOLLOWS_FROM``
a link), ``startTime`` and ``duration`` in microseconds, ``tags`` and ``processID``.

:func:`render` draws the spans as a tree under their parents, ordered by start, one line
each: start offset from the trace's first span, duration, service, span name and a few
attributes (:data:`SHOWN`), with a bar on a shared time axis. A span whose parent is
not in the trace (a client's, or one the exporter dropped) is drawn as a root. Links
(an SSE viewer's span to the run) are listed after the span's name.

Failure mode: a receiver that does not answer, or does not hold the trace, is a
:class:`TraceNotFound` naming the URL and the id, never an empty drawing.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import typer

from koda_runtime.cli.common import fail, friendly, load_settings
from koda_runtime.errors import KodaError

if TYPE_CHECKING:
    from sqlalchemy import Engine

traces_app = typer.Typer(no_args_is_help=True, help="Read a run's trace from its receiver.")

TRACE_ID_HEX = 32
BAR_WIDTH = 24
# The attributes worth a glance on one line; everything else is in the receiver's UI.
SHOWN = (
    "koda.run_id",
    "koda.attempt",
    "koda.worker_id",
    "messaging.destination.partition.id",
    "gen_ai.request.model",
    "gen_ai.response.time_to_first_token",
    "gen_ai.usage.output_tokens",
    "gen_ai.tool.name",
    "koda.chunks",
    "http.response.status_code",
    "error",
)


class TraceNotFound(KodaError):
    """The receiver did not answer, or holds no trace with that id."""


@dataclass
class Span:
    span_id: str
    name: str
    service: str
    start_us: int
    duration_us: int
    parent: str | None
    links: list[str] = field(default_factory=list)
    attributes: dict[str, Any] = field(default_factory=dict)


def is_trace_id(value: str) -> bool:
    """Whether ``value`` is a trace id (32 lower-case hex digits) rather than a run id."""
    return len(value) == TRACE_ID_HEX and all(c in "0123456789abcdef" for c in value)


def trace_id_of(traceparent: str) -> str:
    """The trace id of a W3C ``traceparent`` (``00-<trace>-<span>-<flags>``)."""
    parts = traceparent.split("-")
    if len(parts) != 4 or len(parts[1]) != TRACE_ID_HEX:
        raise ValueError(f"not a W3C traceparent: {traceparent!r}")
    return parts[1]


def fetch(query_url: str, trace_id: str, *, timeout_s: float = 10.0) -> dict[str, Any]:
    """The trace as the receiver's query API returns it."""
    import httpx

    url = f"{query_url.rstrip('/')}/api/traces/{trace_id}"
    try:
        response = httpx.get(url, timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise TraceNotFound(f"{url}: the trace receiver did not answer ({exc})") from exc
    if response.status_code == 404:
        raise TraceNotFound(f"{url}: no trace {trace_id} (not sampled, or not exported yet)")
    if response.status_code != 200:
        raise TraceNotFound(f"{url}: HTTP {response.status_code}")
    data = response.json().get("data") or []
    if not data:
        raise TraceNotFound(f"{url}: no trace {trace_id} (not sampled, or not exported yet)")
    trace: dict[str, Any] = data[0]
    return trace


def spans_of(trace: dict[str, Any]) -> list[Span]:
    """The trace's spans, parents and links resolved."""
    services = {
        pid: str(p.get("serviceName", "?")) for pid, p in (trace.get("processes") or {}).items()
    }
    spans: list[Span] = []
    for raw in trace.get("spans") or []:
        parent, links = None, []
        for ref in raw.get("references") or []:
            if ref.get("refType") == "CHILD_OF" and ref.get("traceID") == raw.get("traceID"):
                parent = ref.get("spanID")
            else:
                links.append(f"{ref.get('traceID', '')[:8]}…/{ref.get('spanID', '')}")
        spans.append(
            Span(
                span_id=str(raw.get("spanID")),
                name=str(raw.get("operationName")),
                service=services.get(raw.get("processID"), "?"),
                start_us=int(raw.get("startTime", 0)),
                duration_us=int(raw.get("duration", 0)),
                parent=parent,
                links=links,
                attributes={t.get("key"): t.get("value") for t in raw.get("tags") or []},
            )
        )
    return spans


def render(trace: dict[str, Any]) -> list[str]:
    """The trace as lines of text: a header, then one line per span in tree order."""
    spans = spans_of(trace)
    if not spans:
        return [f"trace {trace.get('traceID', '?')}: no spans"]
    ids = {s.span_id for s in spans}
    children: dict[str | None, list[Span]] = defaultdict(list)
    for s in spans:
        children[s.parent if s.parent in ids else None].append(s)
    for group in children.values():
        group.sort(key=lambda s: (s.start_us, s.name))
    t0 = min(s.start_us for s in spans)
    total = max(s.start_us + s.duration_us for s in spans) - t0 or 1
    services = sorted({s.service for s in spans})
    lines = [
        f"trace {trace.get('traceID', '?')}: {len(spans)} spans, {total / 1000:.1f} ms, "
        f"services {', '.join(services)}",
        f"{'start ms':>9} {'took ms':>9}  {'':{BAR_WIDTH}}  span",
    ]

    def walk(span: Span, depth: int) -> None:
        offset = span.start_us - t0
        lo = int(offset * BAR_WIDTH / total)
        hi = max(lo + 1, int((offset + span.duration_us) * BAR_WIDTH / total))
        bar = " " * lo + "█" * (min(hi, BAR_WIDTH) - lo)
        shown = " ".join(f"{k}={span.attributes[k]}" for k in SHOWN if k in span.attributes)
        linked = f" (linked to {', '.join(span.links)})" if span.links else ""
        lines.append(
            f"{offset / 1000:9.1f} {span.duration_us / 1000:9.1f}  {bar:{BAR_WIDTH}}  "
            f"{'  ' * depth}{span.service}: {span.name}{linked}" + (f"  [{shown}]" if shown else "")
        )
        for child in children.get(span.span_id, []):
            walk(child, depth + 1)

    for root in children[None]:
        walk(root, 0)
    return lines


def run_trace_id(engine: Engine, run_id: str) -> str:
    """The trace id recorded for a run at admission (``runs.traceparent``)."""
    from koda_runtime.schemas.runs.reads import RunNotFound, run_traceparent

    try:
        traceparent = run_traceparent(engine, run_id)
    except RunNotFound:
        raise TraceNotFound(f"no run {run_id}") from None
    if not traceparent:
        raise TraceNotFound(
            f"run {run_id} has no trace: the gateway that admitted it had tracing off "
            "and its client sent no traceparent"
        )
    return trace_id_of(traceparent)


@traces_app.command("show")
@friendly
def traces_show(
    run: str = typer.Argument(..., metavar="RUN_ID|TRACE_ID", help="A run id, or a trace id."),
    query: str | None = typer.Option(
        None,
        "--query",
        help="The receiver's query API (Jaeger's, e.g. http://jaeger:16686); default: the "
        "Jaeger of `koda services up --with-tracing`.",
    ),
) -> None:
    """Draw one run's trace (gateway, worker, model, viewers) as its receiver holds it."""
    from koda_runtime.cli.services import DEFAULT_STATE_DIR
    from koda_runtime.localstack import jaeger
    from koda_runtime.schemas.db import sync_engine

    if query is None:
        ports = jaeger.load_ports(DEFAULT_STATE_DIR.resolve())
        if ports is None:
            fail("no --query and no local Jaeger: start one with `koda services up --with-tracing`")
            return
        query = ports.url
    trace_id = run.lower()
    if not is_trace_id(trace_id):
        engine = sync_engine(load_settings(database=True))
        try:
            trace_id = run_trace_id(engine, run)
        finally:
            engine.dispose()
    for line in render(fetch(query, trace_id)):
        typer.echo(line)
