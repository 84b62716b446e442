"""The retention sweep's statements (processors/retention.py runs the passes and
decides what to keep): chunks of ended, compacted runs collapsed into their output,
the rows below a collapsed run's reset, old runs and whole ledger months deleted.

Every statement that deletes or locks takes rows ``SKIP LOCKED``, inside a
:func:`short_transaction` whose statements wait at most :data:`LOCK_TIMEOUT_MS` for a
lock: the sweep never waits on a worker's writes and a worker never waits on it for
longer than one small batch. ``terminal`` parameters are the state machine's terminal
statuses. Errors are the driver's: the sweep turns them into its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, Engine, text

from koda_runtime.lifecycle.states import TERMINAL

# A statement of the sweep waits at most this long for a lock; past it the statement
# fails and the batch is tried again at the next pass.
LOCK_TIMEOUT_MS = 2000
_TERMINAL_STATUSES = sorted(s.value for s in TERMINAL)

# Ended, compacted runs whose chunks are all kept and that ended before the cut-off,
# oldest first (ix_runs_unexpired_finished_at).
_CLAIM_EXPIRABLE = text(
    """
    SELECT id FROM runs
     WHERE chunks_expired_at IS NULL AND finished_at IS NOT NULL
       AND finished_at <= now() - make_interval(secs => :keep)
       AND status = ANY(:terminal) AND compacted_at IS NOT NULL
     ORDER BY finished_at
     LIMIT :runs
       FOR UPDATE SKIP LOCKED
    """
)
_COUNT_EXPIRABLE = text(
    """
    SELECT count(*) FROM runs
     WHERE chunks_expired_at IS NULL AND finished_at IS NOT NULL
       AND finished_at <= now() - make_interval(secs => :keep)
       AND status = ANY(:terminal) AND compacted_at IS NOT NULL
    """
)
_RUN_MESSAGES = text(
    "SELECT run_id, seq, kind, content, attempt FROM messages"
    " WHERE run_id = ANY(:ids) ORDER BY run_id, seq"
)
_UPSERT = text(
    """
    INSERT INTO messages (run_id, seq, kind, content, attempt)
    SELECT * FROM unnest(CAST(:ids AS text[]), CAST(:seqs AS int[]), CAST(:kinds AS text[]),
                         CAST(:contents AS text[]), CAST(:attempts AS int[]))
    ON CONFLICT (run_id, seq) DO UPDATE
       SET kind = excluded.kind, content = excluded.content, attempt = excluded.attempt
    """
)
_MARK_EXPIRED = text(
    """
    UPDATE runs r SET chunks_expired_at = now(), output_seq = q.output_seq,
                      expire_through = q.through
      FROM unnest(CAST(:ids AS text[]), CAST(:outs AS int[]), CAST(:throughs AS int[]))
           AS q(id, output_seq, through)
     WHERE r.id = q.id
    """
)
# Rows below a collapsed run's reset, in any order (the reset keeps the output whole).
_DELETE_LEFTOVERS = text(
    """
    DELETE FROM messages WHERE ctid = ANY(ARRAY(
        SELECT m.ctid FROM runs r JOIN messages m ON m.run_id = r.id AND m.seq < r.expire_through
         WHERE r.expire_through IS NOT NULL
         LIMIT :batch
           FOR UPDATE OF m SKIP LOCKED))
    """
)
# Collapsed runs with nothing left below their reset: the reset goes, and they are done.
_FINISH_LEFTOVERS = text(
    """
    WITH done AS (
        SELECT r.id, r.expire_through FROM runs r
         WHERE r.expire_through IS NOT NULL
           AND NOT EXISTS (SELECT 1 FROM messages m
                            WHERE m.run_id = r.id AND m.seq < r.expire_through)
         LIMIT :runs
           FOR UPDATE OF r SKIP LOCKED
    ), gone AS (
        DELETE FROM messages m USING done
         WHERE m.run_id = done.id AND m.seq = done.expire_through AND m.kind = 'reset'
        RETURNING 1
    ), marked AS (
        UPDATE runs r SET expire_through = NULL FROM done WHERE r.id = done.id RETURNING 1
    )
    SELECT (SELECT count(*) FROM gone) AS rows, (SELECT count(*) FROM marked) AS runs
    """
)
_COUNT_LEFTOVERS = text(
    """
    SELECT count(*) FROM runs r JOIN messages m ON m.run_id = r.id AND m.seq <= r.expire_through
     WHERE r.expire_through IS NOT NULL
    """
)
# Ended, compacted runs past KODA_RUN_RETENTION, oldest first after a keyset cursor.
_OLD_RUNS = text(
    """
    SELECT id, finished_at FROM runs
     WHERE finished_at IS NOT NULL
       AND finished_at <= now() - make_interval(secs => :keep)
       AND status = ANY(:terminal) AND compacted_at IS NOT NULL
       AND (CAST(:after_at AS timestamptz) IS NULL
            OR (finished_at >= :after_at AND (finished_at, id) > (:after_at, :after_id)))
     ORDER BY finished_at, id
     LIMIT :runs
    """
)
_DELETE_RUN_MESSAGES = text(
    """
    DELETE FROM messages WHERE ctid = ANY(ARRAY(
        SELECT ctid FROM messages WHERE run_id = ANY(:ids) LIMIT :batch FOR UPDATE SKIP LOCKED))
    """
)
_LOCK_RUNS = text(
    """
    SELECT id FROM runs
     WHERE id = ANY(:ids) AND status = ANY(:terminal) AND finished_at IS NOT NULL
       AND NOT EXISTS (SELECT 1 FROM messages m WHERE m.run_id = runs.id)
       FOR UPDATE SKIP LOCKED
    """
)
_DELETE_CHILDREN = {
    "usage": text("DELETE FROM usage WHERE run_id = ANY(:ids)"),
    "run_merges": text("DELETE FROM run_merges WHERE run_id = ANY(:ids)"),
    "runs": text("DELETE FROM runs WHERE id = ANY(:ids)"),
}
_COUNT_OLD = text(
    """
    SELECT count(*) AS runs,
           coalesce(sum((SELECT count(*) FROM messages m WHERE m.run_id = r.id)), 0) AS messages
      FROM runs r
     WHERE finished_at IS NOT NULL
       AND finished_at <= now() - make_interval(secs => :keep)
       AND status = ANY(:terminal) AND compacted_at IS NOT NULL
    """
)
# Whole UTC months that ended more than :keep seconds ago: rows created before the
# first instant of the month holding now() - :keep.
_DELETE_LEDGER = text(
    """
    DELETE FROM ledger WHERE id = ANY(ARRAY(
        SELECT id FROM ledger
         WHERE created_at < (date_trunc('month', (now() - make_interval(secs => :keep))
                                                 AT TIME ZONE 'UTC') AT TIME ZONE 'UTC')
         LIMIT :batch FOR UPDATE SKIP LOCKED))
    """
)
_COUNT_LEDGER = text(
    """
    SELECT count(*) FROM ledger
     WHERE created_at < (date_trunc('month', (now() - make_interval(secs => :keep))
                                             AT TIME ZONE 'UTC') AT TIME ZONE 'UTC')
    """
)


# set_config(..., true) is SET LOCAL: for this transaction only.
_SET_LOCK_TIMEOUT = text("SELECT set_config('lock_timeout', :ms, true)")


class _ShortTransaction:
    """A transaction whose statements wait at most LOCK_TIMEOUT_MS for a lock."""

    def __init__(self, engine: Engine) -> None:
        self._cm = engine.begin()

    def __enter__(self) -> Connection:
        conn = self._cm.__enter__()
        conn.execute(_SET_LOCK_TIMEOUT, {"ms": str(LOCK_TIMEOUT_MS)})
        return conn

    def __exit__(self, *exc: Any) -> Any:
        return self._cm.__exit__(*exc)


def short_transaction(engine: Engine) -> _ShortTransaction:
    """A transaction whose statements wait at most :data:`LOCK_TIMEOUT_MS` for a lock."""
    return _ShortTransaction(engine)


# -- 1. chunks ------------------------------------------------------------------------


def claim_expirable(conn: Connection, *, keep_s: float, runs: int) -> list[str]:
    """Lock at most ``runs`` ended, compacted runs that ended ``keep_s`` ago or more and
    whose chunks are all kept, oldest first; their ids."""
    params = {"keep": keep_s, "terminal": _TERMINAL_STATUSES, "runs": runs}
    return [r.id for r in conn.execute(_CLAIM_EXPIRABLE, params)]


def run_messages(conn: Connection, ids: list[str]) -> Sequence[Any]:
    """The messages (``run_id, seq, kind, content, attempt``) of runs ``ids``, in order."""
    return conn.execute(_RUN_MESSAGES, {"ids": ids}).all()


def upsert_messages(conn: Connection, rows: Sequence[tuple[str, int, str, str, int]]) -> None:
    """Write ``(run_id, seq, kind, content, attempt)`` rows over what those seqs hold."""
    conn.execute(
        _UPSERT,
        {
            "ids": [r[0] for r in rows],
            "seqs": [r[1] for r in rows],
            "kinds": [r[2] for r in rows],
            "contents": [r[3] for r in rows],
            "attempts": [r[4] for r in rows],
        },
    )


def mark_expired(
    conn: Connection, ids: list[str], outs: list[int | None], throughs: list[int | None]
) -> None:
    """Runs ``ids`` are collapsed: each one's ``output_seq`` and ``expire_through``."""
    conn.execute(_MARK_EXPIRED, {"ids": ids, "outs": outs, "throughs": throughs})


# -- 2. leftover rows -------------------------------------------------------------------


def delete_leftovers(conn: Connection, *, batch: int) -> int:
    """Delete at most ``batch`` rows below collapsed runs' resets; how many."""
    return int(conn.execute(_DELETE_LEFTOVERS, {"batch": batch}).rowcount)


def finish_leftovers(conn: Connection, *, runs: int) -> tuple[int, int]:
    """At most ``runs`` collapsed runs with nothing left below their reset lose the
    reset and are done: (rows deleted, runs done)."""
    done = conn.execute(_FINISH_LEFTOVERS, {"runs": runs}).one()
    return int(done.rows), int(done.runs)


# -- 3. runs ----------------------------------------------------------------------------


def old_runs(
    conn: Connection, *, keep_s: float, after: tuple[Any, str] | None, runs: int
) -> Sequence[Any]:
    """At most ``runs`` ended, compacted runs (``id, finished_at``) that ended
    ``keep_s`` ago or more, oldest first after the keyset position ``after``."""
    return conn.execute(
        _OLD_RUNS,
        {
            "keep": keep_s,
            "terminal": _TERMINAL_STATUSES,
            "after_at": None if after is None else after[0],
            "after_id": None if after is None else after[1],
            "runs": runs,
        },
    ).all()


def delete_run_messages(conn: Connection, ids: list[str], *, batch: int) -> int:
    """Delete at most ``batch`` messages of runs ``ids``; how many."""
    return int(conn.execute(_DELETE_RUN_MESSAGES, {"ids": ids, "batch": batch}).rowcount)


def delete_runs(conn: Connection, ids: list[str]) -> dict[str, int]:
    """Lock those of runs ``ids`` that ended and have no messages left, and delete
    their merges, usage rows and rows; the rows deleted per table. IntegrityError when
    another table still references them."""
    locked = [r.id for r in conn.execute(_LOCK_RUNS, {"ids": ids, "terminal": _TERMINAL_STATUSES})]
    return {
        table: int(conn.execute(stmt, {"ids": locked}).rowcount)
        for table, stmt in _DELETE_CHILDREN.items()
    }


# -- 4. ledger --------------------------------------------------------------------------


def delete_ledger(conn: Connection, *, keep_s: float, batch: int) -> int:
    """Delete at most ``batch`` ledger rows of whole UTC months that ended ``keep_s``
    ago or more; how many."""
    return int(conn.execute(_DELETE_LEDGER, {"keep": keep_s, "batch": batch}).rowcount)


# -- dry run: what a pass would do --------------------------------------------------------


def count_expirable(conn: Connection, *, keep_s: float) -> int:
    params = {"keep": keep_s, "terminal": _TERMINAL_STATUSES}
    return int(conn.execute(_COUNT_EXPIRABLE, params).scalar_one())


def count_leftovers(conn: Connection) -> int:
    return int(conn.execute(_COUNT_LEFTOVERS).scalar_one())


def count_old(conn: Connection, *, keep_s: float) -> tuple[int, int]:
    """(runs, their messages) that step 3 would delete."""
    old = conn.execute(_COUNT_OLD, {"keep": keep_s, "terminal": _TERMINAL_STATUSES}).one()
    return int(old.runs), int(old.messages)


def count_ledger(conn: Connection, *, keep_s: float) -> int:
    return int(conn.execute(_COUNT_LEDGER, {"keep": keep_s}).scalar_one())
