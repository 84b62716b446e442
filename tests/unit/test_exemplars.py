"""The run-latency histograms carry the current trace as an exemplar, and /metrics serves
it in OpenMetrics when the scraper asks (the Prometheus text format has no exemplars).

Pure: the spans are OpenTelemetry API objects made here (no SDK, no exporter), the
histograms live on a registry of their own except where koda's families are checked.
"""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Iterator

import pytest
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags
from prometheus_client import CollectorRegistry
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest

from koda_runtime import metrics
from koda_runtime.naming import AppEnv
from koda_runtime.processors.compactor import ChunkCompactor, serve_health
from koda_runtime.settings import Settings

TRACE_ID = 0x4BF92F3577B34DA6A3CE929D0E0E4736
SPAN_ID = 0x00F067AA0BA902B7
OPENMETRICS = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"


def span(flags: int = TraceFlags.SAMPLED, trace_id: int = TRACE_ID) -> NonRecordingSpan:
    context = SpanContext(trace_id, SPAN_ID, is_remote=False, trace_flags=TraceFlags(flags))
    return NonRecordingSpan(context)


@pytest.fixture
def histogram() -> metrics.TracedHistogram:
    return metrics.TracedHistogram(
        "koda_test_latency_seconds",
        "A run-latency histogram of this test.",
        ["outcome"],
        buckets=(1, 60, 120),
        registry=None,  # each check registers it on a registry of its own
    )


def exemplars(h: metrics.TracedHistogram) -> list[str]:
    """The OpenMetrics sample lines of ``h`` that carry an exemplar."""
    text = openmetrics_latest(h_registry(h)).decode()
    return [line for line in text.splitlines() if " # {" in line]


def h_registry(h: metrics.TracedHistogram) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(h)
    return registry


def test_an_observation_inside_a_sampled_span_carries_its_trace_id(
    histogram: metrics.TracedHistogram,
) -> None:
    with trace.use_span(span(), end_on_exit=False):
        histogram.labels(outcome="done").observe(75.0)
    (line,) = exemplars(histogram)
    assert line.startswith('koda_test_latency_seconds_bucket{le="120.0",outcome="done"} 1.0 # {')
    assert f'trace_id="{TRACE_ID:032x}"' in line and f'span_id="{SPAN_ID:016x}"' in line
    assert re.search(r"\} 75\.0 \d", line), line  # the observed value, then its time


def test_no_exemplar_outside_a_span_or_for_a_trace_that_is_not_kept(
    histogram: metrics.TracedHistogram,
) -> None:
    assert metrics.trace_exemplar() is None  # no span: the invalid default context
    histogram.labels(outcome="done").observe(0.5)
    with trace.use_span(span(flags=TraceFlags.DEFAULT), end_on_exit=False):
        assert metrics.trace_exemplar() is None  # valid but not sampled: no trace to open
        histogram.labels(outcome="done").observe(0.5)
    with trace.use_span(span(trace_id=0), end_on_exit=False):  # an invalid context
        assert metrics.trace_exemplar() is None
        histogram.labels(outcome="done").observe(0.5)
    assert exemplars(histogram) == []
    value = h_registry(histogram).get_sample_value(
        "koda_test_latency_seconds_count", {"outcome": "done"}
    )
    assert value == 3  # observed all the same


def test_the_run_latency_families_are_traced() -> None:
    for family in (
        metrics.RUN_DURATION_SECONDS,
        metrics.TIME_TO_FIRST_CHUNK_SECONDS,
        metrics.QUEUE_AGE_SECONDS,
        metrics.RUN_PHASE_SECONDS,
        metrics.MODEL_TIME_TO_FIRST_TOKEN_SECONDS,
        metrics.MODEL_CALL_SECONDS,
    ):
        assert isinstance(family, metrics.TracedHistogram), family


def test_exposition_answers_the_format_the_scraper_asks_for() -> None:
    body, content_type = metrics.exposition(OPENMETRICS)
    assert content_type.startswith("application/openmetrics-text")
    assert body.rstrip().endswith(b"# EOF")
    for accept in (None, "", "text/plain;version=0.0.4", "*/*"):
        body, content_type = metrics.exposition(accept)
        assert content_type.startswith("text/plain"), accept
        assert b"# EOF" not in body


@pytest.fixture
def compactor_url() -> Iterator[str]:
    settings = Settings(app_env=AppEnv.DEV, namespace="unit")
    compactor = ChunkCompactor(settings, engine=object(), producer=object())  # type: ignore[arg-type]
    server = serve_health(compactor, 0, "127.0.0.1")
    try:
        yield f"http://127.0.0.1:{server.server_port}/metrics"
    finally:
        server.shutdown()
        server.server_close()


def test_the_compactor_serves_openmetrics_when_asked(compactor_url: str) -> None:
    request = urllib.request.Request(compactor_url, headers={"Accept": OPENMETRICS})
    with urllib.request.urlopen(request, timeout=5) as response:  # noqa: S310 - our server
        assert response.headers["Content-Type"].startswith("application/openmetrics-text")
        assert response.read().rstrip().endswith(b"# EOF")
    with urllib.request.urlopen(compactor_url, timeout=5) as response:  # noqa: S310
        assert response.headers["Content-Type"].startswith("text/plain")
