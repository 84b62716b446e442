"""Memories that stay true: subjects, supersession, and distillation off the run's path.

* ``memories`` gains ``subject`` (the subject key of a statement, NULL: none found),
  ``said_at`` (when the user said it: the run's creation time; a near-duplicate said
  again refreshes it), ``superseded_by`` / ``superseded_at`` (a newer statement on
  the same subject replaced this one: kept for audit, never searched). Searches read
  the user's current rows of one embedder: ``ix_memories_current``.
* ``memory_distillations``: one row per ``done`` run whose memories are still to be
  distilled, written in the run's terminal transaction and deleted in the transaction
  that stores its memories (processors/memory/distiller.py). ``due_at`` is when a
  worker may take it next (a lease while one works on it, a backoff after a failure),
  ``tries`` how many times one took it, ``gave_up_at`` set after the last try.
  Deleted with its run.

Backward compatible: new nullable or defaulted columns the previous release never
reads (its inserts name their columns), and a new table it never touches.

Revision ID: 0020
Revises: 0019
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.add_column("memories", sa.Column("subject", sa.Text, nullable=True))
    op.add_column(
        "memories", sa.Column("said_at", TS, nullable=False, server_default=sa.func.now())
    )
    op.add_column("memories", sa.Column("superseded_by", sa.Text, nullable=True))
    op.add_column("memories", sa.Column("superseded_at", TS, nullable=True))
    op.execute("UPDATE memories SET said_at = created_at")
    op.create_index(
        "ix_memories_current",
        "memories",
        ["user_id", "embedder"],
        postgresql_where=sa.text("superseded_by IS NULL"),
    )
    op.create_table(
        "memory_distillations",
        sa.Column(
            "run_id", sa.Text, sa.ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True
        ),
        sa.Column("user_id", sa.Text, nullable=False),
        sa.Column("created_at", TS, nullable=False, server_default=sa.func.now()),
        sa.Column("due_at", TS, nullable=False, server_default=sa.func.now()),
        sa.Column("tries", sa.Integer, nullable=False, server_default=sa.text("0")),
        sa.Column("last_error", sa.Text, nullable=True),
        sa.Column("gave_up_at", TS, nullable=True),
        sa.CheckConstraint("tries >= 0", name="ck_memory_distillations_tries"),
    )
    op.create_index(
        "ix_memory_distillations_due",
        "memory_distillations",
        ["due_at"],
        postgresql_where=sa.text("gave_up_at IS NULL"),
    )


def downgrade() -> None:
    op.drop_table("memory_distillations")
    op.drop_index("ix_memories_current", table_name="memories")
    for column in ("superseded_at", "superseded_by", "said_at", "subject"):
        op.drop_column("memories", column)
