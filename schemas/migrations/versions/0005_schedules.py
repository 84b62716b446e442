"""schedules, and runs.schedule_id / runs.scheduled_for: scheduled runs.

``koda scheduler`` fires each schedule's due minutes as runs with the idempotency key
``sched:<schedule_id>:<UTC minute>``; the run records which schedule and minute it came
from. Backward compatible: a new table and two nullable columns; gateways and workers
of the previous release neither read nor write them. The two runs indexes are partial
(scheduled runs only) and built CONCURRENTLY, so admissions are not blocked meanwhile.

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("runs", sa.Column("schedule_id", sa.Text(), nullable=True))
    op.add_column("runs", sa.Column("scheduled_for", sa.DateTime(timezone=True), nullable=True))
    op.create_table(
        "schedules",
        sa.Column("id", sa.Text(), primary_key=True),
        sa.Column("user_id", sa.Text(), nullable=False),
        sa.Column("session_id", sa.Text(), sa.ForeignKey("sessions.id"), nullable=True),
        sa.Column("cron", sa.Text(), nullable=False),
        sa.Column("timezone", sa.Text(), nullable=False),
        sa.Column("input", JSONB(), nullable=False),
        sa.Column("enabled", sa.Boolean(), nullable=False, server_default=sa.text("true")),
        sa.Column("quiet_start", sa.Integer(), nullable=True),
        sa.Column("quiet_end", sa.Integer(), nullable=True),
        sa.Column("daily_cap", sa.Integer(), nullable=False, server_default=sa.text("1440")),
        sa.Column("overlap", sa.Text(), nullable=False, server_default=sa.text("'skip'")),
        sa.Column("catchup_s", sa.Integer(), nullable=False, server_default=sa.text("900")),
        sa.Column("next_fire_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("last_fire_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()
        ),
        sa.Column(
            "updated_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()
        ),
        sa.CheckConstraint("overlap IN ('skip', 'allow')", name="ck_schedules_overlap"),
        sa.CheckConstraint("daily_cap >= 1", name="ck_schedules_daily_cap"),
        sa.CheckConstraint("catchup_s >= 0", name="ck_schedules_catchup_s"),
        sa.CheckConstraint(
            "(quiet_start IS NULL) = (quiet_end IS NULL)"
            " AND (quiet_start IS NULL OR (quiet_start BETWEEN 0 AND 1439"
            " AND quiet_end BETWEEN 0 AND 1439 AND quiet_start <> quiet_end))",
            name="ck_schedules_quiet_hours",
        ),
    )
    op.create_index("ix_schedules_user_id_created_at", "schedules", ["user_id", "created_at"])
    op.create_index(
        "ix_schedules_next_fire_at",
        "schedules",
        ["next_fire_at"],
        postgresql_where=sa.text("next_fire_at IS NOT NULL"),
    )
    for name, columns in (
        ("ix_runs_schedule_scheduled_for", ["schedule_id", "scheduled_for"]),
        ("ix_runs_user_scheduled_for", ["user_id", "scheduled_for"]),
    ):
        op.create_index(
            name,
            "runs",
            columns,
            postgresql_where=sa.text("schedule_id IS NOT NULL"),
            if_not_exists=True,
        )


def downgrade() -> None:
    for name in ("ix_runs_user_scheduled_for", "ix_runs_schedule_scheduled_for"):
        op.drop_index(name, table_name="runs", if_exists=True)
    op.drop_table("schedules")
    op.drop_column("runs", "scheduled_for")
    op.drop_column("runs", "schedule_id")
