"""OpenTelemetry traces: one trace per run, from the gateway through Kafka to the worker,
the model and the viewers' streams (docs/decisions/0026-tracing.md).

:func:`setup` installs the SDK from the standard variables, read by koda/settings.py
(``OTEL_EXPORTER_OTLP_ENDPOINT``, ``OTEL_SERVICE_NAME``, ``OTEL_TRACES_SAMPLER`` and
``_ARG``, ``OTEL_SDK_DISABLED``): a BatchSpanProcessor and the OTLP http/protobuf
exporter, flushed when the process exits. Without an endpoint nothing is installed,
:data:`ON` stays False and every helper here returns at once (one shared no-op context
manager, the API's invalid span): call sites check :data:`ON` or the span's
``is_recording()`` before they build attributes.

The exporter runs on the processor's own thread with a bounded queue: a receiver that
is down or slow drops spans (and logs it), never blocks or fails a run.

The trace context crosses Kafka as the W3C ``traceparent`` header of the runs record
(and of run-control records), and Postgres as ``runs.traceparent`` (migration 0017),
so the sweeper's republish and any gateway's viewers find it.
"""

from __future__ import annotations

import contextvars
import logging
import re
import time
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from types import TracebackType
from typing import TYPE_CHECKING, Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import INVALID_SPAN, Link, Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.sampling import Sampler

    from koda_runtime.settings import Settings

__all__ = [
    "HEADER",
    "INVALID_SPAN",
    "ON",
    "SAMPLERS",
    "RunSpans",
    "Span",
    "SpanKind",
    "attempt",
    "event_at",
    "failed",
    "context_from",
    "current_ids",
    "links_to",
    "run_spans",
    "sampler_for",
    "setup",
    "shutdown",
    "span",
    "start",
    "traceparent",
    "valid_traceparent",
]

log = logging.getLogger(__name__)

TRACER_NAME = "koda"
HEADER = "traceparent"
# OTEL_TRACES_SAMPLER's values (the SDK's names); parentbased_always_on is the SDK's
# default: a trace a client started sampled stays sampled, and so does a run's.
SAMPLERS = (
    "always_on",
    "always_off",
    "traceidratio",
    "parentbased_always_on",
    "parentbased_always_off",
    "parentbased_traceidratio",
)
# A W3C traceparent: version-trace_id-parent_id-flags, lower-case hex (a future
# version may append fields after a dash).
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")
# Seconds the exporter waits for the receiver per batch (and at exit).
EXPORT_TIMEOUT_S = 5.0

# True once setup() installed a provider; read it before building span attributes.
ON = False
_tracer: trace.Tracer = trace.NoOpTracer()
_provider: TracerProvider | None = None
_propagator = TraceContextTextMapPropagator()


class _Noop(AbstractContextManager[Span]):
    """The one context manager every helper returns when tracing is off (stateless)."""

    def __enter__(self) -> Span:
        return INVALID_SPAN

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        return None


_NOOP = _Noop()


def sampler_for(name: str, arg: float | None) -> Sampler:
    """The SDK sampler OTEL_TRACES_SAMPLER ``name`` names (one of :data:`SAMPLERS`),
    with ``arg`` the ratio of a ``traceidratio`` one (default 1.0)."""
    from opentelemetry.sdk.trace import sampling

    ratio = 1.0 if arg is None else arg
    samplers: dict[str, Any] = {
        "always_on": lambda: sampling.ALWAYS_ON,
        "always_off": lambda: sampling.ALWAYS_OFF,
        "traceidratio": lambda: sampling.TraceIdRatioBased(ratio),
        "parentbased_always_on": lambda: sampling.ParentBased(sampling.ALWAYS_ON),
        "parentbased_always_off": lambda: sampling.ParentBased(sampling.ALWAYS_OFF),
        "parentbased_traceidratio": lambda: sampling.ParentBased(sampling.TraceIdRatioBased(ratio)),
    }
    if name not in samplers:
        raise ValueError(f"OTEL_TRACES_SAMPLER={name!r}: use one of {', '.join(SAMPLERS)}")
    sampler: Sampler = samplers[name]()
    return sampler


def traces_endpoint(endpoint: str) -> str:
    """The OTLP/HTTP traces URL of a base ``OTEL_EXPORTER_OTLP_ENDPOINT`` (the spec's
    rule: ``/v1/traces`` appended to the base)."""
    return endpoint.rstrip("/") + "/v1/traces"


def setup(settings: Settings, role: str) -> bool:
    """Install tracing for this process (``role``: gateway, worker, scheduler) when
    ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set and ``OTEL_SDK_DISABLED`` is not; whether it
    did. Idempotent. The service name is ``OTEL_SERVICE_NAME``, else ``koda-<role>``."""
    global ON, _tracer, _provider
    if ON or not settings.otel_endpoint or settings.otel_sdk_disabled:
        return ON
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from koda_runtime import __version__

    resource = Resource.create(
        {
            "service.name": settings.otel_service_name or f"koda-{role}",
            "service.version": __version__,
            "service.namespace": settings.namespace or "koda",
            "koda.role": role,
        }
    )
    provider = TracerProvider(
        resource=resource,
        sampler=sampler_for(settings.otel_sampler, settings.otel_sampler_arg),
    )
    exporter = OTLPSpanExporter(
        endpoint=traces_endpoint(settings.otel_endpoint), timeout=EXPORT_TIMEOUT_S
    )
    provider.add_span_processor(BatchSpanProcessor(exporter))
    _provider, _tracer, ON = provider, provider.get_tracer(TRACER_NAME), True
    log.info(
        "event=tracing_on endpoint=%s service=%s sampler=%s",
        settings.otel_endpoint,
        resource.attributes.get("service.name"),
        settings.otel_sampler,
    )
    return True


def shutdown() -> None:
    """Export what is buffered (bounded by the exporter's timeout) and stop tracing.
    Also run at interpreter exit by the SDK; calling it first is harmless."""
    global ON, _tracer, _provider
    provider, _provider = _provider, None
    ON, _tracer = False, trace.NoOpTracer()
    if provider is not None:
        provider.shutdown()


# -- the W3C trace context -----------------------------------------------------------


def valid_traceparent(value: str | bytes | None) -> str | None:
    """``value`` when it is a well-formed W3C traceparent (version not ``ff``, neither id
    all zeros), else None: a client's malformed header is ignored, as the spec says."""
    if value is None:
        return None
    if isinstance(value, bytes):
        try:
            value = value.decode("ascii")
        except UnicodeDecodeError:
            return None
    value = value.strip()
    match = _TRACEPARENT.fullmatch(value)
    if match is None:
        return None
    version, trace_id, span_id, _flags, rest = match.groups()
    if version == "ff" or (version == "00" and rest):
        return None
    if trace_id == "0" * 32 or span_id == "0" * 16:
        return None
    return value


def context_from(value: str | bytes | None) -> otel_context.Context | None:
    """The trace context a traceparent names, or None when there is none (or it is bad)."""
    header = valid_traceparent(value)
    if header is None:
        return None
    return _propagator.extract({HEADER: header})


def traceparent() -> str | None:
    """The current span's context as a W3C traceparent, None when there is none. With
    tracing off, a client's context that :func:`span` carried is passed on as it came."""
    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return None
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def links_to(*values: str | bytes | None) -> list[Link]:
    """Links to the spans the traceparents name (bad or missing ones left out)."""
    links = []
    for value in values:
        ctx = context_from(value)
        if ctx is not None:
            span_context = trace.get_current_span(ctx).get_span_context()
            links.append(Link(span_context))
    return links


def current_ids() -> tuple[str, str] | None:
    """``(trace_id, span_id)`` in hex of the current recording span, else None (logs)."""
    if not ON:
        return None
    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return None
    return f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}"


# -- spans ---------------------------------------------------------------------------


def span(
    name: str,
    *,
    kind: SpanKind = SpanKind.INTERNAL,
    attributes: Mapping[str, Any] | None = None,
    parent: str | bytes | None = None,
    links: Sequence[Link] = (),
) -> AbstractContextManager[Span]:
    """A span that is current inside the ``with`` block (the no-op one when off).

    ``parent``: a traceparent to continue (else the current span's trace); an exception
    leaving the block is recorded and marks the span as an error. With tracing off, a
    valid ``parent`` is still made current (not recording), so that the records made
    inside carry a client's trace context on."""
    if not ON:
        if parent is None or (ctx := context_from(parent)) is None:
            return _NOOP
        return trace.use_span(trace.get_current_span(ctx), end_on_exit=False)
    ctx = context_from(parent) if parent is not None else None
    return _tracer.start_as_current_span(
        name, context=ctx, kind=kind, attributes=attributes, links=links
    )


def start(
    name: str,
    *,
    kind: SpanKind = SpanKind.INTERNAL,
    attributes: Mapping[str, Any] | None = None,
    parent: str | bytes | None = None,
    links: Sequence[Link] = (),
) -> Span:
    """A span that is not made current (the caller ends it): for work that spans an
    async generator's yields or a response's lifetime. The invalid span when off."""
    if not ON:
        return INVALID_SPAN
    ctx = context_from(parent) if parent is not None else None
    return _tracer.start_span(name, context=ctx, kind=kind, attributes=attributes, links=links)


def event_at(span_: Span, name: str, monotonic_at: float, **attributes: Any) -> None:
    """Add event ``name`` to ``span_`` at the wall-clock time of ``monotonic_at``."""
    if not span_.is_recording():
        return
    at_ns = time.time_ns() - int((time.monotonic() - monotonic_at) * 1e9)
    span_.add_event(name, attributes=attributes, timestamp=at_ns)


def failed(span_: Span, error: BaseException | str) -> None:
    """Mark ``span_`` as an error (with the exception recorded when there is one)."""
    if not span_.is_recording():
        return
    if isinstance(error, BaseException):
        span_.record_exception(error)
        error = f"{type(error).__name__}: {error}"
    span_.set_status(Status(StatusCode.ERROR, error[:300]))


class RunSpans:
    """The worker's spans of one run's pass: one span per attempt (each claim starts
    one), children of the trace the record's headers carry, each current while its
    attempt runs so that the claim, model calls, writes and produces nest under it.

    Used as ``with RunSpans(...)`` around the attempts, which call :func:`attempt` at
    each claim; the block's exit ends the last attempt's span.
    """

    def __init__(
        self,
        *,
        parent: str | bytes | None,
        attributes: Mapping[str, Any],
        links: Sequence[Link] = (),
    ) -> None:
        self.parent = context_from(parent)
        self.attributes = dict(attributes)
        self.links = list(links)
        self.current: Span = INVALID_SPAN
        self._token: object | None = None
        self._holder: contextvars.Token[RunSpans | None] | None = None

    def __enter__(self) -> RunSpans:
        self._holder = _RUN_SPANS.set(self)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._end(exc)
        if self._holder is not None:
            _RUN_SPANS.reset(self._holder)

    def next(self) -> Span:
        """End the previous attempt's span, start and make current the next one."""
        self._end(None)
        self.current = _tracer.start_span(
            "koda.run",
            context=self.parent,
            kind=SpanKind.CONSUMER,
            attributes=self.attributes,
            links=self.links,
        )
        self._token = otel_context.attach(trace.set_span_in_context(self.current))
        return self.current

    def _end(self, exc: BaseException | None) -> None:
        if self._token is not None:
            otel_context.detach(self._token)  # type: ignore[arg-type]
            self._token = None
        if self.current is INVALID_SPAN:
            return
        if exc is not None:
            if isinstance(exc, Exception):
                failed(self.current, exc)
            else:  # cancelled: a handoff's ceiling or a stop, not a failure of the run
                self.current.add_event("cancelled", {"exception.type": type(exc).__name__})
        self.current.end()
        self.current = INVALID_SPAN


_RUN_SPANS: contextvars.ContextVar[RunSpans | None] = contextvars.ContextVar(
    "koda_run_spans", default=None
)


def run_spans(
    *,
    parent: str | bytes | None,
    attributes: Mapping[str, Any],
    links: Sequence[Link] = (),
) -> AbstractContextManager[Any]:
    """:class:`RunSpans` when tracing is on, the no-op context manager when off."""
    if not ON:
        return _NOOP
    return RunSpans(parent=parent, attributes=attributes, links=links)


def attempt() -> Span:
    """The next attempt's span of the run this task executes (see :class:`RunSpans`);
    the invalid span when tracing is off or no run's spans are open here."""
    if not ON:
        return INVALID_SPAN
    spans = _RUN_SPANS.get()
    return INVALID_SPAN if spans is None else spans.next()
