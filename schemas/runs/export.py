"""The replay's reads of runs' inputs and merges (topics/replay/export.py).

The runs record carries no input and merges are on no topic, so a replay reads them
from here, read-only, in keyset pages by primary key: a page boundary never skips nor
repeats a row. ``since`` (None: every row) keeps the rows created at or after it; a
run's merges move its input, so a run merged into since then comes too.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, text

_INPUTS = text(
    """
    SELECT id, user_id, session_id, created_at, input::text AS input,
           metadata::text AS metadata, COALESCE(input_version, 0) AS version
      FROM runs
     WHERE id > :after
       AND (CAST(:since AS timestamptz) IS NULL
            OR created_at >= CAST(:since AS timestamptz)
            OR id IN (SELECT run_id FROM run_merges
                       WHERE created_at >= CAST(:since AS timestamptz)))
     ORDER BY id LIMIT :n
    """
)
_MERGES = text(
    """
    SELECT idempotency_key AS id, run_id, input_version, user_id,
           input::text AS input, created_at
      FROM run_merges
     WHERE idempotency_key > :after
       AND (CAST(:since AS timestamptz) IS NULL
            OR created_at >= CAST(:since AS timestamptz))
     ORDER BY idempotency_key LIMIT :n
    """
)


def inputs_page(
    conn: Connection, *, after: str, since: datetime | None, limit: int
) -> Sequence[Any]:
    """Runs' inputs (``id, user_id, session_id, created_at, input, metadata,
    version``) by run id after ``after``, at most ``limit``."""
    return conn.execute(_INPUTS, {"after": after, "since": since, "n": limit}).all()


def merges_page(
    conn: Connection, *, after: str, since: datetime | None, limit: int
) -> Sequence[Any]:
    """Merges (``id`` = the idempotency key, ``run_id, input_version, user_id, input,
    created_at``) by key after ``after``, at most ``limit``."""
    return conn.execute(_MERGES, {"after": after, "since": since, "n": limit}).all()
