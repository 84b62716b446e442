"""Chunk-topic upkeep's reads and marks on runs and messages.

The compactor (processors/compactor.py) turns a terminal run's chunk records into one
``final`` record and tombstones, and its completeness pass produces again the messages
of terminal runs not known to be whole on the topic; ``koda chunks verify``
(processors/chunkverify.py) compares the topic with Postgres. Their Kafka side stays
with them; these are the statements they run, each on the caller's connection, so the
compactor keeps its claim's row locks (and its rollback on a failed delivery) in one
transaction of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Row, text

from koda_runtime.lifecycle.states import TERMINAL

_TERMINAL = sorted(s.value for s in TERMINAL)

# SKIP LOCKED: two compactors take different runs; a worker marking a run published
# skips the rows held here (schemas/runs/worker.py).
_CLAIM = text(
    """
    SELECT id, user_id, partition, status FROM runs
     WHERE compacted_at IS NULL AND finished_at IS NOT NULL
       AND status = ANY(:terminal)
       AND finished_at <= now() - make_interval(secs => :older_than)
     ORDER BY finished_at
     LIMIT :batch
       FOR UPDATE SKIP LOCKED
    """
)
_MESSAGES = text(
    """
    SELECT run_id, seq, kind, content, attempt FROM messages
     WHERE run_id = ANY(:ids) ORDER BY run_id, seq
    """
)
_MARK_COMPACTED = text("UPDATE runs SET compacted_at = now() WHERE id = ANY(:ids)")
_UNPUBLISHED = text(
    """
    SELECT id, user_id, partition, finished_at FROM runs
     WHERE published_seq IS NULL AND compacted_at IS NULL AND finished_at IS NOT NULL
       AND status = ANY(:terminal)
       AND finished_at <= now() - make_interval(secs => :older_than)
       AND (CAST(:after_at AS timestamptz) IS NULL
            OR (finished_at >= :after_at AND (finished_at, id) > (:after_at, :after_id)))
     ORDER BY finished_at, id
     LIMIT :batch
    """
)
_MARK_PUBLISHED = text(
    """
    UPDATE runs r SET published_seq = q.seq
      FROM unnest(CAST(:ids AS text[]), CAST(:seqs AS int[])) AS q(run_id, seq)
     WHERE r.id = q.run_id AND r.published_seq IS NULL
    """
)
_FINISHED_SINCE = text(
    """
    SELECT id FROM runs
     WHERE finished_at IS NOT NULL AND finished_at >= :since
       AND status = ANY(:terminal)
     ORDER BY finished_at, id
    """
)


def claim_for_compaction(conn: Connection, older_than_s: float, batch: int) -> list[Row[Any]]:
    """Up to ``batch`` terminal runs, finished over ``older_than_s`` seconds ago and not
    compacted, oldest first, locked ``FOR UPDATE`` until ``conn``'s transaction ends
    (rows another transaction holds are skipped): ``id, user_id, partition, status``."""
    params = {"terminal": _TERMINAL, "older_than": older_than_s, "batch": batch}
    return list(conn.execute(_CLAIM, params).all())


def mark_compacted(conn: Connection, ids: Sequence[str]) -> None:
    """Stamp ``compacted_at`` on the runs ``ids``."""
    conn.execute(_MARK_COMPACTED, {"ids": list(ids)})


def messages_by_run(conn: Connection, ids: Sequence[str]) -> dict[str, list[Row[Any]]]:
    """The messages of each run of ``ids`` in seq order (``run_id, seq, kind, content,
    attempt``); every run has an entry, empty when it has no message."""
    by_run: dict[str, list[Row[Any]]] = {run_id: [] for run_id in ids}
    for m in conn.execute(_MESSAGES, {"ids": list(ids)}):
        by_run[m.run_id].append(m)
    return by_run


def unpublished(
    conn: Connection, older_than_s: float, after: tuple[Any, str] | None, batch: int
) -> list[Row[Any]]:
    """Up to ``batch`` terminal runs, finished over ``older_than_s`` seconds ago, neither
    compacted nor known to be whole on the chunk topic, in (finished_at, id) order after
    ``after`` (keyset pagination along the partial index): ``id, user_id, partition,
    finished_at``."""
    params = {
        "terminal": _TERMINAL,
        "older_than": older_than_s,
        "after_at": None if after is None else after[0],
        "after_id": None if after is None else after[1],
        "batch": batch,
    }
    return list(conn.execute(_UNPUBLISHED, params).all())


def mark_published(conn: Connection, ids: Sequence[str], seqs: Sequence[int]) -> None:
    """Every message of run ``ids[i]``, 0..``seqs[i]``, is acknowledged on the chunk
    topic (a run without messages: -1). A run already marked keeps its mark."""
    conn.execute(_MARK_PUBLISHED, {"ids": list(ids), "seqs": list(seqs)})


def finished_since(conn: Connection, since: datetime) -> list[str]:
    """The ids of the runs that reached a terminal status at or after ``since``, in
    (finished_at, id) order."""
    return [r.id for r in conn.execute(_FINISHED_SINCE, {"since": since, "terminal": _TERMINAL})]
