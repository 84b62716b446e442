"""Initial schema: sessions, runs, messages, usage, prices, partition_epochs.

Revision ID: 0001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)
STATUSES = "'pending', 'running', 'streaming', 'done', 'failed', 'cancelled'"


def upgrade() -> None:
    op.create_table(
        "sessions",
        sa.Column("id", sa.Text, primary_key=True),
        sa.Column("user_id", sa.Text, nullable=False),
        sa.Column("created_at", TS, nullable=False, server_default=sa.func.now()),
    )
    op.create_index("ix_sessions_user_id", "sessions", ["user_id"])
    op.create_table(
        "runs",
        sa.Column("id", sa.Text, primary_key=True),
        sa.Column("session_id", sa.Text, sa.ForeignKey("sessions.id"), nullable=False),
        sa.Column("user_id", sa.Text, nullable=False),
        sa.Column("idempotency_key", sa.Text, nullable=False),
        sa.Column("status", sa.Text, nullable=False, server_default=sa.text("'pending'")),
        sa.Column("input", JSONB, nullable=False),
        sa.Column("metadata", JSONB, nullable=True),
        sa.Column("attempt", sa.Integer, nullable=False, server_default=sa.text("0")),
        sa.Column("fence", sa.BigInteger, nullable=False, server_default=sa.text("0")),
        sa.Column("worker_id", sa.Text, nullable=True),
        sa.Column("partition", sa.Integer, nullable=True),
        sa.Column("created_at", TS, nullable=False, server_default=sa.func.now()),
        sa.Column("published_at", TS, nullable=True),
        sa.Column("started_at", TS, nullable=True),
        sa.Column("first_chunk_at", TS, nullable=True),
        sa.Column("finished_at", TS, nullable=True),
        sa.Column("error", sa.Text, nullable=True),
        sa.UniqueConstraint("idempotency_key", name="uq_runs_idempotency_key"),
        sa.CheckConstraint(f"status IN ({STATUSES})", name="ck_runs_status"),
    )
    op.create_index("ix_runs_user_id_created_at", "runs", ["user_id", "created_at"])
    op.create_index("ix_runs_session_id_created_at", "runs", ["session_id", "created_at"])
    op.create_index(
        "ix_runs_pending_created_at",
        "runs",
        ["created_at"],
        postgresql_where=sa.text("status = 'pending'"),
    )
    op.create_table(
        "messages",
        sa.Column("run_id", sa.Text, sa.ForeignKey("runs.id"), nullable=False),
        sa.Column("seq", sa.Integer, nullable=False),
        sa.Column("kind", sa.Text, nullable=False),
        sa.Column("content", sa.Text, nullable=False),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("created_at", TS, nullable=False, server_default=sa.func.now()),
        sa.PrimaryKeyConstraint("run_id", "seq", name="pk_messages"),
        sa.CheckConstraint("seq >= 0", name="ck_messages_seq"),
    )
    op.create_table(
        "usage",
        sa.Column("run_id", sa.Text, sa.ForeignKey("runs.id"), nullable=False),
        sa.Column("call_index", sa.Integer, nullable=False),
        sa.Column("model", sa.Text, nullable=False),
        sa.Column("prompt_tokens", sa.Integer, nullable=False),
        sa.Column("completion_tokens", sa.Integer, nullable=False),
        sa.Column("cost_usd", sa.Numeric(18, 8), nullable=False),
        sa.Column("created_at", TS, nullable=False, server_default=sa.func.now()),
        sa.PrimaryKeyConstraint("run_id", "call_index", name="pk_usage"),
    )
    op.create_table(
        "prices",
        sa.Column("model", sa.Text, nullable=False),
        sa.Column("effective_from", TS, nullable=False),
        sa.Column("prompt_usd_per_mtok", sa.Numeric(18, 8), nullable=False),
        sa.Column("completion_usd_per_mtok", sa.Numeric(18, 8), nullable=False),
        sa.PrimaryKeyConstraint("model", "effective_from", name="pk_prices"),
    )
    op.create_table(
        "partition_epochs",
        sa.Column("topic", sa.Text, nullable=False),
        sa.Column("partition", sa.Integer, nullable=False),
        sa.Column("epoch", sa.BigInteger, nullable=False),
        sa.Column("worker_id", sa.Text, nullable=False),
        sa.Column("assigned_at", TS, nullable=False, server_default=sa.func.now()),
        sa.PrimaryKeyConstraint("topic", "partition", name="pk_partition_epochs"),
    )
    # The demo model's price, so usage rows of `make dev` runs carry a cost.
    op.execute(
        "INSERT INTO prices (model, effective_from, prompt_usd_per_mtok, "
        "completion_usd_per_mtok) VALUES ('demo-1', '2000-01-01T00:00:00Z', 0.15, 0.60)"
    )


def downgrade() -> None:
    for table in ("partition_epochs", "prices", "usage", "messages", "runs", "sessions"):
        op.drop_table(table)
