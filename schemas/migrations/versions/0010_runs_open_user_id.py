"""runs: a partial index of the runs not yet ended, by user, for the cap on active runs.

Admission counts a user's runs whose status is pending, running or streaming (the
cap KODA_MAX_ACTIVE_RUNS_PER_USER) under a per-user lock, in every admitting
transaction; this index holds only those runs, so the count reads a handful of
entries whatever the user's history. Backward compatible: an index; the previous
release neither reads nor needs it.

Built inside the migration's transaction (as 0005's indexes, for the same reason: a
CONCURRENTLY build waits for an overlapping migrate job queued on the advisory lock,
which waits for it). On a large ``runs`` table create it CONCURRENTLY by hand first,
with the same name, columns and predicate; the migration then skips it.

Revision ID: 0010
Revises: 0009
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index(
        "ix_runs_open_user_id",
        "runs",
        ["user_id"],
        postgresql_where=sa.text("status IN ('pending', 'running', 'streaming')"),
        if_not_exists=True,
    )


def downgrade() -> None:
    op.drop_index("ix_runs_open_user_id", table_name="runs")
