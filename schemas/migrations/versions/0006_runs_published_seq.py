"""runs.published_seq: the run's output is known to be whole on the chunk topic.

A worker commits a chunk batch to Postgres before producing it; one that dies in
between leaves chunks in Postgres that never reach ``<env>.koda.run-chunks``. Once
every message of a terminal run (seq 0 up to its terminal event) has been
acknowledged by the broker, whoever produced the last of them writes that terminal
seq here. NULL means "not known to be whole": the worker that next meets the run, or
the compactor's completeness pass, produces the run's messages again (the records
are keyed ``<run_id>:<seq>``, so a second copy changes nothing for any reader).

Backward compatible: a nullable column and a partial index; workers of the previous
release neither read nor write it (their runs are completed by the pass).

Revision ID: 0006
Revises: 0005
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("runs", sa.Column("published_seq", sa.Integer(), nullable=True))
    # The completeness pass's scan: finished, uncompacted runs not known to be whole.
    op.create_index(
        "ix_runs_unpublished_finished_at",
        "runs",
        ["finished_at"],
        postgresql_where=sa.text(
            "published_seq IS NULL AND compacted_at IS NULL AND finished_at IS NOT NULL"
        ),
    )


def downgrade() -> None:
    op.drop_index("ix_runs_unpublished_finished_at", table_name="runs")
    op.drop_column("runs", "published_seq")
