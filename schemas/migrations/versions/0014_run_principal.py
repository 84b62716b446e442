"""Every run records the principal that created it: ``runs.created_by``.

``user:<id>`` when a user's own token submitted it, ``service:<name>`` when a service
token (KODA_SERVICE_TOKENS) submitted it for the user its ``X-Koda-User`` header named.
The gateway writes it on every admission; ``GET /v1/runs/{id}`` shows it. NULL (runs
written before this revision, a schedule's run-now) reads as ``user:<user_id>``.

Backward compatible: a new nullable column; a gateway of the previous release writes
runs without it.

Revision ID: 0014
Revises: 0013
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("runs", sa.Column("created_by", sa.Text(), nullable=True))


def downgrade() -> None:
    op.drop_column("runs", "created_by")
