"""The journal of a run's tool steps: ``tool_steps`` (processors/tools/journal.py).

One row per side-effect (or approval) tool call of a run: recorded ``initiated``
before the tool runs and ``finished`` with its result before the model sees it, both
under the run's fence. A rerun of the run (crash, handoff, merge) replays the
``finished`` results of the calls the model asks again instead of calling the tools
again. ``step`` numbers a run's rows (the idempotency key a tool gets is
``<run_id>:<step>``); ``position`` is the row's place in the run's live line of
journaled calls; a row the model stopped asking for is ``superseded_at``.

Backward compatible: a new table. A worker of the previous release neither reads nor
writes it (its tools are the built-in read-only one).

Revision ID: 0018
Revises: 0017
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "tool_steps",
        sa.Column(
            "run_id", sa.Text(), sa.ForeignKey("runs.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("tool", sa.Text(), nullable=False),
        sa.Column("arguments", sa.Text(), nullable=False),
        sa.Column("status", sa.Text(), nullable=False),
        sa.Column("result", sa.Text(), nullable=True),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("epoch", sa.BigInteger(), nullable=False),
        sa.Column("calls", sa.Integer(), nullable=False, server_default=sa.text("0")),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()
        ),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("superseded_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("run_id", "step", name="pk_tool_steps"),
        sa.CheckConstraint("status IN ('initiated', 'finished')", name="ck_tool_steps_status"),
        sa.CheckConstraint("step >= 1 AND position >= 1", name="ck_tool_steps_step"),
    )


def downgrade() -> None:
    op.drop_table("tool_steps")
