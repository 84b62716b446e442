"""The worker's Postgres adapter: fenced claims, transitions and chunk writes.

Fencing (docs/design.md §6): every assignment of a runs partition bumps
``partition_epochs.epoch``; the worker carries that epoch as its owner token. A
write succeeds only while (a) the partition's epoch is still the worker's and
(b) the run's ``fence`` column is that epoch. Writes take ``FOR SHARE`` locks on
both rows, so a new owner's epoch bump or claim waits for an in-flight write of
the old owner to finish and then sees it; afterwards the old owner's writes
match zero rows. A frozen worker that wakes up cannot write.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from koda.lifecycle.chunks import Chunk, ChunkKind
from koda.lifecycle.handler import Usage
from koda.lifecycle.ledger import LedgerCall
from koda.lifecycle.states import ACTIVE, RunStatus, sources_of
from schemas.ledger import PricedCall, insert_calls


@dataclass(frozen=True)
class Fence:
    """The owner token of one partition: carried into every conditional write."""

    topic: str
    partition: int
    epoch: int


# Statuses a run can still leave: its successors in the user's order must wait for it.
_OPEN_STATUSES = [s.value for s in RunStatus if not s.terminal]


@dataclass(frozen=True)
class RunRow:
    id: str
    user_id: str
    session_id: str
    status: RunStatus
    input: dict[str, Any]
    attempt: int
    fence: int
    # Whether the user has an older run not yet terminal (see unfinished_predecessors).
    older_unfinished: bool = True
    # The terminal seq once every message is known to be on the chunk topic, else None.
    published_seq: int | None = None


@dataclass(frozen=True)
class Claim:
    attempt: int
    next_seq: int
    had_output: bool
    queue_age_s: float | None = None  # created_at -> started_at (the first claim's)
    failures: int = 0  # handler failures of earlier attempts (not handoffs)
    # The input as of this claim (merges change it) and its version; a durable
    # cancel request (the run must end ``cancelled`` without running again).
    input: dict[str, Any] | None = None
    input_version: int = 0
    cancel_requested: bool = False
    cancel_reason: str | None = None


_OWNED = """
    SELECT r.cancel_requested_at IS NOT NULL AS cancel_requested, r.cancel_reason,
           COALESCE(r.input_version, 0) AS input_version
      FROM runs r JOIN partition_epochs e
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
class ChunkWrite:
    """One run's chunk batch, written only while ``fence`` owns the run."""

    fence: Fence
    run_id: str
    chunks: Sequence[Chunk]
    first_output: bool
    # The input version the attempt runs on: a write that finds another one (a merge)
    # or a cancel request tells the store's observer, which stops the attempt.
    input_version: int | None = None


@dataclass(frozen=True)
class FinishWrite:
    """One run's ending, as :meth:`RunStore.finish` writes it: trailing chunks, usage and
    the terminal transition, only while ``fence`` owns the run."""

    fence: Fence
    run_id: str
    status: RunStatus
    chunks: Sequence[Chunk]
    usage: Sequence[Usage] = ()
    error: str | None = None
    first_output: bool = False
    # A ``done`` finish on this input version only: when a merge changed the version
    # it is refused (Superseded), so a run never finishes on stale input.
    input_version: int | None = None
    # The finishing attempt's billable calls, written to the ledger in the same transaction.
    ledger: Sequence[LedgerCall] = ()

    def __post_init__(self) -> None:
        if not self.status.terminal:
            raise ValueError(f"a finish ends a run; {self.status.value} is not terminal")


@dataclass(frozen=True)
class Finished:
    """What ``finish`` wrote: the chunk seqs inserted, each usage row's cost (USD), and
    the ledger rows inserted (priced)."""

    inserted: list[int]
    costs: dict[int, Decimal] = field(default_factory=dict)
    ledger: list[PricedCall] = field(default_factory=list)


@dataclass(frozen=True)
class Superseded:
    """A finish refused because the run's row changed under the attempt: a cancel was
    requested (``cancelled``), or a merge bumped the input version. Nothing was written."""

    cancelled: bool
    cancel_reason: str | None
    input_version: int


@dataclass(frozen=True)
class RunSteer:
    """What a fenced write saw of the run's row: a cancel request and the input version."""

    cancel_requested: bool
    cancel_reason: str | None
    input_version: int

    def supersedes(self, write: ChunkWrite | FinishWrite) -> Superseded | None:
        """The refusal of ``write`` (a finish only), or None when it may be written."""
        if not isinstance(write, FinishWrite):
            return None
        if self.cancel_requested and write.status is not RunStatus.CANCELLED:
            return Superseded(True, self.cancel_reason, self.input_version)
        if (
            write.status is RunStatus.DONE
            and write.input_version is not None
            and write.input_version != self.input_version
        ):
            return Superseded(False, None, self.input_version)
        return None

    def changed_for(self, write: ChunkWrite | FinishWrite) -> bool:
        """Whether the attempt behind ``write`` should stop (for the observer)."""
        if self.cancel_requested:
            return (
                write.status is not RunStatus.CANCELLED if isinstance(write, FinishWrite) else True
            )
        return write.input_version is not None and write.input_version != self.input_version


# Told about every fenced write that found a cancel request or a newer input version:
# (run_id, steer). The worker's control board stops the attempt (a missed signal).
SteerObserver = Callable[[str, RunSteer], None]


@dataclass(frozen=True)
class ClaimWrite:
    """Claim one run (``→ running``, ``attempt + 1``) under ``fence``, as ``worker_id``."""

    fence: Fence
    run_id: str
    worker_id: str
    chunks: Sequence[Chunk] = ()  # a claim writes none; the group writer sizes by this


@dataclass(frozen=True)
class PublishedWrite:
    """Every message of the terminal run ``run_id``, 0..``seq``, is acknowledged on the
    chunk topic. Not fenced: it states a fact about the topic, true whoever produced them."""

    run_id: str
    seq: int
    chunks: Sequence[Chunk] = ()  # writes none; the group writer sizes by this


GroupWrite = ClaimWrite | ChunkWrite | FinishWrite | PublishedWrite
GroupResult = Claim | list[int] | Finished | Superseded | None

# SKIP LOCKED: a row the compactor holds (it locks runs while compacting them) is left
# unmarked rather than holding up the whole group; the completeness pass marks it later.
_MARK_PUBLISHED = text(
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


def _all_moved(moved: int, expected: int, to: RunStatus) -> None:
    if moved != expected:
        from koda.errors import TransitionRejected

        raise TransitionRejected(
            f"{expected - moved} of {expected} transitions to {to.value} matched no row"
        )


class RunStore:
    """Every write the worker makes; each is conditional and idempotent."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        # Single-statement reads need no transaction: in autocommit they skip the
        # BEGIN and ROLLBACK round trips (two of a run's ~26 before this).
        self.reader = engine.execution_options(isolation_level="AUTOCOMMIT")
        self.observer: SteerObserver | None = None

    def _observe(self, write: ChunkWrite | FinishWrite, steer: RunSteer) -> None:
        if self.observer is not None and steer.changed_for(write):
            self.observer(write.run_id, steer)

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
                        " r.fence, r.published_seq,"
                        " EXISTS (SELECT 1 FROM runs p WHERE p.user_id = r.user_id"
                        " AND p.status = ANY(:open)"
                        " AND (p.created_at, p.id) < (r.created_at, r.id)"
                        ") AS older_unfinished FROM runs r WHERE r.id = :id"
                    ),
                    {"id": run_id, "open": _OPEN_STATUSES},
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
            bool(row.older_unfinished),
            row.published_seq,
        )

    async def unfinished_predecessors(self, run: RunRow, limit: int = 50) -> list[RunRow]:
        """The user's runs created before ``run`` that are not terminal, oldest first.

        Their trigger may be late (a lost publish swept later, or two gateways racing),
        yet the user's order is the order of creation: they run first. Not only pending
        ones: a worker that ran such a run as a predecessor and died left it ``running``
        with its trigger still not on the topic, and the partition's next owner must
        resume it before the later run, not after the late trigger finally arrives.
        The caller owns the user's partition, so no live owner runs them meanwhile.
        """
        async with self.reader.connect() as conn:
            rows = (
                await conn.execute(
                    text(
                        """
                        SELECT p.id, p.user_id, p.session_id, p.status, p.input, p.attempt,
                               p.fence
                          FROM runs r JOIN runs p ON p.user_id = r.user_id
                         WHERE r.id = :id AND p.status = ANY(:open)
                           AND (p.created_at, p.id) < (r.created_at, r.id)
                         ORDER BY p.created_at, p.id
                         LIMIT :limit
                        """
                    ),
                    {"id": run.id, "limit": limit, "open": _OPEN_STATUSES},
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
                                  EXTRACT(EPOCH FROM started_at - created_at) AS queue_age_s,
                                  input, COALESCE(input_version, 0) AS input_version,
                                  cancel_requested_at IS NOT NULL AS cancel_requested,
                                  cancel_reason
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
                input=row.input,
                input_version=int(row.input_version),
                cancel_requested=bool(row.cancel_requested),
                cancel_reason=row.cancel_reason,
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
        self,
        fence: Fence,
        run_id: str,
        chunks: Sequence[Chunk],
        *,
        first_output: bool,
        input_version: int | None = None,
    ) -> list[int] | None:
        """Insert ``chunks`` (ON CONFLICT DO NOTHING) if still the owner.

        Returns the seqs actually inserted, or None when fenced out. With
        ``first_output`` the run moves ``running → streaming`` in the same transaction.
        """
        async with self.engine.begin() as conn:
            steer = await self._owned(conn, fence, run_id)
            if steer is None:
                return None
            self._observe(ChunkWrite(fence, run_id, chunks, first_output, input_version), steer)
            if first_output:
                await self._transition(conn, fence, run_id, RunStatus.STREAMING)
            return await _insert_chunks(conn, run_id, chunks)

    async def write_group(self, writes: Sequence[GroupWrite]) -> list[GroupResult]:
        """Several runs' claims, chunk batches and finishes in one transaction.

        At most nine statements however many runs: the published marks (unfenced, see
        :class:`PublishedWrite`), the claims and their next seqs, the ownership check, the
        chunks, the usage and the ledger rows, the first-output and the terminal
        transitions. Per write, the same rule and result as :meth:`claim` (a
        :class:`Claim`), :meth:`write_chunks` (the seqs inserted) or :meth:`finish` (a
        :class:`Finished`), None for a mark, or None when that run could not be claimed
        or is fenced out:
        its part is not written, the others are. Ownership rows are locked ``FOR SHARE``
        in (partition, run) order, the order in which an epoch bump takes them, so a
        group and a bump cannot deadlock. Raises :class:`koda.errors.TransitionRejected`
        when a transition matches no row; the caller then writes each part alone, where
        only that run fails. A group must not name a run twice.
        """
        claims = [w for w in writes if isinstance(w, ClaimWrite)]
        marks = [w for w in writes if isinstance(w, PublishedWrite)]
        parts = [w for w in writes if isinstance(w, ChunkWrite | FinishWrite)]
        async with self.engine.begin() as conn:
            if marks:
                await _mark_published(conn, marks)
            claimed = await _claim_group(conn, claims) if claims else {}
            owned = await _owned_group(conn, parts) if parts else []
            refused: dict[str, Superseded] = {}
            mine: list[ChunkWrite | FinishWrite] = []
            for part, steer in owned:
                self._observe(part, steer)
                no = steer.supersedes(part)
                if no is None:
                    mine.append(part)
                else:
                    refused[part.run_id] = no
            inserted: dict[str, list[int]] = {w.run_id: [] for w in mine}
            chunks = [c for w in mine for c in w.chunks]
            if chunks:
                rows = await conn.execute(
                    _INSERT_CHUNK_GROUP,
                    {
                        "ids": [c.run_id for c in chunks],
                        "seqs": [c.seq for c in chunks],
                        "kinds": [c.kind.value for c in chunks],
                        "contents": [c.content for c in chunks],
                        "attempts": [c.attempt for c in chunks],
                    },
                )
                for run_id, seq in rows:
                    inserted[run_id].append(int(seq))
            finishes = [w for w in mine if isinstance(w, FinishWrite)]
            costs = await _insert_usage_group(conn, finishes)
            priced = await insert_calls(conn, [c for w in finishes for c in w.ledger])
            first = [w for w in mine if isinstance(w, ChunkWrite) and w.first_output]
            if first:
                moved = await conn.execute(
                    text(
                        """
                        UPDATE runs r SET status = :to,
                               first_chunk_at = COALESCE(r.first_chunk_at, now())
                          FROM unnest(CAST(:ids AS text[]), CAST(:epochs AS bigint[]))
                               AS q(run_id, epoch)
                         WHERE r.id = q.run_id AND r.fence = q.epoch
                           AND r.status = ANY(:sources)
                        RETURNING r.id
                        """
                    ),
                    {
                        "ids": [w.run_id for w in first],
                        "epochs": [w.fence.epoch for w in first],
                        "to": RunStatus.STREAMING.value,
                        "sources": [s.value for s in sources_of(RunStatus.STREAMING)],
                    },
                )
                _all_moved(len(moved.all()), len(first), RunStatus.STREAMING)
            if finishes:
                ended = await conn.execute(
                    text(
                        """
                        UPDATE runs r SET status = q.target, finished_at = now(),
                               error = q.error,
                               first_chunk_at = CASE WHEN q.first_output
                                   THEN COALESCE(r.first_chunk_at, now())
                                   ELSE r.first_chunk_at END
                          FROM unnest(CAST(:ids AS text[]), CAST(:epochs AS bigint[]),
                                      CAST(:targets AS text[]), CAST(:errors AS text[]),
                                      CAST(:firsts AS bool[]))
                               AS q(run_id, epoch, target, error, first_output)
                         WHERE r.id = q.run_id AND r.fence = q.epoch
                           AND r.status = ANY(:active)
                        RETURNING r.id
                        """
                    ),
                    {
                        "ids": [w.run_id for w in finishes],
                        "epochs": [w.fence.epoch for w in finishes],
                        "targets": [w.status.value for w in finishes],
                        "errors": [w.error for w in finishes],
                        "firsts": [w.first_output for w in finishes],
                        # Every terminal status may follow any active one (states.ALLOWED).
                        "active": [s.value for s in ACTIVE],
                    },
                )
                _all_moved(len(ended.all()), len(finishes), RunStatus.DONE)
        out: list[GroupResult] = []
        for w in writes:
            if isinstance(w, ClaimWrite):
                out.append(claimed.get(w.run_id))
            elif w.run_id in refused:
                out.append(refused[w.run_id])
            elif isinstance(w, PublishedWrite) or w.run_id not in inserted:
                out.append(None)
            elif isinstance(w, FinishWrite):
                out.append(
                    Finished(
                        sorted(inserted[w.run_id]),
                        costs.get(w.run_id, {}),
                        [p for p in priced if p.run_id == w.run_id],
                    )
                )
            else:
                out.append(sorted(inserted[w.run_id]))
        return out

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
        input_version: int | None = None,
        ledger: Sequence[LedgerCall] = (),
    ) -> Finished | Superseded | None:
        """Write the trailing chunks, usage, ledger rows and the terminal transition
        atomically.

        With ``first_output`` (the run's first chunks are among ``final``) the same
        UPDATE sets ``first_chunk_at``: ``streaming`` would be visible to nobody
        inside this transaction. Returns the inserted seqs and the usage costs as
        priced here (so the usage events carry them), None when fenced out, or
        :class:`Superseded` when a cancel request or a merge refuses it (nothing
        written either way). The ownership check locks the run's row ``FOR SHARE``: a
        cancel or a merge committing meanwhile waits for this transaction, then finds
        the run terminal; one committed before it is seen here.
        """
        write = FinishWrite(
            fence, run_id, status, final, usage, error, first_output, input_version, ledger
        )
        async with self.engine.begin() as conn:
            steer = await self._owned(conn, fence, run_id)
            if steer is None:
                return None
            self._observe(write, steer)
            refused = steer.supersedes(write)
            if refused is not None:
                return refused
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
            calls = await insert_calls(conn, ledger)
            await self._transition(
                conn, fence, run_id, status, error=error, first_output=first_output
            )
            return Finished(inserted, costs, calls)

    async def record_calls(self, calls: Sequence[LedgerCall]) -> list[PricedCall]:
        """Write ledger rows outside any run's fence, in a transaction of their own.

        For attempts that end without a finish (the handler failed, the attempt was cut
        off or fenced out): their calls were made and billed whoever owns the run now,
        and (run, attempt, call index) is unique to this attempt's claim, so the rows
        can never collide with a successor's.
        """
        if not calls:
            return []
        async with self.engine.begin() as conn:
            return await insert_calls(conn, calls)

    async def _owned(self, conn: AsyncConnection, fence: Fence, run_id: str) -> RunSteer | None:
        row = (await conn.execute(text(_OWNED), _fence_params(fence, run_id))).first()
        if row is None:
            return None
        return RunSteer(bool(row.cancel_requested), row.cancel_reason, int(row.input_version))

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

    async def mark_published(self, marks: Sequence[PublishedWrite]) -> None:
        """Record that these terminal runs' messages are all on the chunk topic."""
        async with self.engine.begin() as conn:
            await _mark_published(conn, marks)

    async def messages(self, run_id: str, below: int | None = None) -> list[Chunk]:
        """The run's messages in seq order (only those with seq < ``below`` if given)."""
        async with self.reader.connect() as conn:
            rows = await conn.execute(
                text(
                    "SELECT seq, kind, content, attempt FROM messages WHERE run_id = :id"
                    " AND (CAST(:below AS int) IS NULL OR seq < :below) ORDER BY seq"
                ),
                {"id": run_id, "below": below},
            )
            return [
                Chunk(run_id, int(r.seq), ChunkKind(r.kind), r.content, r.attempt) for r in rows
            ]

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


_INSERT_CHUNK_GROUP = text(
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


async def _mark_published(conn: AsyncConnection, marks: Sequence[PublishedWrite]) -> None:
    ordered = sorted(marks, key=lambda w: w.run_id)  # one lock order for every writer
    await conn.execute(
        _MARK_PUBLISHED, {"ids": [w.run_id for w in ordered], "seqs": [w.seq for w in ordered]}
    )


async def _claim_group(conn: AsyncConnection, claims: Sequence[ClaimWrite]) -> dict[str, Claim]:
    """:meth:`RunStore.claim` for several runs: the claims that succeeded, by run."""
    rows = await conn.execute(
        text(
            """
            UPDATE runs r SET status = 'running', attempt = r.attempt + 1,
                   fence = q.epoch, worker_id = q.worker, partition = q.partition,
                   started_at = COALESCE(r.started_at, now())
              FROM unnest(CAST(:ids AS text[]), CAST(:topics AS text[]),
                          CAST(:parts AS int[]), CAST(:epochs AS bigint[]),
                          CAST(:workers AS text[]))
                   AS q(run_id, topic, partition, epoch, worker)
             WHERE r.id = q.run_id AND r.status = ANY(:sources) AND r.fence <= q.epoch
               AND EXISTS (SELECT 1 FROM partition_epochs e
                            WHERE e.topic = q.topic AND e.partition = q.partition
                              AND e.epoch = q.epoch FOR SHARE)
            RETURNING r.id, r.attempt, COALESCE(r.failures, 0) AS failures,
                      EXTRACT(EPOCH FROM r.started_at - r.created_at) AS queue_age_s,
                      r.input, COALESCE(r.input_version, 0) AS input_version,
                      r.cancel_requested_at IS NOT NULL AS cancel_requested, r.cancel_reason
            """
        ),
        {
            "ids": [w.run_id for w in claims],
            "topics": [w.fence.topic for w in claims],
            "parts": [w.fence.partition for w in claims],
            "epochs": [w.fence.epoch for w in claims],
            "workers": [w.worker_id for w in claims],
            "sources": [s.value for s in sources_of(RunStatus.RUNNING)],
        },
    )
    won = {r.id: r for r in rows}
    if not won:
        return {}
    # As in claim(): read after the UPDATE, so a previous owner's writes that the row
    # lock waited for are seen (READ COMMITTED takes a new snapshot per statement).
    seqs = await conn.execute(
        text(
            """
            SELECT q.run_id, COALESCE(MAX(m.seq) + 1, 0),
                   COUNT(m.seq) FILTER (WHERE m.kind = 'chunk')
              FROM unnest(CAST(:ids AS text[])) AS q(run_id)
              LEFT JOIN messages m ON m.run_id = q.run_id
             GROUP BY q.run_id
            """
        ),
        {"ids": list(won)},
    )
    out = {}
    for run_id, next_seq, chunks in seqs:
        row = won[run_id]
        out[run_id] = Claim(
            attempt=int(row.attempt),
            next_seq=int(next_seq),
            had_output=chunks > 0,
            queue_age_s=None if row.queue_age_s is None else float(row.queue_age_s),
            failures=int(row.failures),
            input=row.input,
            input_version=int(row.input_version),
            cancel_requested=bool(row.cancel_requested),
            cancel_reason=row.cancel_reason,
        )
    return out


async def _owned_group(
    conn: AsyncConnection, parts: Sequence[ChunkWrite | FinishWrite]
) -> list[tuple[ChunkWrite | FinishWrite, RunSteer]]:
    """The parts whose run ``parts``' fences still own, locked ``FOR SHARE`` in
    (partition, run) order, each with what its run's row says of cancel and merge."""
    owned = await conn.execute(
        text(
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
        ),
        {
            "topics": [w.fence.topic for w in parts],
            "parts": [w.fence.partition for w in parts],
            "epochs": [w.fence.epoch for w in parts],
            "ids": [w.run_id for w in parts],
            "active": [s.value for s in ACTIVE],
        },
    )
    return [
        (parts[int(i) - 1], RunSteer(bool(cancel), reason, int(version)))
        for i, cancel, reason, version in owned
    ]


async def _insert_usage_group(
    conn: AsyncConnection, finishes: Sequence[FinishWrite]
) -> dict[str, dict[int, Decimal]]:
    """The usage rows of ``finishes``, priced as :meth:`RunStore.finish` prices them;
    the costs of the rows inserted, by run and call index."""
    calls = [(w.run_id, i, u) for w in finishes for i, u in enumerate(w.usage)]
    if not calls:
        return {}
    rows = await conn.execute(
        text(
            """
            INSERT INTO usage (run_id, call_index, model, prompt_tokens, completion_tokens,
                               cost_usd)
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
        ),
        {
            "ids": [r for r, _, _ in calls],
            "idx": [i for _, i, _ in calls],
            "models": [u.model for _, _, u in calls],
            "pt": [u.prompt_tokens for _, _, u in calls],
            "ct": [u.completion_tokens for _, _, u in calls],
        },
    )
    costs: dict[str, dict[int, Decimal]] = {}
    for run_id, index, cost in rows:
        costs.setdefault(run_id, {})[int(index)] = cost
    return costs


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
