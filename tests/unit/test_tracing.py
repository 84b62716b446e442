"""koda/tracing.py and the trace ids in koda/logs.py, without a receiver: the W3C header
rules, the sampler names, the no-op path when tracing is off, the attempt spans of a
run, and both log formats. Spans go to the SDK's in-memory exporter."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import INVALID_SPAN, StatusCode

from koda_runtime import logs, stackenv, tracing
from koda_runtime.localstack import jaeger
from koda_runtime.naming import AppEnv
from koda_runtime.settings import Settings

TRACE = "0af7651916cd43dd8448eb211c80319c"
SPAN = "b7ad6b7169203331"
HEADER = f"00-{TRACE}-{SPAN}-01"


@pytest.fixture
def spans(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    """Tracing on, into memory; off again after the test."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "ON", True)
    monkeypatch.setattr(tracing, "_tracer", provider.get_tracer("test"))
    yield exporter
    provider.shutdown()


def finished(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name == name]


# -- the W3C header ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "valid"),
    [
        (HEADER, True),
        (HEADER.encode(), True),
        (f" {HEADER} ", True),  # spaces around it are dropped
        (f"01-{TRACE}-{SPAN}-01-extra", True),  # a later version may add fields
        (f"00-{TRACE}-{SPAN}-01-extra", False),  # version 00 has exactly four
        (f"ff-{TRACE}-{SPAN}-01", False),  # version ff is invalid
        (f"00-{'0' * 32}-{SPAN}-01", False),
        (f"00-{TRACE}-{'0' * 16}-01", False),
        (HEADER.upper(), False),  # lower-case hex only
        (f"00-{TRACE[:-1]}-{SPAN}-01", False),
        ("", False),
        (None, False),
        (b"\xff\xfe", False),
    ],
)
def test_a_traceparent_is_taken_only_when_well_formed(
    value: str | bytes | None, valid: bool
) -> None:
    assert (tracing.valid_traceparent(value) is not None) is valid
    assert (tracing.context_from(value) is not None) is valid


def test_the_sampler_names_are_the_sdks() -> None:
    for name in tracing.SAMPLERS:
        assert tracing.sampler_for(name, None) is not None
    assert "0.25" in tracing.sampler_for("traceidratio", 0.25).get_description()
    assert "0.25" in tracing.sampler_for("parentbased_traceidratio", 0.25).get_description()
    with pytest.raises(ValueError, match="OTEL_TRACES_SAMPLER='sometimes'.*always_on"):
        tracing.sampler_for("sometimes", None)
    settings_choices = Settings.__dataclass_fields__["otel_sampler"].metadata["koda.knob"]
    assert settings_choices.choices == tracing.SAMPLERS


def test_the_traces_url_is_the_endpoint_plus_the_signal_path() -> None:
    assert tracing.traces_endpoint("http://127.0.0.1:4318") == "http://127.0.0.1:4318/v1/traces"
    assert tracing.traces_endpoint("http://c:4318/") == "http://c:4318/v1/traces"


# -- off -----------------------------------------------------------------------------


def test_setup_installs_nothing_without_an_endpoint_or_when_disabled() -> None:
    assert tracing.ON is False
    bare = Settings(app_env=AppEnv.DEV)
    assert tracing.setup(bare, "worker") is False
    disabled = Settings.from_env(
        {
            "APP_ENV": "dev",
            "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318",
            "OTEL_SDK_DISABLED": "true",
        }
    )
    assert tracing.setup(disabled, "worker") is False
    assert tracing.ON is False


def test_off_every_helper_is_the_no_op() -> None:
    assert tracing.ON is False
    with tracing.span("x", attributes={"a": 1}) as span:
        assert span is INVALID_SPAN
        assert tracing.traceparent() is None
        assert tracing.current_ids() is None
    assert tracing.span("x") is tracing.span("y")  # one shared object, nothing made
    assert tracing.start("x") is INVALID_SPAN
    assert tracing.attempt() is INVALID_SPAN
    with tracing.run_spans(parent=HEADER, attributes={}):
        assert tracing.attempt() is INVALID_SPAN


def test_off_a_clients_traceparent_is_passed_on_unchanged_and_a_bad_one_dropped() -> None:
    with tracing.span("POST /v1/runs", parent=HEADER):
        assert tracing.traceparent() == HEADER
    assert tracing.traceparent() is None
    with tracing.span("POST /v1/runs", parent="00-garbage"):
        assert tracing.traceparent() is None


# -- on ------------------------------------------------------------------------------


def test_a_span_continues_the_parent_it_is_given_and_names_itself_in_the_header(
    spans: InMemorySpanExporter,
) -> None:
    with tracing.span("request", parent=HEADER) as span:
        ctx = span.get_span_context()
        assert tracing.traceparent() == f"00-{TRACE}-{ctx.span_id:016x}-01"
        assert tracing.current_ids() == (TRACE, f"{ctx.span_id:016x}")
        with tracing.span("child"):
            pass
    (request,) = finished(spans, "request")
    (child,) = finished(spans, "child")
    assert request.parent is not None and f"{request.parent.span_id:016x}" == SPAN
    assert child.parent is not None and child.parent.span_id == request.context.span_id


def test_each_attempt_is_a_run_span_of_the_records_trace(spans: InMemorySpanExporter) -> None:
    with tracing.run_spans(parent=HEADER, attributes={"koda.run_id": "r1"}):
        for attempt in (1, 2):
            span = tracing.attempt()
            span.set_attribute("koda.attempt", attempt)
            with tracing.span("koda.claim"):
                pass
    assert tracing.traceparent() is None  # nothing left current after the block
    runs = finished(spans, "koda.run")
    claims = finished(spans, "koda.claim")
    assert [r.attributes["koda.attempt"] for r in runs] == [1, 2]  # type: ignore[index]
    for run, claim in zip(runs, claims, strict=True):
        assert run.parent is not None and f"{run.parent.span_id:016x}" == SPAN
        assert f"{run.context.trace_id:032x}" == TRACE
        assert run.attributes is not None and run.attributes["koda.run_id"] == "r1"
        assert claim.parent is not None and claim.parent.span_id == run.context.span_id


def test_a_failed_attempt_is_an_error_and_a_cancelled_one_is_not(
    spans: InMemorySpanExporter,
) -> None:
    with pytest.raises(RuntimeError):
        with tracing.run_spans(parent=None, attributes={}):
            tracing.attempt()
            raise RuntimeError("database gone")
    with pytest.raises(asyncio.CancelledError):
        with tracing.run_spans(parent=None, attributes={}):
            tracing.attempt()
            raise asyncio.CancelledError
    failed, cancelled = finished(spans, "koda.run")
    assert failed.status.status_code is StatusCode.ERROR
    assert "database gone" in (failed.status.description or "")
    assert cancelled.status.status_code is StatusCode.UNSET
    assert [e.name for e in cancelled.events] == ["cancelled"]


def test_a_predecessor_run_is_linked_not_parented(spans: InMemorySpanExporter) -> None:
    links = tracing.links_to(HEADER, None, "bad")
    assert len(links) == 1
    with tracing.run_spans(parent=None, attributes={}, links=links):
        tracing.attempt()
    (run,) = finished(spans, "koda.run")
    assert run.parent is None
    assert [f"{link.context.trace_id:032x}" for link in run.links] == [TRACE]


def test_a_span_not_made_current_leaves_the_context_alone(
    spans: InMemorySpanExporter,
) -> None:
    span = tracing.start("chat m", parent=HEADER)
    assert tracing.traceparent() is None
    tracing.event_at(span, "first_token", 0.0)
    tracing.failed(span, "rate_limited: 429")
    span.end()
    (chat,) = finished(spans, "chat m")
    assert [e.name for e in chat.events] == ["first_token"]
    assert chat.status.status_code is StatusCode.ERROR


def test_setup_with_an_endpoint_installs_the_exporter_and_shutdown_removes_it() -> None:
    settings = Settings.from_env(
        {"APP_ENV": "dev", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"}
    )
    try:
        assert tracing.setup(settings, "worker") is True
        assert tracing.ON is True
        assert tracing._provider is not None
        assert tracing._provider.resource.attributes["service.name"] == "koda-worker"
        assert tracing.setup(settings, "gateway") is True  # idempotent: the first stays
        assert tracing._provider.resource.attributes["service.name"] == "koda-worker"
    finally:
        tracing.shutdown()
    assert tracing.ON is False


# -- logs ----------------------------------------------------------------------------


def _record(msg: str) -> logging.LogRecord:
    record = logging.LogRecord("koda.worker", logging.INFO, __file__, 1, msg, None, None)
    logs.TraceIds().filter(record)
    return record


def test_log_lines_carry_the_trace_in_both_formats(spans: InMemorySpanExporter) -> None:
    outside = _record("event=idle")
    with tracing.span("run") as span:
        inside = _record("event=run_start run_id=r1")
        span_id = f"{span.get_span_context().span_id:016x}"
        trace_id = f"{span.get_span_context().trace_id:032x}"
    text = logs.formatter_for("text")
    assert text.format(inside).endswith(
        f"msg=event=run_start run_id=r1 trace_id={trace_id} span_id={span_id}"
    )
    assert "trace_id" not in text.format(outside)
    line = json.loads(logs.formatter_for("json").format(inside))
    assert line["msg"] == "event=run_start run_id=r1"
    assert (line["trace_id"], line["span_id"]) == (trace_id, span_id)
    assert line["level"] == "INFO" and line["logger"] == "koda.worker"
    assert "trace_id" not in json.loads(logs.formatter_for("json").format(outside))


def test_a_json_line_is_one_line_with_its_traceback() -> None:
    try:
        raise ValueError("bad\nvalue")
    except ValueError:
        import sys

        record = logging.LogRecord(
            "koda", logging.ERROR, __file__, 1, "event=x", None, sys.exc_info()
        )
    out = logs.formatter_for("json").format(record)
    assert "\n" not in out
    assert "ValueError: bad" in json.loads(out)["exc"]


def test_an_unknown_log_format_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="KODA_LOG_FORMAT='xml'"):
        logs.formatter_for("xml")
    with pytest.raises(Exception, match="KODA_LOG_FORMAT"):
        Settings.from_env({"APP_ENV": "dev", "KODA_LOG_FORMAT": "xml"})


# -- the local Jaeger's config ---------------------------------------------------------


def test_jaegers_config_listens_only_on_the_chosen_loopback_ports() -> None:
    ports = jaeger.Ports(otlp=14318, ui=16687, query_grpc=16688, metrics=18888)
    config = json.loads(jaeger.render_config(ports))
    assert config["receivers"]["otlp"]["protocols"] == {"http": {"endpoint": "127.0.0.1:14318"}}
    query = config["extensions"]["jaeger_query"]
    assert (query["http"]["endpoint"], query["grpc"]["endpoint"]) == (
        "127.0.0.1:16687",
        "127.0.0.1:16688",
    )
    reader = config["service"]["telemetry"]["metrics"]["readers"][0]
    assert reader["pull"]["exporter"]["prometheus"] == {"host": "127.0.0.1", "port": 18888}
    assert ports.endpoint == "http://127.0.0.1:14318"
    assert jaeger.binary_path().name == "jaeger"
    assert jaeger.JAEGER_VERSION in str(jaeger.binary_path())


def test_services_env_names_the_local_jaeger_only_while_it_runs(tmp_path: Path) -> None:
    assert jaeger.env_lines(tmp_path) == []  # never started here
    paths = jaeger.JaegerPaths.of(tmp_path)
    paths.root.mkdir()
    ports = jaeger.Ports(otlp=14318, ui=16687, query_grpc=16688, metrics=18888)
    paths.service.write_text(json.dumps(ports.__dict__))
    assert jaeger.load_ports(tmp_path) == ports
    assert jaeger.env_lines(tmp_path) == []  # ports chosen, but no process runs
    # The line it writes when one runs is one the settings read back from the file.
    env = tmp_path / "services.env"
    env.write_text(f"OTEL_EXPORTER_OTLP_ENDPOINT={ports.endpoint}\n")
    assert stackenv.parse(env) == {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:14318"}
    state = tmp_path / "state"
    state.mkdir()
    (state / "services.env").write_text(
        f"KODA_KAFKA_BOOTSTRAP=127.0.0.1:1\nOTEL_EXPORTER_OTLP_ENDPOINT={ports.endpoint}\n"
    )
    settings = Settings.from_env({"KODA_STATE_DIR": str(state)}, cwd=tmp_path)
    assert settings.otel_endpoint == ports.endpoint
    with_env = Settings.from_env(
        {"KODA_STATE_DIR": str(state), "OTEL_EXPORTER_OTLP_ENDPOINT": "http://other:4318"},
        cwd=tmp_path,
    )
    assert with_env.otel_endpoint == "http://other:4318"  # the environment wins


def test_services_up_offers_tracing() -> None:
    from typer.testing import CliRunner

    from koda_runtime.cli.services import services_app

    out = CliRunner().invoke(services_app, ["up", "--help"], env={"COLUMNS": "200"})
    assert "--with-tracing" in out.output


# -- the bench's comparison (tests/bench/tracing_cost.py) ---------------------------------


def test_the_tracing_bench_pairs_each_repetitions_trials(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse
    import os

    from tests.bench import tracing_cost

    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    with tracing_cost.otel("http://127.0.0.1:4318"):
        assert os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://127.0.0.1:4318"
        assert "OTEL_SDK_DISABLED" not in os.environ  # "on" is really on
    with tracing_cost.otel(None):
        assert "OTEL_EXPORTER_OTLP_ENDPOINT" not in os.environ
    assert os.environ["OTEL_SDK_DISABLED"] == "true"  # restored
    assert "OTEL_EXPORTER_OTLP_ENDPOINT" not in os.environ

    ap = argparse.ArgumentParser()
    tracing_cost.add_args(ap, prefix="")
    args = ap.parse_args([])
    args.repeat = 2
    w1 = {"runs/s": {"off": [100.0, 80.0], "on": [90.0, 80.0]}}
    w2 = {"yield->viewer p99 ms": {"off": [50.0, 40.0], "on": [60.0, 40.0]}}
    table = tracing_cost.tracing_table(w1, w2, args)
    assert table.figures["tracing_w1_runs_ratio"] == [0.9, 1.0]
    assert table.figures["tracing_w2_p99_ratio"] == [1.2, 1.0]
    rendered = table.render()
    assert "0.950 [0.900-1.000]" in rendered  # the runs/s ratio, median [min-max]
    assert "W2" in rendered and "on / off" in rendered
