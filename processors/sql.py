"""The SQL text of the worker's run store (processors/store.py), in one place.

Every statement works on a whole group of runs (``unnest`` of parallel arrays): a
group of one is a group, so there is one statement per kind of write. Every value is
a bound parameter; status and kind values come from :mod:`koda_runtime.lifecycle`.

A status UPDATE never names its allowed source statuses: it is given the state
machine's edges into its target statuses (:func:`edges`, asked of
``koda_runtime.lifecycle.states``) and moves a row only along one of them.
"""

from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy import text

from koda_runtime.lifecycle.states import RunStatus, can_transition


def edges(targets: Iterable[RunStatus]) -> dict[str, list[str]]:
    """The state machine's edges into ``targets``: the ``edge_from`` / ``edge_to``
    parameters of a status UPDATE (a row moves only along one of them)."""
    pairs = sorted(
        (src.value, dst.value)
        for dst in set(targets)
        for src in RunStatus
        if can_transition(src, dst)
    )
    return {"edge_from": [s for s, _ in pairs], "edge_to": [d for _, d in pairs]}


BUMP_EPOCHS = text(
    """
    INSERT INTO partition_epochs (topic, partition, epoch, worker_id)
    SELECT :topic, p, 1, :worker FROM unnest(CAST(:parts AS int[])) AS p
    ON CONFLICT (topic, partition) DO UPDATE
       SET epoch = partition_epochs.epoch + 1,
           worker_id = EXCLUDED.worker_id, assigned_at = now()
    RETURNING partition, epoch
    """
)

# The predecessor test rides along: almost always false, and asking it here saves every
# run a second query and connection checkout.
LOAD_RUNS = text(
    """
    SELECT r.id, r.user_id, r.session_id, r.status, r.input, r.attempt, r.fence,
           r.published_seq,
           EXISTS (SELECT 1 FROM runs p WHERE p.user_id = r.user_id
                      AND p.status = ANY(:open)
                      AND (p.created_at, p.id) < (r.created_at, r.id)) AS older_unfinished
      FROM runs r WHERE r.id = ANY(CAST(:ids AS text[]))
    """
)

UNFINISHED_PREDECESSORS = text(
    """
    SELECT p.id, p.user_id, p.session_id, p.status, p.input, p.attempt, p.fence
      FROM runs r JOIN runs p ON p.user_id = r.user_id
     WHERE r.id = :id AND p.status = ANY(:open)
       AND (p.created_at, p.id) < (r.created_at, r.id)
     ORDER BY p.created_at, p.id
     LIMIT :limit
    """
)

RECORD_FAILURE = text(
    """
    UPDATE runs SET failures = COALESCE(failures, 0) + 1
     WHERE id = :run_id AND fence = :epoch AND status = ANY(:active)
       AND EXISTS (SELECT 1 FROM partition_epochs e
                    WHERE e.topic = :topic AND e.partition = :partition
                      AND e.epoch = :epoch FOR SHARE)
    RETURNING failures
    """
)

MESSAGES = text(
    """
    SELECT seq, kind, content, attempt FROM messages
     WHERE run_id = :id AND (CAST(:below AS int) IS NULL OR seq < :below)
     ORDER BY seq
    """
)

# SKIP LOCKED: a row the compactor holds (it locks runs while compacting them) is left
# unmarked rather than holding up the whole group; the completeness pass marks it later.
MARK_PUBLISHED = text(
    """
    WITH free AS (
        SELECT id FROM runs
         WHERE id = ANY(:ids) AND finished_at IS NOT NULL AND published_seq IS NULL
         ORDER BY id
           FOR UPDATE SKIP LOCKED
    )
    UPDATE runs r SET published_seq = q.seq
      FROM unnest(CAST(:ids AS text[]), CAST(:seqs AS int[])) AS q(run_id, seq), free
     WHERE r.id = q.run_id AND r.id = free.id
    """
)

# ``→ running`` with ``attempt + 1`` under the claimer's epoch, which must still be the
# partition's (locked FOR SHARE, so an epoch bump waits for this transaction).
CLAIM = text(
    """
    UPDATE runs r SET status = :to, attempt = r.attempt + 1,
           fence = q.epoch, worker_id = q.worker, partition = q.partition,
           started_at = COALESCE(r.started_at, now())
      FROM unnest(CAST(:ids AS text[]), CAST(:topics AS text[]),
                  CAST(:parts AS int[]), CAST(:epochs AS bigint[]),
                  CAST(:workers AS text[]))
           AS q(run_id, topic, partition, epoch, worker)
     WHERE r.id = q.run_id AND r.fence <= q.epoch
       AND EXISTS (SELECT 1 FROM unnest(CAST(:edge_from AS text[]), CAST(:edge_to AS text[]))
                       AS a(src, dst) WHERE a.src = r.status AND a.dst = :to)
       AND EXISTS (SELECT 1 FROM partition_epochs e
                    WHERE e.topic = q.topic AND e.partition = q.partition
                      AND e.epoch = q.epoch FOR SHARE)
    RETURNING r.id, r.attempt, COALESCE(r.failures, 0) AS failures,
              EXTRACT(EPOCH FROM r.started_at - r.created_at) AS queue_age_s,
              r.input, COALESCE(r.input_version, 0) AS input_version,
              r.cancel_requested_at IS NOT NULL AS cancel_requested, r.cancel_reason
    """
)

# Read after the claim, in its transaction: under READ COMMITTED each statement takes a
# new snapshot, so a previous owner's writes that the claim's row lock waited for are seen.
NEXT_SEQS = text(
    """
    SELECT q.run_id, COALESCE(MAX(m.seq) + 1, 0) AS next_seq,
           COUNT(m.seq) FILTER (WHERE m.kind = :chunk) AS chunks
      FROM unnest(CAST(:ids AS text[])) AS q(run_id)
      LEFT JOIN messages m ON m.run_id = q.run_id
     GROUP BY q.run_id
    """
)

# The parts whose fences still own their runs, locked FOR SHARE in (partition, run)
# order (the order an epoch bump takes them: a group and a bump cannot deadlock), each
# with what its run's row says of cancel and merge.
HOLDS_EPOCH = text(
    """
    SELECT 1 FROM partition_epochs
     WHERE topic = :topic AND partition = :partition AND epoch = :epoch
    """
)

OWNED = text(
    """
    SELECT q.i, r.cancel_requested_at IS NOT NULL AS cancel_requested,
           r.cancel_reason, COALESCE(r.input_version, 0) AS input_version
      FROM unnest(CAST(:topics AS text[]), CAST(:parts AS int[]),
                  CAST(:epochs AS bigint[]), CAST(:ids AS text[]))
           WITH ORDINALITY AS q(topic, partition, epoch, run_id, i)
      JOIN partition_epochs e ON e.topic = q.topic
       AND e.partition = q.partition AND e.epoch = q.epoch
      JOIN runs r ON r.id = q.run_id AND r.fence = q.epoch
       AND r.status = ANY(:active)
     ORDER BY q.partition, q.run_id
       FOR SHARE OF e, r
    """
)

INSERT_CHUNKS = text(
    """
    INSERT INTO messages (run_id, seq, kind, content, attempt)
    SELECT s.run_id, s.seq, s.kind, s.content, s.attempt
      FROM unnest(CAST(:ids AS text[]), CAST(:seqs AS int[]), CAST(:kinds AS text[]),
                  CAST(:contents AS text[]), CAST(:attempts AS int[]))
           AS s(run_id, seq, kind, content, attempt)
    ON CONFLICT (run_id, seq) DO NOTHING
    RETURNING run_id, seq
    """
)

# Each call priced from the newest price of its model in effect (0 without one).
INSERT_USAGE = text(
    """
    INSERT INTO usage (run_id, call_index, model, prompt_tokens, completion_tokens, cost_usd)
    SELECT u.run_id, u.idx, u.model, u.pt, u.ct,
           COALESCE((SELECT (u.pt * p.prompt_usd_per_mtok
                             + u.ct * p.completion_usd_per_mtok) / 1000000
                       FROM prices p
                      WHERE p.model = u.model AND p.effective_from <= now()
                      ORDER BY p.effective_from DESC LIMIT 1), 0)
      FROM unnest(CAST(:ids AS text[]), CAST(:idx AS int[]), CAST(:models AS text[]),
                  CAST(:pt AS int[]), CAST(:ct AS int[]))
           AS u(run_id, idx, model, pt, ct)
    ON CONFLICT (run_id, call_index) DO NOTHING
    RETURNING run_id, call_index, cost_usd
    """
)

# The one transition statement: every run of the group that changes status (its first
# output: → streaming; its finish: → a terminal status) moves in it, under its fence and
# along an edge of the state machine. A terminal move also stamps finished_at and the
# error; the run's first output stamps first_chunk_at.
TRANSITION = text(
    """
    UPDATE runs r SET status = q.target,
           finished_at = CASE WHEN q.terminal THEN now() ELSE r.finished_at END,
           error = CASE WHEN q.terminal THEN q.error ELSE r.error END,
           first_chunk_at = CASE WHEN q.first_output
               THEN COALESCE(r.first_chunk_at, now()) ELSE r.first_chunk_at END
      FROM unnest(CAST(:ids AS text[]), CAST(:epochs AS bigint[]),
                  CAST(:targets AS text[]), CAST(:terminals AS bool[]),
                  CAST(:errors AS text[]), CAST(:firsts AS bool[]))
           AS q(run_id, epoch, target, terminal, error, first_output)
     WHERE r.id = q.run_id AND r.fence = q.epoch
       AND EXISTS (SELECT 1 FROM unnest(CAST(:edge_from AS text[]), CAST(:edge_to AS text[]))
                       AS a(src, dst) WHERE a.src = r.status AND a.dst = q.target)
    RETURNING r.id
    """
)
