"""The one Prometheus registry of koda, and every metric family in it (docs/design.md §8).

Every process (gateway, workers, scheduler, compactor) imports its metrics from here and exposes
:data:`REGISTRY` on ``/metrics``; nothing else creates a metric. Creating the
families does no I/O; :func:`start_metrics_server` is the only function that opens a
socket. Each process's server answers with :func:`exposition`: OpenMetrics, which
carries the run-latency histograms' trace exemplars, when the scraper asks for it.

Names follow Prometheus conventions: a ``koda_`` prefix, counters end in
``_total``, durations are histograms in seconds (``_seconds``). Label values are
drawn from small fixed sets (outcomes, reasons, route templates, partitions),
never from user ids, run ids or free text.

    runs          koda_runs_total{outcome}, koda_run_duration_seconds{outcome},
                  koda_time_to_first_chunk_seconds, koda_queue_age_seconds,
                  koda_runs_in_flight, koda_retries_total, koda_dead_letters_total{reason},
                  koda_records_skipped_total{reason} (worker and gateway)
    consumer      koda_consumer_lag{topic,partition}, koda_rebalances_total{event},
                  koda_handoff_seconds
    worker        koda_event_loop_lag_seconds, koda_heartbeats_total{outcome}
    gateway       koda_admissions_total{outcome}, koda_admissions_rejected_total{reason},
                  koda_quota_refusals_total{quota} (gateway and worker),
                  koda_http_requests_total{method,route,status},
                  koda_http_request_seconds{method,route},
                  koda_publish_total{outcome}, koda_publish_seconds,
                  koda_sweeper_republished_total, koda_sse_connections,
                  koda_sse_events_total{source}, koda_sse_viewers_cut_total{reason},
                  koda_sse_backfills_total{reason}, koda_sse_queued_bytes,
                  koda_live_feed_records_total, koda_live_feed_errors_total,
                  koda_kafka_clients_rebuilt_total{client} (gateway and worker),
                  koda_workers{state}, koda_workers_expected
    model calls   koda_model_calls_total{model,outcome},
                  koda_model_time_to_first_token_seconds{model},
                  koda_model_call_seconds{model}, koda_model_breaker_open{model},
                  koda_model_tokens_total{model,direction}, koda_model_cost_usd_total{model}
                  (worker)
    ledger        koda_ledger_calls_total{outcome,estimated} (worker),
                  koda_budget_soft_alerts_total{period}, koda_budget_exhausted_users (gateway)
    run phases    koda_run_phase_seconds{phase} (worker: claim, streaming, finish)
    chunk topic   koda_chunk_runs_compacted_total, koda_chunks_republished_total{by},
                  koda_chunk_upkeep_last_pass_timestamp_seconds,
                  koda_chunk_upkeep_interval_seconds,
                  koda_chunk_upkeep_failures_total{cause} (the compactor)
    scheduler     koda_schedule_fires_total, koda_schedule_fire_conflicts_total,
                  koda_schedule_skips_total{reason}, koda_schedule_missed_total,
                  koda_schedule_fire_lag_seconds, koda_schedules_due
"""

from __future__ import annotations

from opentelemetry import trace
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
    start_http_server,
)
from prometheus_client.exposition import choose_encoder

__all__ = [
    "ADMISSIONS",
    "ADMISSION_BATCH_RUNS",
    "ADMISSIONS_REJECTED",
    "BUDGET_EXHAUSTED_USERS",
    "BUDGET_SOFT_ALERTS",
    "LEDGER_CALLS",
    "MODEL_BREAKER_OPEN",
    "MODEL_CALLS",
    "MODEL_CALL_SECONDS",
    "MODEL_COST_USD",
    "MODEL_TIME_TO_FIRST_TOKEN_SECONDS",
    "MODEL_TOKENS",
    "CONSUMER_LAG",
    "CONTENT_TYPE",
    "DEAD_LETTERS",
    "EVENT_LOOP_LAG_SECONDS",
    "HANDOFF_SECONDS",
    "HEARTBEATS",
    "HTTP_REQUESTS",
    "HTTP_REQUEST_SECONDS",
    "OFFSET_REWINDS",
    "PUBLISH",
    "QUOTA_REFUSALS",
    "PUBLISH_SECONDS",
    "QUEUE_AGE_SECONDS",
    "PARTITIONS_MOVED",
    "REBALANCES",
    "REGISTRY",
    "RECORDS_SKIPPED",
    "RETRIES",
    "RUNS",
    "RUNS_CANCEL_REQUESTS",
    "RUNS_MERGED",
    "RUNS_IN_FLIGHT",
    "RUNS_WAITING",
    "PARTITION_QUEUE_AGE_SECONDS",
    "INTAKE_PAUSED_PARTITIONS",
    "RUN_DURATION_SECONDS",
    "RUN_PHASE_SECONDS",
    "CHUNK_UPKEEP_INTERVAL_SECONDS",
    "CHUNK_UPKEEP_LAST_PASS",
    "CHUNK_UPKEEP_FAILURES",
    "SSE_BACKFILLS",
    "SSE_CONNECTIONS",
    "SSE_EVENTS",
    "SSE_QUEUED_BYTES",
    "SSE_VIEWERS_CUT",
    "LIVE_FEED_ERRORS",
    "KAFKA_CLIENTS_REBUILT",
    "LIVE_FEED_RECORDS",
    "CHUNK_RUNS_COMPACTED",
    "CHUNKS_REPUBLISHED",
    "SWEEPER_REPUBLISHED",
    "TIME_TO_FIRST_CHUNK_SECONDS",
    "WORKERS",
    "WORKERS_EXPECTED",
    "WORKER_ID_CONFLICTS",
    "WORKER_ID_TWIN_BEATS",
    "SCHEDULES_DUE",
    "SCHEDULE_FIRES",
    "SCHEDULE_FIRE_CONFLICTS",
    "SCHEDULE_FIRE_LAG_SECONDS",
    "SCHEDULE_MISSED",
    "SCHEDULE_SKIPS",
    "TracedHistogram",
    "exposition",
    "render",
    "start_metrics_server",
    "trace_exemplar",
]

REGISTRY = CollectorRegistry(auto_describe=True)
ProcessCollector(registry=REGISTRY)
PlatformCollector(registry=REGISTRY)

CONTENT_TYPE = CONTENT_TYPE_LATEST


def trace_exemplar() -> dict[str, str] | None:
    """The current OpenTelemetry span as exemplar labels (``trace_id``, ``span_id``, hex),
    or None outside a valid, sampled span (no tracing set up, or a trace not kept)."""
    context = trace.get_current_span().get_span_context()
    if not context.is_valid or not context.trace_flags.sampled:
        return None
    return {
        "trace_id": trace.format_trace_id(context.trace_id),
        "span_id": trace.format_span_id(context.span_id),
    }


class TracedHistogram(Histogram):
    """A histogram whose observations carry :func:`trace_exemplar` when there is one:
    the latency panels link a slow bucket to the trace of a run that landed in it.
    Exemplars show in the OpenMetrics format only (:func:`exposition`)."""

    def observe(self, amount: float, exemplar: dict[str, str] | None = None) -> None:
        super().observe(amount, exemplar if exemplar is not None else trace_exemplar())


# Runs take seconds to tens of seconds; queue age can reach minutes under backlog.
_RUN_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600)
_FAST_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10)

# --- runs (workers) ---------------------------------------------------------

RUNS = Counter(
    "koda_runs_total",
    "Runs that reached an outcome: done, failed, cancelled.",
    ["outcome"],
    registry=REGISTRY,
)
RUN_DURATION_SECONDS = TracedHistogram(
    "koda_run_duration_seconds",
    "Wall time from claim (started_at) to the terminal state, by outcome.",
    ["outcome"],
    buckets=_RUN_BUCKETS,
    registry=REGISTRY,
)
TIME_TO_FIRST_CHUNK_SECONDS = TracedHistogram(
    "koda_time_to_first_chunk_seconds",
    "Time from a run's creation to its first output chunk (running -> streaming).",
    buckets=_RUN_BUCKETS,
    registry=REGISTRY,
)
QUEUE_AGE_SECONDS = TracedHistogram(
    "koda_queue_age_seconds",
    "Time a run waited between creation and its claim by a worker (created -> started).",
    buckets=_RUN_BUCKETS,
    registry=REGISTRY,
)
RUN_PHASE_SECONDS = TracedHistogram(
    "koda_run_phase_seconds",
    "Time a run spends in one phase, by phase: claim (its claim's group write, from "
    "asking to the answer), streaming (a model call, from its first token to the end of "
    "its stream; per call) and finish (its finish's group write). With "
    "koda_queue_age_seconds and koda_model_time_to_first_token_seconds they make up a "
    "run's latency.",
    ["phase"],
    buckets=_FAST_BUCKETS + (20, 30, 60, 120, 300),
    registry=REGISTRY,
)
RUNS_IN_FLIGHT = Gauge(
    "koda_runs_in_flight",
    "Runs this process is executing right now.",
    registry=REGISTRY,
)
RUNS_WAITING = Gauge(
    "koda_runs_waiting",
    "Records of this worker not started yet, by what they wait for: user_order (a run of "
    "the same user is ahead), worker_full (a slot of KODA_MAX_INFLIGHT), model_cap (a "
    "model call slot of KODA_MODEL_CONCURRENCY; the run is still pending), approval (its "
    "run waits for a person, holding no slot).",
    ["reason"],
    registry=REGISTRY,
)
PARTITION_QUEUE_AGE_SECONDS = Gauge(
    "koda_partition_queue_age_seconds",
    "Age of the oldest record of a held runs partition that has not started (0: none).",
    ["partition"],
    registry=REGISTRY,
)
INTAKE_PAUSED_PARTITIONS = Gauge(
    "koda_intake_paused_partitions",
    "Runs partitions whose fetching this worker paused: their backlog reached "
    "KODA_CHAIN_HIGH_WATER, or the worker's reached KODA_MAX_BACKLOG.",
    registry=REGISTRY,
)
RETRIES = Counter(
    "koda_retries_total",
    "Attempts started again in place after a handler failure.",
    registry=REGISTRY,
)
DEAD_LETTERS = Counter(
    "koda_dead_letters_total",
    "Records written to the dead-letter topic, by reason.",
    ["reason"],
    registry=REGISTRY,
)
RECORDS_SKIPPED = Counter(
    "koda_records_skipped_total",
    "Records passed over without their work and without a dead letter, by reason: "
    "`dead_letter_refused` (worker: the broker refused even a bare dead letter of a "
    "runs-topic record) or `bad_chunk_record` (gateway: a chunk-topic record of a watched "
    "run that is not a valid chunk of it).",
    ["reason"],
    registry=REGISTRY,
)

# --- consumer group (workers) -------------------------------------------------

CONSUMER_LAG = Gauge(
    "koda_consumer_lag",
    "Records between the committed offset and the end of each held partition.",
    ["topic", "partition"],
    registry=REGISTRY,
)
REBALANCES = Counter(
    "koda_rebalances_total",
    "Partition assignment changes seen by this worker, by event: assigned or revoked.",
    ["event"],
    registry=REGISTRY,
)
OFFSET_REWINDS = Counter(
    "koda_offset_rewinds_total",
    "Times a worker found records dropped before reaching it and sought back for them.",
    registry=REGISTRY,
)
GROUP_COMMIT_RUNS = Histogram(
    "koda_group_commit_runs",
    "Runs whose chunk batches or finishes were written together in one transaction.",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
    registry=REGISTRY,
)
ADMISSION_BATCH_RUNS = Histogram(
    "koda_admission_batch_runs",
    "Requests of POST /v1/runs admitted together in one gateway transaction.",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
    registry=REGISTRY,
)
PARTITIONS_MOVED = Counter(
    "koda_partitions_moved_total",
    "Runs partitions that changed hands at a rebalance, seen by this worker, by direction:"
    " in (assigned to it) or out (revoked from it, or lost).",
    ["direction"],
    registry=REGISTRY,
)

HANDOFF_SECONDS = Histogram(
    "koda_handoff_seconds",
    "Time spent draining in-flight runs when partitions were revoked.",
    buckets=_RUN_BUCKETS,
    registry=REGISTRY,
)

# --- worker process -------------------------------------------------------------

EVENT_LOOP_LAG_SECONDS = Gauge(
    "koda_event_loop_lag_seconds",
    "How late the worker's event loop last woke a periodic probe (a blocked loop grows it).",
    registry=REGISTRY,
)
HEARTBEATS = Counter(
    "koda_heartbeats_total",
    "Heartbeats this worker produced to the workers topic, by outcome: sent or failed.",
    ["outcome"],
    registry=REGISTRY,
)

# --- gateway ------------------------------------------------------------------

ADMISSIONS = Counter(
    "koda_admissions_total",
    "POST /v1/runs accepted, by outcome: created (new run) or replayed (same key).",
    ["outcome"],
    registry=REGISTRY,
)
RUNS_MERGED = Counter(
    "koda_runs_merged_total",
    "POST /v1/runs merged into the session's running run instead of creating one.",
    registry=REGISTRY,
)
RUNS_CANCEL_REQUESTS = Counter(
    "koda_run_cancel_requests_total",
    "POST /v1/runs/{id}/cancel by outcome: cancelled (was pending), requested (running; "
    "the worker ends it), unchanged (already terminal or already requested).",
    ["outcome"],
    registry=REGISTRY,
)
ADMISSIONS_REJECTED = Counter(
    "koda_admissions_rejected_total",
    "POST /v1/runs refused before anything was written, by reason "
    "(unauthorized, rate_limited, too_large, unsupported_media_type, invalid_json, ...).",
    ["reason"],
    registry=REGISTRY,
)
QUOTA_REFUSALS = Counter(
    "koda_quota_refusals_total",
    "Work or resources refused at a per-user or per-gateway cap, by quota: schedules, "
    "streams_per_user, streams, memories (not stored), merges, merged_bytes, schedule_daily.",
    ["quota"],
    registry=REGISTRY,
)
HTTP_REQUESTS = Counter(
    "koda_http_requests_total",
    "HTTP requests answered by the gateway, by method, route template and status.",
    ["method", "route", "status"],
    registry=REGISTRY,
)
HTTP_REQUEST_SECONDS = Histogram(
    "koda_http_request_seconds",
    "Gateway request latency up to the response start, by method and route template.",
    ["method", "route"],
    buckets=_FAST_BUCKETS,
    registry=REGISTRY,
)
PUBLISH = Counter(
    "koda_publish_total",
    "Run-requested records produced by the gateway, by outcome: delivered or failed.",
    ["outcome"],
    registry=REGISTRY,
)
PUBLISH_SECONDS = Histogram(
    "koda_publish_seconds",
    "Time from produce to the broker's delivery report.",
    buckets=_FAST_BUCKETS,
    registry=REGISTRY,
)
SWEEPER_REPUBLISHED = Counter(
    "koda_sweeper_republished_total",
    "Pending runs whose first publish was lost and that the sweeper delivered again.",
    registry=REGISTRY,
)
SSE_CONNECTIONS = Gauge(
    "koda_sse_connections",
    "Server-Sent Events streams open on this gateway.",
    registry=REGISTRY,
)
SSE_EVENTS = Counter(
    "koda_sse_events_total",
    "Events written to SSE viewers, by source: replay (Postgres) or live (the chunk topic).",
    ["source"],
    registry=REGISTRY,
)
SSE_VIEWERS_CUT = Counter(
    "koda_sse_viewers_cut_total",
    "SSE viewers disconnected by the gateway, by reason: overflow (its queue filled), "
    "stalled (a write did not complete in time) or shutdown.",
    ["reason"],
    registry=REGISTRY,
)
SSE_BACKFILLS = Counter(
    "koda_sse_backfills_total",
    "Reads from Postgres while a stream is live, by reason: gap (a live seq skipped "
    "ahead) or idle (no live event for a keep-alive interval).",
    ["reason"],
    registry=REGISTRY,
)
SSE_QUEUED_BYTES = Gauge(
    "koda_sse_queued_bytes",
    "Bytes of live events waiting in SSE viewers' queues on this gateway.",
    registry=REGISTRY,
)
LIVE_FEED_RECORDS = Counter(
    "koda_live_feed_records_total",
    "Chunk-topic records read by this gateway's live feed (for any run).",
    registry=REGISTRY,
)
LIVE_FEED_ERRORS = Counter(
    "koda_live_feed_errors_total",
    "Errors the live feed's consumer reported (it keeps running and reconnects).",
    registry=REGISTRY,
)
KAFKA_CLIENTS_REBUILT = Counter(
    "koda_kafka_clients_rebuilt_total",
    "Kafka consumers closed and built again at what they had read, by client: `runs` "
    "(the worker's group member, after 30 s with no broker connection up) or a tail's "
    "role (after a fatal error, or 15 s with no broker answering).",
    ["client"],
    registry=REGISTRY,
)
WORKERS = Gauge(
    "koda_workers",
    "Workers in the heartbeat table as this gateway sees it, by state: alive or stale.",
    ["state"],
    registry=REGISTRY,
)
WORKER_ID_CONFLICTS = Gauge(
    "koda_worker_id_conflicts",
    "Worker ids that more than one live process beats under, as this gateway sees it.",
    registry=REGISTRY,
)
WORKER_ID_TWIN_BEATS = Counter(
    "koda_worker_id_twin_beats_total",
    "Beats under this worker's own id that another process sent (two workers, one id).",
    registry=REGISTRY,
)
WORKERS_EXPECTED = Gauge(
    "koda_workers_expected",
    "Workers this deployment expects to be alive (KODA_EXPECTED_WORKERS).",
    registry=REGISTRY,
)

# --- model calls (workers) ---------------------------------------------------------
# ``model`` is a configured model name (calls, times, breaker) or the name the provider
# reported for the call (tokens, cost): a handful of values per deployment.

MODEL_CALLS = Counter(
    "koda_model_calls_total",
    "Model calls (each try of a retried call counts) by outcome: ok, rate_limited, "
    "server_error, connection_error, refused (4xx, not retried), cut (the stream stopped "
    "mid-answer), cancelled.",
    ["model", "outcome"],
    registry=REGISTRY,
)
MODEL_TIME_TO_FIRST_TOKEN_SECONDS = TracedHistogram(
    "koda_model_time_to_first_token_seconds",
    "Time from sending a model call to its first streamed token.",
    ["model"],
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60),
    registry=REGISTRY,
)
MODEL_CALL_SECONDS = TracedHistogram(
    "koda_model_call_seconds",
    "Duration of one model call (one try), whatever its outcome.",
    ["model"],
    buckets=_RUN_BUCKETS,
    registry=REGISTRY,
)
MODEL_BREAKER_OPEN = Gauge(
    "koda_model_breaker_open",
    "1 while this worker's breaker for the primary model is open (calls go to "
    "KODA_FALLBACK_MODEL), else 0.",
    ["model"],
    registry=REGISTRY,
)
MODEL_TOKENS = Counter(
    "koda_model_tokens_total",
    "Tokens of billed model calls, in (prompt) and out (completion), as written to the "
    "ledger (estimated counts included).",
    ["model", "direction"],
    registry=REGISTRY,
)
MODEL_COST_USD = Counter(
    "koda_model_cost_usd_total",
    "Cost in USD of billed model calls, as priced in their ledger rows.",
    ["model"],
    registry=REGISTRY,
)

# --- cost ledger and budgets -----------------------------------------------------

LEDGER_CALLS = Counter(
    "koda_ledger_calls_total",
    "Billable calls written to the ledger, by the outcome of their attempt and whether "
    "their counts were estimated (a stream cut before the model reported usage).",
    ["outcome", "estimated"],
    registry=REGISTRY,
)
BUDGET_SOFT_ALERTS = Counter(
    "koda_budget_soft_alerts_total",
    "Users whose spend reached the soft threshold of a budget (once per user and period).",
    ["period"],
    registry=REGISTRY,
)
BUDGET_EXHAUSTED_USERS = Gauge(
    "koda_budget_exhausted_users",
    "Users with a monthly or daily budget spent now, so their new runs are refused (402); "
    "counted from Postgres at each scrape, the same figure on every gateway; NaN when "
    "Postgres could not be read.",
    registry=REGISTRY,
)

# --- chunk topic compaction -----------------------------------------------------

CHUNK_RUNS_COMPACTED = Counter(
    "koda_chunk_runs_compacted_total",
    "Terminal runs whose per-chunk records were replaced by one final record.",
    registry=REGISTRY,
)

CHUNK_UPKEEP_LAST_PASS = Gauge(
    "koda_chunk_upkeep_last_pass_timestamp_seconds",
    "Unix time the compactor (`koda chunks compact --every`) last completed a round: the "
    "completeness pass and compaction, both without error; 0 until its first.",
    registry=REGISTRY,
)
CHUNK_UPKEEP_INTERVAL_SECONDS = Gauge(
    "koda_chunk_upkeep_interval_seconds",
    "The compactor's --every: seconds it waits after a round before the next one.",
    registry=REGISTRY,
)
CHUNK_UPKEEP_FAILURES = Counter(
    "koda_chunk_upkeep_failures_total",
    "Compactor rounds that failed, by cause: postgres (the store did not answer), kafka "
    "(the broker did not take the records), other (a bug: see the log). The round is "
    "tried again; /readyz fails until one completes.",
    ["cause"],
    registry=REGISTRY,
)

# --- scheduler ------------------------------------------------------------------

SCHEDULE_FIRES = Counter(
    "koda_schedule_fires_total",
    "Scheduled minutes this scheduler turned into a run (it inserted the run).",
    registry=REGISTRY,
)
SCHEDULE_FIRE_CONFLICTS = Counter(
    "koda_schedule_fire_conflicts_total",
    "Scheduled minutes whose run already existed (another scheduler replica fired it).",
    registry=REGISTRY,
)
SCHEDULE_SKIPS = Counter(
    "koda_schedule_skips_total",
    "Scheduled minutes not run, by reason: paused, quiet_hours, overlap, daily_cap, budget.",
    ["reason"],
    registry=REGISTRY,
)
SCHEDULE_MISSED = Counter(
    "koda_schedule_missed_total",
    "Scheduled minutes older than their schedule's catch-up window when seen: never run.",
    registry=REGISTRY,
)
SCHEDULE_FIRE_LAG_SECONDS = Histogram(
    "koda_schedule_fire_lag_seconds",
    "Time from a scheduled minute to the broker's ack of its run's record.",
    buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 900),
    registry=REGISTRY,
)
SCHEDULES_DUE = Gauge(
    "koda_schedules_due",
    "Schedules due (next fire not after now) at this scheduler's last pass.",
    registry=REGISTRY,
)


CHUNKS_REPUBLISHED = Counter(
    "koda_chunks_republished_total",
    "Chunk records produced again from Postgres because the topic was not known to hold "
    "them (by: resume = a successor resuming a run, skip = a worker meeting a terminal "
    "run again, pass = the compactor's completeness pass).",
    ["by"],
    registry=REGISTRY,
)


def render() -> bytes:
    """The registry in the Prometheus text format (serve with :data:`CONTENT_TYPE`)."""
    return generate_latest(REGISTRY)


def exposition(accept: str | None) -> tuple[bytes, str]:
    """The registry and its content type in the format a scraper's ``Accept`` header asks
    for: OpenMetrics (with exemplars) when it lists ``application/openmetrics-text``,
    else the Prometheus text format."""
    encode, content_type = choose_encoder(accept or "")
    return encode(REGISTRY), content_type


def start_metrics_server(port: int, host: str = "0.0.0.0") -> None:  # noqa: S104
    """Serve :data:`REGISTRY` on ``http://host:port/metrics`` from a daemon thread.

    For a process without an HTTP server of its own (every koda role now serves
    ``/metrics`` from its own). ``port`` 0 is refused: pick a port, or skip the server.
    """
    if port <= 0:
        raise ValueError(f"metrics port must be 1..65535, got {port}")
    start_http_server(port, addr=host, registry=REGISTRY)
