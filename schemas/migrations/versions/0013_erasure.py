"""Per-user erasure: the receipts, and ledger rows that outlive their runs.

* ``erasures``: one receipt per erasure (``koda users erase``, ``POST
  /admin/users/{user_id}/erase``): the user only as ``user_digest`` (SHA-256 hex of the
  id, so a replay can drop an erased user's records without the id being kept), the
  ``pseudonym`` the ledger keeps instead of the id, when it was requested and
  completed (NULL: deletions began and did not finish; erase again), the rows and
  records removed per store (``counts``) and who asked (``requested_by``).
* ``ledger.run_id`` no longer references ``runs``: finance keeps an erased user's
  ledger rows (under the pseudonym) after the runs they billed are deleted. The column
  keeps the run's id, so the reports still count runs. Dropped whatever its name, and
  only if it is still there.

Backward compatible: a new table the previous release never reads, and one constraint
fewer. The downgrade adds the constraint back ``NOT VALID`` (rows of erased runs keep
their dangling ids) unless it is there already.

Revision ID: 0013
Revises: 0012
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)

# Every foreign key of ledger (run_id) onto runs, whatever a migration named it.
_LEDGER_RUN_FKS = """
    SELECT c.conname FROM pg_constraint c
      JOIN pg_attribute a ON a.attrelid = c.conrelid AND a.attnum = ANY (c.conkey)
     WHERE c.contype = 'f' AND c.conrelid = 'ledger'::regclass
       AND c.confrelid = 'runs'::regclass AND a.attname = 'run_id'
"""


def upgrade() -> None:
    op.create_table(
        "erasures",
        sa.Column("id", sa.Text, primary_key=True),
        sa.Column("user_digest", sa.Text, nullable=False),
        sa.Column("pseudonym", sa.Text, nullable=False),
        sa.Column("requested_at", TS, nullable=False, server_default=sa.func.now()),
        sa.Column("completed_at", TS, nullable=True),
        sa.Column("counts", JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
        sa.Column("requested_by", sa.Text, nullable=False),
        sa.CheckConstraint("user_digest ~ '^[0-9a-f]{64}$'", name="ck_erasures_user_digest"),
    )
    op.create_index("ix_erasures_user_digest", "erasures", ["user_digest"])
    conn = op.get_bind()
    for (name,) in conn.execute(sa.text(_LEDGER_RUN_FKS)).all():
        op.drop_constraint(name, "ledger", type_="foreignkey")


def downgrade() -> None:
    conn = op.get_bind()
    if not conn.execute(sa.text(_LEDGER_RUN_FKS)).first():
        op.execute(
            "ALTER TABLE ledger ADD CONSTRAINT ledger_run_id_fkey FOREIGN KEY (run_id)"
            " REFERENCES runs (id) NOT VALID"
        )
    op.drop_index("ix_erasures_user_digest", table_name="erasures")
    op.drop_table("erasures")
