"""SQLAlchemy table definitions of docs/design.md §3 (Postgres is the source of truth).

Tables are declared without a schema: every connection sets ``search_path`` to the
schema named by :meth:`koda_runtime.naming.Names.pg_schema`, so dev, prod and test
namespaces never share rows.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    DateTime,
    ForeignKey,
    Identity,
    Index,
    Integer,
    MetaData,
    Numeric,
    PrimaryKeyConstraint,
    Table,
    Text,
    UniqueConstraint,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB

from koda_runtime.lifecycle.states import RunStatus

metadata = MetaData()

STATUS_VALUES = ", ".join(f"'{s.value}'" for s in RunStatus)

sessions = Table(
    "sessions",
    metadata,
    Column("id", Text, primary_key=True),
    Column("user_id", Text, nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Index("ix_sessions_user_id", "user_id"),
)

runs = Table(
    "runs",
    metadata,
    Column("id", Text, primary_key=True),
    Column("session_id", Text, ForeignKey("sessions.id"), nullable=False),
    Column("user_id", Text, nullable=False),
    Column("idempotency_key", Text, nullable=False),
    Column("status", Text, nullable=False, server_default=text("'pending'")),
    Column("input", JSONB, nullable=False),
    Column("metadata", JSONB, nullable=True),
    Column("attempt", Integer, nullable=False, server_default=text("0")),
    # Handler failures so far (0003); NULL reads as 0. ``attempt`` counts claims.
    Column("failures", Integer, nullable=True),
    Column("fence", BigInteger, nullable=False, server_default=text("0")),
    Column("worker_id", Text, nullable=True),
    Column("partition", Integer, nullable=True),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("published_at", DateTime(timezone=True), nullable=True),
    Column("started_at", DateTime(timezone=True), nullable=True),
    Column("first_chunk_at", DateTime(timezone=True), nullable=True),
    Column("finished_at", DateTime(timezone=True), nullable=True),
    Column("error", Text, nullable=True),
    # Set once the run's chunk-topic records were replaced by one final record (0002).
    Column("compacted_at", DateTime(timezone=True), nullable=True),
    # The terminal seq, once every message 0..it is acknowledged on the chunk topic (0006).
    Column("published_seq", Integer, nullable=True),
    # Run control (0004): a durable cancel request, and the version merges bump
    # (NULL reads as 0).
    Column("cancel_requested_at", DateTime(timezone=True), nullable=True),
    Column("cancel_reason", Text, nullable=True),
    Column("input_version", Integer, nullable=True),
    # The schedule and the scheduled UTC minute a run was fired for (0005); NULL when a
    # person submitted it.
    Column("schedule_id", Text, nullable=True),
    Column("scheduled_for", DateTime(timezone=True), nullable=True),
    # Retention (0012): when the chunk rows were collapsed into the run's output, the
    # seq of the row holding it, and the seq through which rows are still to go.
    Column("chunks_expired_at", DateTime(timezone=True), nullable=True),
    Column("output_seq", Integer, nullable=True),
    Column("expire_through", Integer, nullable=True),
    # The run's W3C trace context (0017); NULL when it was not traced.
    Column("traceparent", Text, nullable=True),
    # Who created it (0014): user:<id> or service:<name>; NULL reads as user:<user_id>.
    Column("created_by", Text, nullable=True),
    UniqueConstraint("idempotency_key", name="uq_runs_idempotency_key"),
    CheckConstraint(f"status IN ({STATUS_VALUES})", name="ck_runs_status"),
    Index("ix_runs_user_id_created_at", "user_id", "created_at"),
    Index("ix_runs_session_id_created_at", "session_id", "created_at"),
    Index(
        "ix_runs_pending_created_at",
        "created_at",
        postgresql_where=text("status = 'pending'"),
    ),
    Index(
        "ix_runs_uncompacted_finished_at",
        "finished_at",
        postgresql_where=text("compacted_at IS NULL AND finished_at IS NOT NULL"),
    ),
    Index(
        "ix_runs_unpublished_finished_at",
        "finished_at",
        postgresql_where=text(
            "published_seq IS NULL AND compacted_at IS NULL AND finished_at IS NOT NULL"
        ),
    ),
    # The scheduler's reads: a schedule's latest run (overlap), a user's scheduled runs
    # of a day (daily cap).
    Index(
        "ix_runs_schedule_scheduled_for",
        "schedule_id",
        "scheduled_for",
        postgresql_where=text("schedule_id IS NOT NULL"),
    ),
    Index(
        "ix_runs_user_scheduled_for",
        "user_id",
        "scheduled_for",
        postgresql_where=text("schedule_id IS NOT NULL"),
    ),
    # Admission's count of a user's runs not yet ended, the cap on active runs (0010).
    Index(
        "ix_runs_open_user_id",
        "user_id",
        postgresql_where=text("status IN ('pending', 'running', 'streaming', 'waiting')"),
    ),
    # The retention sweep's scans (0012).
    Index(
        "ix_runs_unexpired_finished_at",
        "finished_at",
        postgresql_where=text("chunks_expired_at IS NULL AND finished_at IS NOT NULL"),
    ),
    Index("ix_runs_finished_at", "finished_at", postgresql_where=text("finished_at IS NOT NULL")),
    Index("ix_runs_expiring", "id", postgresql_where=text("expire_through IS NOT NULL")),
)

# One row per message merged into a running run (0004), keyed like a run.
run_merges = Table(
    "run_merges",
    metadata,
    Column("idempotency_key", Text, primary_key=True),
    Column("run_id", Text, ForeignKey("runs.id"), nullable=False),
    Column("user_id", Text, nullable=False),
    Column("input_version", Integer, nullable=False),
    Column("input", JSONB, nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Index("ix_run_merges_run_id", "run_id"),
)

messages = Table(
    "messages",
    metadata,
    Column("run_id", Text, ForeignKey("runs.id"), nullable=False),
    Column("seq", Integer, nullable=False),
    Column("kind", Text, nullable=False),
    Column("content", Text, nullable=False),
    Column("attempt", Integer, nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    PrimaryKeyConstraint("run_id", "seq", name="pk_messages"),
    CheckConstraint("seq >= 0", name="ck_messages_seq"),
)

usage = Table(
    "usage",
    metadata,
    Column("run_id", Text, ForeignKey("runs.id"), nullable=False),
    Column("call_index", Integer, nullable=False),
    Column("model", Text, nullable=False),
    Column("prompt_tokens", Integer, nullable=False),
    Column("completion_tokens", Integer, nullable=False),
    Column("cost_usd", Numeric(18, 8), nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    PrimaryKeyConstraint("run_id", "call_index", name="pk_usage"),
)

prices = Table(
    "prices",
    metadata,
    Column("model", Text, nullable=False),
    Column("effective_from", DateTime(timezone=True), nullable=False),
    Column("prompt_usd_per_mtok", Numeric(18, 8), nullable=False),
    Column("completion_usd_per_mtok", Numeric(18, 8), nullable=False),
    # The id a ledger row names (0008); an identity, so inserts without it get one.
    Column("id", BigInteger, Identity(), nullable=False),
    # Cached input and reasoning tokens (0011); NULL: the prompt or completion price.
    Column("cached_prompt_usd_per_mtok", Numeric(18, 8), nullable=True),
    Column("reasoning_usd_per_mtok", Numeric(18, 8), nullable=True),
    CheckConstraint(
        "prompt_usd_per_mtok >= 0 AND completion_usd_per_mtok >= 0"
        " AND coalesce(cached_prompt_usd_per_mtok, 0) >= 0"
        " AND coalesce(reasoning_usd_per_mtok, 0) >= 0",
        name="ck_prices_not_negative",
    ),
    PrimaryKeyConstraint("model", "effective_from", name="pk_prices"),
    UniqueConstraint("id", name="uq_prices_id"),
)

# The cost ledger (0008): one row per billable call of every attempt.
ledger = Table(
    "ledger",
    metadata,
    Column("id", BigInteger, Identity(), primary_key=True),
    Column("user_id", Text, nullable=False),
    # NULL: system work. No foreign key (0013): the rows outlive an erased user's runs.
    Column("run_id", Text, nullable=True),
    Column("attempt", Integer, nullable=False),
    Column("call_index", Integer, nullable=False),
    Column("model", Text, nullable=False),
    Column("kind", Text, nullable=False),
    Column("prompt_tokens", Integer, nullable=False),
    Column("completion_tokens", Integer, nullable=False),
    Column("cost_usd", Numeric(18, 8), nullable=False),
    Column("price_id", BigInteger, ForeignKey("prices.id"), nullable=True),  # NULL: unpriced
    Column("outcome", Text, nullable=False),
    Column("estimated", Boolean, nullable=False, server_default=text("false")),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    # The parts of prompt_tokens served from the provider's cache and of completion_tokens
    # spent on reasoning (0011), priced apart.
    Column("cached_tokens", Integer, nullable=False, server_default=text("0")),
    Column("reasoning_tokens", Integer, nullable=False, server_default=text("0")),
    UniqueConstraint("run_id", "attempt", "call_index", name="uq_ledger_call"),
    CheckConstraint("kind IN ('chat', 'embedding')", name="ck_ledger_kind"),
    CheckConstraint("outcome IN ('ok', 'failed', 'cancelled')", name="ck_ledger_outcome"),
    CheckConstraint(
        "prompt_tokens >= 0 AND completion_tokens >= 0 AND attempt >= 0 AND call_index >= 0",
        name="ck_ledger_counts",
    ),
    CheckConstraint(
        "cached_tokens BETWEEN 0 AND prompt_tokens"
        " AND reasoning_tokens BETWEEN 0 AND completion_tokens",
        name="ck_ledger_token_parts",
    ),
    Index("ix_ledger_created_at", "created_at", postgresql_using="brin"),
    Index("ix_ledger_user_id_created_at", "user_id", "created_at"),
)

budgets = Table(
    "budgets",
    metadata,
    Column("user_id", Text, primary_key=True),
    Column("monthly_usd", Numeric(18, 8), nullable=True),
    Column("daily_usd", Numeric(18, 8), nullable=True),
    Column("soft_ratio", Numeric(4, 3), nullable=False, server_default=text("0.8")),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    CheckConstraint(
        "(monthly_usd IS NULL OR monthly_usd >= 0) AND (daily_usd IS NULL OR daily_usd >= 0)",
        name="ck_budgets_amounts",
    ),
    CheckConstraint("soft_ratio > 0 AND soft_ratio <= 1", name="ck_budgets_soft_ratio"),
)

# Month-to-date and day-to-date spend per user (UTC calendar periods), kept by the
# ledger writes themselves: there is no reset job, a new period is a new row.
spend_periods = Table(
    "spend_periods",
    metadata,
    Column("user_id", Text, nullable=False),
    Column("period", Text, nullable=False),
    Column("starts_at", DateTime(timezone=True), nullable=False),
    Column("spend_usd", Numeric(18, 8), nullable=False),
    Column("calls", BigInteger, nullable=False),
    Column("soft_alerted_at", DateTime(timezone=True), nullable=True),
    PrimaryKeyConstraint("user_id", "period", "starts_at", name="pk_spend_periods"),
    CheckConstraint("period IN ('month', 'day')", name="ck_spend_periods_period"),
)

# Fencing: one row per (runs topic, partition); the epoch grows on every assignment.
partition_epochs = Table(
    "partition_epochs",
    metadata,
    Column("topic", Text, nullable=False),
    Column("partition", Integer, nullable=False),
    Column("epoch", BigInteger, nullable=False),
    Column("worker_id", Text, nullable=False),
    Column("assigned_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    PrimaryKeyConstraint("topic", "partition", name="pk_partition_epochs"),
)

OVERLAP_VALUES = "'skip', 'allow'"

# Scheduled runs (0005): a cron on a time zone's wall clock, fired by `koda scheduler`.
# Quiet hours are minutes of the local day, [quiet_start, quiet_end), crossing midnight
# when start > end. ``session_id`` NULL: a new session per fire.
schedules = Table(
    "schedules",
    metadata,
    Column("id", Text, primary_key=True),
    Column("user_id", Text, nullable=False),
    Column("session_id", Text, ForeignKey("sessions.id"), nullable=True),
    Column("cron", Text, nullable=False),
    Column("timezone", Text, nullable=False),
    Column("input", JSONB, nullable=False),
    Column("enabled", Boolean, nullable=False, server_default=text("true")),
    Column("quiet_start", Integer, nullable=True),
    Column("quiet_end", Integer, nullable=True),
    Column("daily_cap", Integer, nullable=False, server_default=text("1440")),
    Column("overlap", Text, nullable=False, server_default=text("'skip'")),
    Column("catchup_s", Integer, nullable=False, server_default=text("900")),
    Column("next_fire_at", DateTime(timezone=True), nullable=True),
    Column("last_fire_at", DateTime(timezone=True), nullable=True),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    # The schedule's own webhook (0015): its runs go there alone; NULL: the owner's.
    Column(
        "webhook_id",
        Text,
        ForeignKey("webhooks.id", ondelete="SET NULL", name="fk_schedules_webhook_id"),
        nullable=True,
    ),
    CheckConstraint(f"overlap IN ({OVERLAP_VALUES})", name="ck_schedules_overlap"),
    CheckConstraint("daily_cap >= 1", name="ck_schedules_daily_cap"),
    CheckConstraint("catchup_s >= 0", name="ck_schedules_catchup_s"),
    CheckConstraint(
        "(quiet_start IS NULL) = (quiet_end IS NULL)"
        " AND (quiet_start IS NULL OR (quiet_start BETWEEN 0 AND 1439"
        " AND quiet_end BETWEEN 0 AND 1439 AND quiet_start <> quiet_end))",
        name="ck_schedules_quiet_hours",
    ),
    Index("ix_schedules_user_id_created_at", "user_id", "created_at"),
    Index(
        "ix_schedules_next_fire_at",
        "next_fire_at",
        postgresql_where=text("next_fire_at IS NOT NULL"),
    ),
)

# Per-user erasure receipts (0013): the user only as the SHA-256 hex of the id
# (schemas/erasures.py); completed_at NULL: the deletions began and did not finish.
erasures = Table(
    "erasures",
    metadata,
    Column("id", Text, primary_key=True),
    Column("user_digest", Text, nullable=False),
    Column("pseudonym", Text, nullable=False),
    Column("requested_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("completed_at", DateTime(timezone=True), nullable=True),
    Column("counts", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    Column("requested_by", Text, nullable=False),
    CheckConstraint("user_digest ~ '^[0-9a-f]{64}$'", name="ck_erasures_user_digest"),
    Index("ix_erasures_user_digest", "user_digest"),
)

# Webhooks (0015): a user's endpoints, one delivery per (endpoint, terminal run), and
# each delivery's attempts (schemas/webhooks.py holds their SQL).
webhooks = Table(
    "webhooks",
    metadata,
    Column("id", Text, primary_key=True),
    Column("user_id", Text, nullable=False),
    Column("url", Text, nullable=False),
    # whsec_...: the dispatcher signs with it; never returned after creation.
    Column("secret", Text, nullable=False),
    Column("description", Text, nullable=True),
    Column("all_runs", Boolean, nullable=False, server_default=text("true")),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Index("ix_webhooks_user_id_created_at", "user_id", "created_at"),
)

webhook_deliveries = Table(
    "webhook_deliveries",
    metadata,
    Column("id", Text, primary_key=True),
    Column("webhook_id", Text, ForeignKey("webhooks.id", ondelete="CASCADE"), nullable=False),
    Column("run_id", Text, ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
    Column("user_id", Text, nullable=False),
    Column("status", Text, nullable=False, server_default=text("'pending'")),
    Column("attempts", Integer, nullable=False, server_default=text("0")),
    Column("next_attempt_at", DateTime(timezone=True), nullable=True),
    Column("claim", Text, nullable=True),
    Column("last_status_code", Integer, nullable=True),
    Column("last_error", Text, nullable=True),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("delivered_at", DateTime(timezone=True), nullable=True),
    UniqueConstraint("webhook_id", "run_id", name="uq_webhook_deliveries_webhook_run"),
    CheckConstraint(
        "status IN ('pending', 'delivered', 'failed')", name="ck_webhook_deliveries_status"
    ),
    Index(
        "ix_webhook_deliveries_due",
        "next_attempt_at",
        postgresql_where=text("status = 'pending'"),
    ),
    Index("ix_webhook_deliveries_run_id", "run_id"),
    Index("ix_webhook_deliveries_webhook_created_at", "webhook_id", "created_at"),
)

webhook_attempts = Table(
    "webhook_attempts",
    metadata,
    Column("id", BigInteger, Identity(), primary_key=True),
    Column(
        "delivery_id",
        Text,
        ForeignKey("webhook_deliveries.id", ondelete="CASCADE"),
        nullable=False,
    ),
    Column("attempt", Integer, nullable=False),
    Column("started_at", DateTime(timezone=True), nullable=False),
    Column("duration_ms", Integer, nullable=False),
    Column("status_code", Integer, nullable=True),
    Column("error", Text, nullable=True),
    Index("ix_webhook_attempts_delivery_id", "delivery_id", "attempt"),
)

# Runs whose memories are still to be distilled (0020; processors/memory/distiller.py).
# The memories table itself (0009, 0020) is not mirrored here: its pgvector column has
# no SQLAlchemy type in this package.
memory_distillations = Table(
    "memory_distillations",
    metadata,
    Column("run_id", Text, ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True),
    Column("user_id", Text, nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("due_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("tries", Integer, nullable=False, server_default=text("0")),
    Column("last_error", Text, nullable=True),
    Column("gave_up_at", DateTime(timezone=True), nullable=True),
    CheckConstraint("tries >= 0", name="ck_memory_distillations_tries"),
    Index("ix_memory_distillations_due", "due_at", postgresql_where=text("gave_up_at IS NULL")),
)

# The journal of a run's side-effect and approval tool calls (0018, 0019;
# processors/tools/journal.py).
tool_steps = Table(
    "tool_steps",
    metadata,
    Column("run_id", Text, ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
    Column("step", Integer, nullable=False),
    Column("position", Integer, nullable=False),
    Column("tool", Text, nullable=False),
    Column("arguments", Text, nullable=False),
    Column("status", Text, nullable=False),
    Column("result", Text, nullable=True),
    Column("attempt", Integer, nullable=False),
    Column("epoch", BigInteger, nullable=False),
    Column("calls", Integer, nullable=False, server_default=text("0")),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("finished_at", DateTime(timezone=True), nullable=True),
    Column("superseded_at", DateTime(timezone=True), nullable=True),
    # A person's approve or reject of an approval tool's step (0019).
    Column("decision", Text, nullable=True),
    Column("decided_by", Text, nullable=True),
    Column("decided_at", DateTime(timezone=True), nullable=True),
    PrimaryKeyConstraint("run_id", "step", name="pk_tool_steps"),
    CheckConstraint("status IN ('initiated', 'finished', 'awaiting')", name="ck_tool_steps_status"),
    CheckConstraint("decision IN ('approved', 'rejected')", name="ck_tool_steps_decision"),
    CheckConstraint("step >= 1 AND position >= 1", name="ck_tool_steps_step"),
)
