"""Webhooks: endpoints, one delivery per (endpoint, terminal run), and its attempts.

* ``webhooks``: a user's endpoint: ``url``, the signing ``secret`` (``whsec_...``, kept
  as koda generated it: the dispatcher signs with it, so it cannot be hashed; never
  returned after creation), ``all_runs`` (false: only the runs of schedules naming it).
* ``webhook_deliveries``: one row per terminal run per endpoint, unique on
  ``(webhook_id, run_id)``, so a terminal record read twice never makes two. Its ``id``
  is the ``webhook-id`` header, the same at every attempt. ``next_attempt_at`` is when
  it is due (a claimed row's is pushed past the request's timeout: its lease);
  ``status`` pending, delivered or failed (given up after ``KODA_WEBHOOK_HORIZON``).
* ``webhook_attempts``: each POST: the status code or the error, the duration, when.
* ``schedules.webhook_id``: a schedule's own endpoint (its runs go there alone);
  deleting the endpoint sets it back to NULL.

Rows follow their webhook and their run (``ON DELETE CASCADE``), so deleting a user's
runs or webhooks deletes their deliveries. Backward compatible: new tables and a
nullable column the previous release never reads.

Revision ID: 0015
Revises: 0014
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "webhooks",
        sa.Column("id", sa.Text, primary_key=True),
        sa.Column("user_id", sa.Text, nullable=False),
        sa.Column("url", sa.Text, nullable=False),
        sa.Column("secret", sa.Text, nullable=False),
        sa.Column("description", sa.Text, nullable=True),
        sa.Column("all_runs", sa.Boolean, nullable=False, server_default=sa.text("true")),
        sa.Column("created_at", TS, nullable=False, server_default=sa.func.now()),
    )
    op.create_index("ix_webhooks_user_id_created_at", "webhooks", ["user_id", "created_at"])
    op.create_table(
        "webhook_deliveries",
        sa.Column("id", sa.Text, primary_key=True),
        sa.Column(
            "webhook_id",
            sa.Text,
            sa.ForeignKey("webhooks.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("run_id", sa.Text, sa.ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("user_id", sa.Text, nullable=False),
        sa.Column("status", sa.Text, nullable=False, server_default=sa.text("'pending'")),
        sa.Column("attempts", sa.Integer, nullable=False, server_default=sa.text("0")),
        sa.Column("next_attempt_at", TS, nullable=True),
        sa.Column("claim", sa.Text, nullable=True),
        sa.Column("last_status_code", sa.Integer, nullable=True),
        sa.Column("last_error", sa.Text, nullable=True),
        sa.Column("created_at", TS, nullable=False, server_default=sa.func.now()),
        sa.Column("delivered_at", TS, nullable=True),
        sa.UniqueConstraint("webhook_id", "run_id", name="uq_webhook_deliveries_webhook_run"),
        sa.CheckConstraint(
            "status IN ('pending', 'delivered', 'failed')", name="ck_webhook_deliveries_status"
        ),
    )
    op.create_index(
        "ix_webhook_deliveries_due",
        "webhook_deliveries",
        ["next_attempt_at"],
        postgresql_where=sa.text("status = 'pending'"),
    )
    op.create_index("ix_webhook_deliveries_run_id", "webhook_deliveries", ["run_id"])
    op.create_index(
        "ix_webhook_deliveries_webhook_created_at",
        "webhook_deliveries",
        ["webhook_id", "created_at"],
    )
    op.create_table(
        "webhook_attempts",
        sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
        sa.Column(
            "delivery_id",
            sa.Text,
            sa.ForeignKey("webhook_deliveries.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("started_at", TS, nullable=False),
        sa.Column("duration_ms", sa.Integer, nullable=False),
        sa.Column("status_code", sa.Integer, nullable=True),
        sa.Column("error", sa.Text, nullable=True),
    )
    op.create_index(
        "ix_webhook_attempts_delivery_id", "webhook_attempts", ["delivery_id", "attempt"]
    )
    op.add_column(
        "schedules",
        sa.Column(
            "webhook_id",
            sa.Text,
            sa.ForeignKey("webhooks.id", ondelete="SET NULL", name="fk_schedules_webhook_id"),
            nullable=True,
        ),
    )


def downgrade() -> None:
    op.drop_constraint("fk_schedules_webhook_id", "schedules", type_="foreignkey")
    op.drop_column("schedules", "webhook_id")
    op.drop_table("webhook_attempts")
    op.drop_table("webhook_deliveries")
    op.drop_table("webhooks")
