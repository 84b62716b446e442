"""runs.failures: how many attempts the run's handler failed, across workers.

A run's ``attempt`` counts claims, and a claim also happens when a successor resumes a
run cut off at a handoff or left by a dead worker; those are not the run's fault. The
retry budget (``KODA_MAX_ATTEMPTS``) counts handler failures only, so it must survive
a handoff: it lives here. Backward compatible: a nullable column (NULL reads as 0);
workers of the previous release neither read nor write it.

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("runs", sa.Column("failures", sa.Integer(), nullable=True))


def downgrade() -> None:
    op.drop_column("runs", "failures")
