"""Run control: a durable cancel request, and the input version that merges bump.

* ``runs.cancel_requested_at`` / ``runs.cancel_reason``: the gateway writes the cancel
  request here before it signals the worker, so a cancel survives a missed signal (a
  drain, a rebalance, a killed worker): whoever claims or finishes the run next sees it.
* ``runs.input_version``: bumped by the conditional UPDATE that merges a second
  message into a running run (NULL reads as 0). The worker's finish checks it, so a
  run never finishes on the input it started with once a message was merged.
* ``run_merges``: one row per merged message, keyed by the request's idempotency key,
  so a retried merge answers the same run and appends nothing twice.

Backward compatible: nullable columns and a new table; workers of the previous release
neither read nor write them.

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("runs", sa.Column("cancel_requested_at", sa.DateTime(timezone=True)))
    op.add_column("runs", sa.Column("cancel_reason", sa.Text()))
    op.add_column("runs", sa.Column("input_version", sa.Integer()))
    op.create_table(
        "run_merges",
        sa.Column("idempotency_key", sa.Text(), primary_key=True),
        sa.Column("run_id", sa.Text(), sa.ForeignKey("runs.id"), nullable=False),
        sa.Column("user_id", sa.Text(), nullable=False),
        sa.Column("input_version", sa.Integer(), nullable=False),
        sa.Column("input", JSONB(), nullable=False),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()
        ),
    )
    op.create_index("ix_run_merges_run_id", "run_merges", ["run_id"])


def downgrade() -> None:
    op.drop_index("ix_run_merges_run_id", table_name="run_merges")
    op.drop_table("run_merges")
    op.drop_column("runs", "input_version")
    op.drop_column("runs", "cancel_reason")
    op.drop_column("runs", "cancel_requested_at")
