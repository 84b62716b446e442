"""The worker's Postgres adapter: fenced claims, transitions and chunk writes.

Fencing (DESIGN §6): every assignment of a runs partition bumps
``partition_epochs.epoch``; the worker carries that epoch as its owner token. A
write succeeds only while (a) the partition's epoch is still the worker's and
(b) the run's ``fence`` column is that epoch. Writes take ``FOR SHARE`` locks on
both rows, so a new owner's epoch bump or claim waits for an in-flight write of
the old owner to finish and then sees it; afterwards the old owner's writes
match zero rows. A frozen worker that wakes up cannot write.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from koda.lifecycle.chunks import Chunk
from koda.lifecycle.handler import Usage
from koda.lifecycle.states import ACTIVE, RunStatus, sources_of


@dataclass(frozen=True)
class Fence:
    """The owner token of one partition: carried into every conditional write."""

    topic: str
    partition: int
    epoch: int


@dataclass(frozen=True)
class RunRow:
    id: str
    user_id: str
    session_id: str
    status: RunStatus
    input: dict[str, Any]
    attempt: int
    fence: int
    # Whether the user has an older run still pending (see pending_predecessors).
    older_pending: bool = True


@dataclass(frozen=True)
class Claim:
    attempt: int
    next_seq: int
    had_output: bool
    queue_age_s: float | None = None  # created_at -> started_at (the first claim's)
    failures: int = 0  # handler failures of earlier attempts (not handoffs)


_OWNED = """
    SELECT 1 FROM runs r JOIN partition_epochs e
      ON e.topic = :topic AND e.partition = :partition AND e.epoch = :epoch
     WHERE r.id = :run_id AND r.fence = :epoch AND r.status = ANY(:active)
       FOR SHARE
"""


def _fence_params(fence: Fence, run_id: str) -> dict[str, Any]:
    return {
        "topic": fence.topic,
        "partition": fence.partition,
        "epoch": fence.epoch,
        "run_id": run_id,
        "active": [s.value for s in ACTIVE],
    }


@dataclass(frozen=True)
class Finished:
    """What ``finish`` wrote: the chunk seqs inserted, and each usage row's cost (USD)."""

    inserted: list[int]
    costs: dict[int, Decimal] = field(default_factory=dict)


class RunStore:
    """Every write the worker makes; each is conditional and idempotent."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        # Single-statement reads need no transaction: in autocommit they skip the
        # BEGIN and ROLLBACK round trips (two of a run's ~26 before this).
        self.reader = engine.execution_options(isolation_level="AUTOCOMMIT")

    async def bump_epochs(
        self, topic: str, partitions: Sequence[int], worker_id: str
    ) -> dict[int, int]:
        """Take ownership of ``partitions``: their epochs grow by one; returns the new ones."""
        if not partitions:
            return {}
        async with self.engine.begin() as conn:
            rows = await conn.execute(
                text(
                    """
                    INSERT INTO partition_epochs (topic, partition, epoch, worker_id)
                    SELECT :topic, p, 1, :worker FROM unnest(CAST(:parts AS int[])) AS p
                    ON CONFLICT (topic, partition) DO UPDATE
                       SET epoch = partition_epochs.epoch + 1,
                           worker_id = EXCLUDED.worker_id, assigned_at = now()
                    RETURNING partition, epoch
                    """
                ),
                {"topic": topic, "parts": sorted(partitions), "worker": worker_id},
            )
            return {int(p): int(e) for p, e in rows}

    async def load_run(self, run_id: str) -> RunRow | None:
        async with self.reader.connect() as conn:
            row = (
                await conn.execute(
                    # The predecessor test rides along: almost always false, and asking
                    # it here saves every run a second query and connection checkout.
                    text(
                        "SELECT r.id, r.user_id, r.session_id, r.status, r.input, r.attempt,"
                        " r.fence, EXISTS (SELECT 1 FROM runs p WHERE p.user_id = r.user_id"
                        " AND p.status = 'pending' AND (p.created_at, p.id) < (r.created_at, r.id)"
                        ") AS older_pending FROM runs r WHERE r.id = :id"
                    ),
                    {"id": run_id},
                )
            ).first()
        if row is None:
            return None
        return RunRow(
            row.id,
            row.user_id,
            row.session_id,
            RunStatus(row.status),
            row.input,
            row.attempt,
            row.fence,
            bool(row.older_pending),
        )

    async def pending_predecessors(self, run: RunRow, limit: int = 50) -> list[RunRow]:
        """The user's runs created before ``run`` that are still pending, oldest first.

        Their trigger may be late (a lost publish swept later, or two gateways racing),
        yet the user's order is the order of creation: they run first.
        """
        async with self.reader.connect() as conn:
            rows = (
                await conn.execute(
                    text(
                        """
                        SELECT p.id, p.user_id, p.session_id, p.status, p.input, p.attempt,
                               p.fence
                          FROM runs r JOIN runs p ON p.user_id = r.user_id
                         WHERE r.id = :id AND p.status = 'pending'
                           AND (p.created_at, p.id) < (r.created_at, r.id)
                         ORDER BY p.created_at, p.id
                         LIMIT :limit
                        """
                    ),
                    {"id": run.id, "limit": limit},
                )
            ).all()
        return [
            RunRow(r.id, r.user_id, r.session_id, RunStatus(r.status), r.input, r.attempt, r.fence)
            for r in rows
        ]

    async def claim(self, run_id: str, fence: Fence, worker_id: str) -> Claim | None:
        """``→ running`` with ``attempt + 1`` under ``fence``; None if someone moved first.

        The next seq is read in a second statement of the same transaction: under
        READ COMMITTED it sees any write of a previous owner that the row lock
        made this claim wait for.
        """
        async with self.engine.begin() as conn:
            row = (
                await conn.execute(
                    text(
                        """
                        UPDATE runs SET status = 'running', attempt = attempt + 1,
                               fence = :epoch, worker_id = :worker, partition = :partition,
                               started_at = COALESCE(started_at, now())
                         WHERE id = :run_id AND status = ANY(:sources)
                           AND fence <= :epoch
                           AND EXISTS (SELECT 1 FROM partition_epochs e
                                        WHERE e.topic = :topic AND e.partition = :partition
                                          AND e.epoch = :epoch FOR SHARE)
                        RETURNING attempt, COALESCE(failures, 0) AS failures,
                                  EXTRACT(EPOCH FROM started_at - created_at) AS queue_age_s
                        """
                    ),
                    {
                        **_fence_params(fence, run_id),
                        "worker": worker_id,
                        "sources": [s.value for s in sources_of(RunStatus.RUNNING)],
                    },
                )
            ).first()
            if row is None:
                return None
            nxt = (
                await conn.execute(
                    text(
                        "SELECT COALESCE(MAX(seq) + 1, 0), COUNT(*) FILTER (WHERE kind = 'chunk')"
                        " FROM messages WHERE run_id = :id"
                    ),
                    {"id": run_id},
                )
            ).one()
            return Claim(
                attempt=int(row.attempt),
                next_seq=int(nxt[0]),
                had_output=nxt[1] > 0,
                queue_age_s=None if row.queue_age_s is None else float(row.queue_age_s),
                failures=int(row.failures),
            )

    async def record_failure(self, fence: Fence, run_id: str) -> int | None:
        """Count one handler failure of the run (fenced); the new total, or None if fenced out.

        Kept in Postgres so the retry budget survives a handoff: a successor that resumes
        the run knows how many attempts really failed.
        """
        async with self.engine.begin() as conn:
            row = (
                await conn.execute(
                    text(
                        """
                        UPDATE runs SET failures = COALESCE(failures, 0) + 1
                         WHERE id = :run_id AND fence = :epoch AND status = ANY(:active)
                           AND EXISTS (SELECT 1 FROM partition_epochs e
                                        WHERE e.topic = :topic AND e.partition = :partition
                                          AND e.epoch = :epoch FOR SHARE)
                        RETURNING failures
                        """
                    ),
                    _fence_params(fence, run_id),
                )
            ).first()
            return None if row is None else int(row.failures)

    async def write_chunks(
        self, fence: Fence, run_id: str, chunks: Sequence[Chunk], *, first_output: bool
    ) -> list[int] | None:
        """Insert ``chunks`` (ON CONFLICT DO NOTHING) if still the owner.

        Returns the seqs actually inserted, or None when fenced out. With
        ``first_output`` the run moves ``running → streaming`` in the same transaction.
        """
        async with self.engine.begin() as conn:
            if not await self._owned(conn, fence, run_id):
                return None
            if first_output:
                await self._transition(conn, fence, run_id, RunStatus.STREAMING)
            return await _insert_chunks(conn, run_id, chunks)

    async def finish(
        self,
        fence: Fence,
        run_id: str,
        status: RunStatus,
        final: Sequence[Chunk],
        usage: Sequence[Usage] = (),
        error: str | None = None,
        *,
        first_output: bool = False,
    ) -> Finished | None:
        """Write the trailing chunks, usage and the terminal transition atomically.

        With ``first_output`` (the run's first chunks are among ``final``) the same
        UPDATE sets ``first_chunk_at``: ``streaming`` would be visible to nobody
        inside this transaction. Returns the inserted seqs and the usage costs as
        priced here (so the usage events carry them), or None when fenced out
        (nothing written).
        """
        async with self.engine.begin() as conn:
            if not await self._owned(conn, fence, run_id):
                return None
            inserted = await _insert_chunks(conn, run_id, final) if final else []
            costs: dict[int, Decimal] = {}
            for index, u in enumerate(usage):
                priced = await conn.execute(
                    text(
                        """
                        INSERT INTO usage (run_id, call_index, model, prompt_tokens,
                                           completion_tokens, cost_usd)
                        SELECT :run_id, :idx, :model, :pt, :ct,
                               COALESCE((SELECT (:pt * p.prompt_usd_per_mtok
                                                 + :ct * p.completion_usd_per_mtok) / 1000000
                                           FROM prices p
                                          WHERE p.model = :model AND p.effective_from <= now()
                                          ORDER BY p.effective_from DESC LIMIT 1), 0)
                        ON CONFLICT (run_id, call_index) DO NOTHING
                        RETURNING cost_usd
                        """
                    ),
                    {
                        "run_id": run_id,
                        "idx": index,
                        "model": u.model,
                        "pt": u.prompt_tokens,
                        "ct": u.completion_tokens,
                    },
                )
                row = priced.first()
                if row is not None:
                    costs[index] = row.cost_usd
            await self._transition(
                conn, fence, run_id, status, error=error, first_output=first_output
            )
            return Finished(inserted, costs)

    async def _owned(self, conn: AsyncConnection, fence: Fence, run_id: str) -> bool:
        row = (await conn.execute(text(_OWNED), _fence_params(fence, run_id))).first()
        return row is not None

    async def _transition(
        self,
        conn: AsyncConnection,
        fence: Fence,
        run_id: str,
        to: RunStatus,
        *,
        error: str | None = None,
        first_output: bool = False,
    ) -> None:
        """The one transition function: a conditional UPDATE on expected status and fence.

        ``first_output``: the run's first chunk is written with this transition.
        """
        sets = ["status = :to"]
        if to is RunStatus.STREAMING or first_output:
            sets.append("first_chunk_at = COALESCE(first_chunk_at, now())")
        if to.terminal:
            sets.append("finished_at = now()")
            sets.append("error = :error")
        result = await conn.execute(
            text(
                f"UPDATE runs SET {', '.join(sets)}"  # noqa: S608 - fixed column list
                " WHERE id = :run_id AND status = ANY(:sources) AND fence = :epoch"
            ),
            {
                **_fence_params(fence, run_id),
                "to": to.value,
                "error": error,
                "sources": [s.value for s in sources_of(to)],
            },
        )
        if result.rowcount != 1:
            from koda.errors import TransitionRejected

            raise TransitionRejected(f"run {run_id}: transition to {to.value} matched no row")

    async def fail_unclaimed(self, run_id: str, error: str) -> bool:
        """``pending|running|streaming → failed`` for a run that could not even be claimed."""
        async with self.engine.begin() as conn:
            result = await conn.execute(
                text(
                    "UPDATE runs SET status = 'failed', finished_at = now(), error = :error"
                    " WHERE id = :id AND status = ANY(:sources)"
                ),
                {
                    "id": run_id,
                    "error": error,
                    "sources": [s.value for s in sources_of(RunStatus.FAILED)],
                },
            )
            return bool(result.rowcount)


_INSERT_CHUNKS = text(
    """
    INSERT INTO messages (run_id, seq, kind, content, attempt)
    SELECT :run_id, s.seq, s.kind, s.content, s.attempt
      FROM unnest(CAST(:seqs AS int[]), CAST(:kinds AS text[]),
                  CAST(:contents AS text[]), CAST(:attempts AS int[]))
           AS s(seq, kind, content, attempt)
    ON CONFLICT (run_id, seq) DO NOTHING
    RETURNING seq
    """
)


async def _insert_chunks(conn: AsyncConnection, run_id: str, chunks: Sequence[Chunk]) -> list[int]:
    """Insert ``chunks`` idempotently; return the seqs actually inserted, sorted."""
    rows = await conn.execute(
        _INSERT_CHUNKS,
        {
            "run_id": run_id,
            "seqs": [c.seq for c in chunks],
            "kinds": [c.kind.value for c in chunks],
            "contents": [c.content for c in chunks],
            "attempts": [c.attempt for c in chunks],
        },
    )
    return sorted(int(r[0]) for r in rows)
