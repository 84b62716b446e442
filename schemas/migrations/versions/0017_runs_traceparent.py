"""A run keeps its trace context: ``runs.traceparent``.

The W3C ``traceparent`` the gateway's admission span (or a client, or the scheduler's
fire span) gave the run (koda/tracing.py). The runs record carries it as a header; the
column is what the sweeper's republish sends again and what a viewing gateway links its
stream's span to. NULL: the run was not traced.

Backward compatible: a new nullable column. A gateway of the previous release writes
runs without it (their records and viewers carry no trace).

Revision ID: 0017
Revises: 0015
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0017"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("runs", sa.Column("traceparent", sa.Text(), nullable=True))


def downgrade() -> None:
    op.drop_column("runs", "traceparent")
