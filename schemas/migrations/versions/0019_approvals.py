"""A run can wait for a person: status ``waiting`` and the decision on a tool step.

* ``runs.status`` may be ``waiting`` (koda_runtime.lifecycle.states): the model called a
  tool declared ``approval=True`` and the run waits, holding no worker slot, for
  ``POST /v1/runs/{id}/approve`` or ``/reject`` (gateway/approvals.py).
  A waiting run is open: it counts toward ``KODA_MAX_ACTIVE_RUNS_PER_USER``, so
  ``ix_runs_open_user_id`` (0010) is made again with it in its predicate.
* ``tool_steps.status`` may be ``awaiting``: the step of that call, with its
  ``decision`` (``approved`` or ``rejected``), who decided (``decided_by``, a principal
  such as ``user:<id>``, or ``timeout`` for ``KODA_APPROVAL_TIMEOUT_S``) and when.

Backward compatible: a wider CHECK and new nullable columns. A worker of the previous
release never makes a run wait; it would not resume a waiting one either (it cannot
claim from ``waiting``), so roll workers before anyone declares an approval tool.

Revision ID: 0019
Revises: 0018
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None

BEFORE = "'pending', 'running', 'streaming', 'done', 'failed', 'cancelled'"
AFTER = BEFORE + ", 'waiting'"
OPEN_BEFORE = "status IN ('pending', 'running', 'streaming')"
OPEN_AFTER = "status IN ('pending', 'running', 'streaming', 'waiting')"


def _open_index(predicate: str) -> None:
    op.drop_index("ix_runs_open_user_id", table_name="runs", if_exists=True)
    op.create_index(
        "ix_runs_open_user_id", "runs", ["user_id"], postgresql_where=sa.text(predicate)
    )


def upgrade() -> None:
    op.drop_constraint("ck_runs_status", "runs", type_="check")
    op.create_check_constraint("ck_runs_status", "runs", f"status IN ({AFTER})")
    _open_index(OPEN_AFTER)
    op.drop_constraint("ck_tool_steps_status", "tool_steps", type_="check")
    op.create_check_constraint(
        "ck_tool_steps_status", "tool_steps", "status IN ('initiated', 'finished', 'awaiting')"
    )
    op.add_column("tool_steps", sa.Column("decision", sa.Text(), nullable=True))
    op.add_column("tool_steps", sa.Column("decided_by", sa.Text(), nullable=True))
    op.add_column("tool_steps", sa.Column("decided_at", sa.DateTime(timezone=True), nullable=True))
    op.create_check_constraint(
        "ck_tool_steps_decision", "tool_steps", "decision IN ('approved', 'rejected')"
    )


def downgrade() -> None:
    op.drop_constraint("ck_tool_steps_decision", "tool_steps", type_="check")
    op.drop_column("tool_steps", "decided_at")
    op.drop_column("tool_steps", "decided_by")
    op.drop_column("tool_steps", "decision")
    op.drop_constraint("ck_tool_steps_status", "tool_steps", type_="check")
    op.create_check_constraint(
        "ck_tool_steps_status", "tool_steps", "status IN ('initiated', 'finished')"
    )
    _open_index(OPEN_BEFORE)
    op.drop_constraint("ck_runs_status", "runs", type_="check")
    op.create_check_constraint("ck_runs_status", "runs", f"status IN ({BEFORE})")
