"""runs.compacted_at: when the run's chunk-topic records were compacted into one.

Backward compatible: a nullable column and a partial index; workers and gateways of
the previous release neither read nor write it.

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("runs", sa.Column("compacted_at", sa.DateTime(timezone=True), nullable=True))
    # The compactor's scan: finished runs not compacted yet, oldest first.
    op.create_index(
        "ix_runs_uncompacted_finished_at",
        "runs",
        ["finished_at"],
        postgresql_where=sa.text("compacted_at IS NULL AND finished_at IS NOT NULL"),
    )


def downgrade() -> None:
    op.drop_index("ix_runs_uncompacted_finished_at", table_name="runs")
    op.drop_column("runs", "compacted_at")
