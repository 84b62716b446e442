"""Retention: what the sweep (processors/retention.py) needs on ``runs``.

* ``runs.chunks_expired_at``: when the run's chunk rows were collapsed into its final
  output (``KODA_CHUNK_RETENTION``); NULL while they are all kept.
* ``runs.output_seq``: the seq of the one ``chunk`` row that then holds the run's
  whole output (the text after its last reset); the terminal event keeps its own row
  and seq. NULL: the run had no event before its terminal one.
* ``runs.expire_through``: the rows of seq <= this are still to be deleted (in small
  batches, lowest seq first; the highest of them is a ``reset``, so a reader at any
  moment gets the output once). NULL once they are gone.
* ``ix_runs_unexpired_finished_at``: ended runs whose chunks are all kept, by end: the
  sweep's scan starts at the oldest and stops at the first one too young.
* ``ix_runs_finished_at``: every ended run by end (``KODA_RUN_RETENTION``).
* ``ix_runs_expiring``: the few runs whose leftover rows are being deleted.
* ``messages``: autovacuum at 5 % dead rows (not 20 %), so the pages the sweep empties
  are reused soon instead of growing the table.
* ``ledger.run_id`` no longer references ``runs``: the ledger keeps its rows by its own
  rule (``KODA_LEDGER_RETENTION``) after their runs are deleted; the column keeps the
  run's id. Dropped whatever its name and only if still there (0013 does the same).

``messages`` is not partitioned; docs ARCHITECTURE.md "Retention" gives the measured
reason. Backward compatible: nullable columns and indexes the previous release never
reads; the dropped constraint only stops refusing rows. Indexes are built inside the
transaction, as 0010's: on a large ``runs`` table build them CONCURRENTLY by hand first
with the same names, columns and predicates; the migration then skips them.

Revision ID: 0012
Revises: 0011
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
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
    op.add_column("runs", sa.Column("chunks_expired_at", TS, nullable=True))
    op.add_column("runs", sa.Column("output_seq", sa.Integer, nullable=True))
    op.add_column("runs", sa.Column("expire_through", sa.Integer, nullable=True))
    op.create_index(
        "ix_runs_unexpired_finished_at",
        "runs",
        ["finished_at"],
        postgresql_where=sa.text("chunks_expired_at IS NULL AND finished_at IS NOT NULL"),
        if_not_exists=True,
    )
    op.create_index(
        "ix_runs_finished_at",
        "runs",
        ["finished_at"],
        postgresql_where=sa.text("finished_at IS NOT NULL"),
        if_not_exists=True,
    )
    op.create_index(
        "ix_runs_expiring",
        "runs",
        ["id"],
        postgresql_where=sa.text("expire_through IS NOT NULL"),
        if_not_exists=True,
    )
    op.execute("ALTER TABLE messages SET (autovacuum_vacuum_scale_factor = 0.05)")
    conn = op.get_bind()
    for (name,) in conn.execute(sa.text(_LEDGER_RUN_FKS)).all():
        op.drop_constraint(name, "ledger", type_="foreignkey")


def downgrade() -> None:
    # The foreign key stays dropped: rows of deleted runs keep their dangling ids, and
    # 0013's downgrade puts it back NOT VALID.
    op.execute("ALTER TABLE messages RESET (autovacuum_vacuum_scale_factor)")
    op.drop_index("ix_runs_expiring", table_name="runs")
    op.drop_index("ix_runs_finished_at", table_name="runs")
    op.drop_index("ix_runs_unexpired_finished_at", table_name="runs")
    op.drop_column("runs", "expire_through")
    op.drop_column("runs", "output_seq")
    op.drop_column("runs", "chunks_expired_at")
