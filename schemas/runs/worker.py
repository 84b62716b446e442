"""The worker's writes to the runs table group: claims, transitions, chunks, finishes.

Every write is fenced (schemas/epochs.py): it succeeds only while the partition's
epoch is still the worker's and the run's ``fence`` column is that epoch, and it locks
both rows ``FOR SHARE``, so a new owner's epoch bump or claim waits for an in-flight
write of the old owner to finish and then sees it; afterwards the old owner's writes
match zero rows. A frozen worker that wakes up cannot write.

Every statement works on a whole group of runs (``unnest`` of parallel arrays): a
group of one is a group, so there is one statement per kind of write. Every value is
a bound parameter; status and kind values come from :mod:`koda_runtime.lifecycle`. A
status UPDATE never names its allowed source statuses: it is given the state
machine's edges into its target statuses (:func:`edges`, asked of
``koda_runtime.lifecycle.states``) and moves a row only along one of them.

:class:`RunStore` runs them: its group write sends a group's statements through
psycopg's pipeline on the driver connection (three round trips however many runs).
The worker's executor sees it through the protocols of processors/ports.py.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any, TypeVar

import psycopg
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from koda_runtime.batching import CoalescedReads
from koda_runtime.errors import TransitionRejected
from koda_runtime.lifecycle.chunks import Chunk, ChunkKind
from koda_runtime.lifecycle.handler import Usage
from koda_runtime.lifecycle.ledger import Exceeded, LedgerCall, exceeded
from koda_runtime.lifecycle.states import ACTIVE, OPEN, RunStatus, can_transition
from koda_runtime.schemas import epochs, ledger
from koda_runtime.schemas.db import driver_connection, for_driver, send
from koda_runtime.schemas.epochs import Fence
from koda_runtime.schemas.erasures import user_digest
from koda_runtime.schemas.ledger import PricedCall, insert_calls
from koda_runtime.schemas.memories import MARK_DISTIL

T = TypeVar("T")


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

ERASED = text("SELECT 1 FROM erasures WHERE user_digest = :digest LIMIT 1")


# The group's statements as psycopg takes them (sent on the driver connection).
_LOAD_RUNS = for_driver(LOAD_RUNS)
_MARK_PUBLISHED = for_driver(MARK_PUBLISHED)
_CLAIM = for_driver(CLAIM)
_NEXT_SEQS = for_driver(NEXT_SEQS)
_OWNED = for_driver(OWNED)
_INSERT_CHUNKS = for_driver(INSERT_CHUNKS)
_INSERT_USAGE = for_driver(INSERT_USAGE)
_TRANSITION = for_driver(TRANSITION)
_INSERT_CALLS = for_driver(ledger.INSERT_CALLS)
_MARK_DISTIL = for_driver(MARK_DISTIL)

# What a statement queued in a pipeline gives once the pipeline has synced.
Read = Callable[[], Awaitable[T]]

# Statuses a run can still leave: its successors in the user's order must wait for it.
_OPEN = sorted(s.value for s in OPEN)
# Statuses in which a run is owned by the worker that claimed it.
_ACTIVE = sorted(s.value for s in ACTIVE)


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
    # Calls of the attempt whose usage came since its last batch: their ledger rows,
    # written with the chunks (so under the same fence) as soon as the model reported.
    ledger: Sequence[LedgerCall] = ()

    @property
    def target(self) -> RunStatus | None:
        """The status the batch moves its run to: ``streaming`` with its first output."""
        return RunStatus.STREAMING if self.first_output else None


@dataclass(frozen=True)
class FinishWrite:
    """One run's ending: trailing chunks, usage, ledger rows and the terminal transition,
    written together only while ``fence`` owns the run."""

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
    # A ``done`` run whose memories are to be distilled: its marker is written in the
    # same transaction (processors/memory/distiller.py).
    distil: bool = False

    def __post_init__(self) -> None:
        if not self.status.terminal:
            raise ValueError(f"a finish ends a run; {self.status.value} is not terminal")

    @property
    def target(self) -> RunStatus:
        return self.status


class Batched(list[int]):
    """What a chunk batch wrote: the chunk seqs inserted (the list itself, sorted), the
    ledger rows inserted, priced (``ledger``), and, when it carried ledger rows, the
    user's budget its spend has reached (``spent``: read in the same transaction, after
    them; None when no budget is spent)."""

    def __init__(
        self,
        inserted: Sequence[int],
        ledger: Sequence[PricedCall] = (),
        spent: Exceeded | None = None,
    ) -> None:
        super().__init__(inserted)
        self.ledger = list(ledger)
        self.spent = spent


@dataclass(frozen=True)
class Finished:
    """What a finish wrote: the chunk seqs inserted, each usage row's cost (USD), and
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
GroupResult = Claim | Batched | Finished | Superseded | None


def _all_moved(moved: int, expected: int, targets: Sequence[RunStatus]) -> None:
    if moved != expected:
        names = ", ".join(sorted({t.value for t in targets}))
        raise TransitionRejected(
            f"{expected - moved} of {expected} transitions (to {names}) matched no row"
        )


class RunStore:
    """Every write the worker makes; each is conditional and idempotent.

    Claims, chunk batches and finishes are written only by :meth:`write_group`, for one
    run or for many: there is no single-run variant to drift from it.
    """

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        # Single-statement reads need no transaction: in autocommit they skip the
        # BEGIN and ROLLBACK round trips (two of a run's ~26 before this).
        self.reader = engine.execution_options(isolation_level="AUTOCOMMIT")
        self.observer: SteerObserver | None = None
        self._loads: CoalescedReads[RunRow] = CoalescedReads(self._load_runs)

    def _observe(self, write: ChunkWrite | FinishWrite, steer: RunSteer) -> None:
        if self.observer is not None and steer.changed_for(write):
            self.observer(write.run_id, steer)

    async def bump_epochs(
        self, topic: str, partitions: Sequence[int], worker_id: str
    ) -> dict[int, int]:
        """Take ownership of ``partitions``: their epochs grow by one; returns the new ones
        (schemas/epochs.py)."""
        return await epochs.bump_epochs(self.engine, topic, partitions, worker_id)

    async def holds(self, fence: Fence) -> bool:
        """Whether ``fence`` is still its partition's epoch: no other worker has taken
        the partition since this one did (schemas/epochs.py)."""
        return await epochs.holds(self.engine, fence)

    async def load_run(self, run_id: str) -> RunRow | None:
        """The run's row, or None when there is no such run.

        The runs asked for while a read is in flight are read together by the next one
        (koda/batching.py): a poll's runs cost a statement or two, not one each.
        """
        return await self._loads.get(run_id)

    async def _load_runs(self, ids: list[str]) -> dict[str, RunRow]:
        # An id Postgres text cannot hold (NUL, a lone surrogate: a record's run_id is
        # any string) names no run; sent, it would fail the read of every other run.
        ids = [i for i in ids if _storable(i)]
        if not ids:
            return {}
        async with self.reader.connect() as conn:
            raw = await driver_connection(conn)
            rows = await (await send(raw, _LOAD_RUNS, {"ids": ids, "open": _OPEN})).fetchall()
        return {
            row.id: RunRow(
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
            for row in rows
        }

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
                    UNFINISHED_PREDECESSORS, {"id": run.id, "limit": limit, "open": _OPEN}
                )
            ).all()
        return [
            RunRow(r.id, r.user_id, r.session_id, RunStatus(r.status), r.input, r.attempt, r.fence)
            for r in rows
        ]

    async def record_failure(self, fence: Fence, run_id: str) -> int | None:
        """Count one handler failure of the run (fenced); the new total, or None if fenced out.

        Kept in Postgres so the retry budget survives a handoff: a successor that resumes
        the run knows how many attempts really failed.
        """
        params = {
            "topic": fence.topic,
            "partition": fence.partition,
            "epoch": fence.epoch,
            "run_id": run_id,
            "active": _ACTIVE,
        }
        async with self.engine.begin() as conn:
            row = (await conn.execute(RECORD_FAILURE, params)).first()
            return None if row is None else int(row.failures)

    async def write_group(self, writes: Sequence[GroupWrite]) -> list[GroupResult]:
        """Claims, chunk batches, finishes and published marks of one or more runs, in
        one transaction.

        At most eight statements however many runs: the published marks (unfenced, see
        :class:`PublishedWrite`), the claims and their next seqs, the ownership check,
        the chunks, the usage and the ledger rows, and one transition statement for
        every run entering ``streaming`` or a terminal status. They take three round
        trips: the marks, the claims, their next seqs and the ownership check are sent
        together in pipeline mode (psycopg's, on the driver connection under the
        SQLAlchemy one: the same transaction), then the chunks, the usage, the
        transitions and the ledger rows, then COMMIT. Per write: a
        :class:`Claim` for a claim (``→ running``, ``attempt + 1``; None if someone
        moved first or it is fenced out); the seqs inserted for a chunk batch (ON
        CONFLICT DO NOTHING; with ``first_output`` the run moves ``running →
        streaming`` with it) and the ledger rows of the calls it carries, as a
        :class:`Batched`; for a finish, the trailing chunks, usage, ledger rows and
        the terminal transition as a :class:`Finished` (with ``first_output`` the same
        UPDATE sets ``first_chunk_at``: ``streaming`` would be visible to nobody), or a
        :class:`Superseded` when a cancel request or a merge refuses it; None for a
        mark, or for a part whose run is fenced out: that part is not written, the
        others are.

        The ownership check locks the run's row ``FOR SHARE``: a cancel or a merge
        committing meanwhile waits for this transaction, then finds the run terminal;
        one committed before it is seen here. Ownership rows are locked in (partition,
        run) order, the order in which an epoch bump takes them, so a group and a bump
        cannot deadlock. Raises :class:`koda_runtime.errors.TransitionRejected` when a
        transition matches no row (nothing of the group is written); the group writer
        then writes each part as a group of its own, where only that run fails. A group
        must not name a run twice.
        """
        claims = [w for w in writes if isinstance(w, ClaimWrite)]
        marks = [w for w in writes if isinstance(w, PublishedWrite)]
        parts = [w for w in writes if isinstance(w, ChunkWrite | FinishWrite)]
        async with self.engine.begin() as conn:
            # The group's statements go to psycopg directly, on the connection (and in
            # the transaction) of ``conn``, in pipeline mode: those that need nothing
            # of each other's results share one round trip.
            raw = await driver_connection(conn)
            async with raw.pipeline():
                if marks:
                    await _mark_published(raw, marks)
                claiming = await _claim(raw, claims) if claims else None
                owning = await _owned(raw, parts) if parts else None
            claimed = await claiming() if claiming is not None else {}
            refused: dict[str, Superseded] = {}
            mine: list[ChunkWrite | FinishWrite] = []
            for part, steer in await owning() if owning is not None else []:
                self._observe(part, steer)
                no = steer.supersedes(part)
                if no is None:
                    mine.append(part)
                else:
                    refused[part.run_id] = no
            finishes = [w for w in mine if isinstance(w, FinishWrite)]
            async with raw.pipeline():
                inserting = await _insert_chunks(raw, mine)
                pricing = await _insert_usage(raw, finishes)
                moving = await _transition(raw, mine)
                billing = await _insert_calls(raw, [c for w in mine for c in w.ledger])
                if marks_due := [w.run_id for w in finishes if w.distil]:
                    await send(raw, _MARK_DISTIL, {"ids": marks_due})
                spending = await _spent_budgets(raw, [w for w in mine if w not in finishes])
            inserted = await inserting()
            costs = await pricing()
            await moving()
            priced = await billing()
            spent = await spending()
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
                        inserted[w.run_id],
                        costs.get(w.run_id, {}),
                        [p for p in priced if p.run_id == w.run_id],
                    )
                )
            else:
                run_priced = [p for p in priced if p.run_id == w.run_id]
                by = spent.get(w.ledger[0].user_id) if w.ledger else None
                out.append(Batched(inserted[w.run_id], run_priced, by))
        return out

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

    async def messages(self, run_id: str, below: int | None = None) -> list[Chunk]:
        """The run's messages in seq order (only those with seq < ``below`` if given)."""
        async with self.reader.connect() as conn:
            rows = await conn.execute(MESSAGES, {"id": run_id, "below": below})
            return [
                Chunk(run_id, int(r.seq), ChunkKind(r.kind), r.content, r.attempt) for r in rows
            ]

    async def erased(self, user_id: str) -> bool:
        """Whether an erasure of ``user_id`` was recorded (schemas/erasures.py). Asked
        only of a record whose run has no row."""
        async with self.reader.connect() as conn:
            row = await conn.execute(ERASED, {"digest": user_digest(user_id)})
            return row.first() is not None


async def _mark_published(
    raw: psycopg.AsyncConnection[Any], marks: Sequence[PublishedWrite]
) -> None:
    ordered = sorted(marks, key=lambda w: w.run_id)  # one lock order for every writer
    await send(
        raw,
        _MARK_PUBLISHED,
        {"ids": [w.run_id for w in ordered], "seqs": [w.seq for w in ordered]},
    )


async def _claim(
    raw: psycopg.AsyncConnection[Any], claims: Sequence[ClaimWrite]
) -> Read[dict[str, Claim]]:
    """The claims that succeeded, by run, each with the run's next seq.

    The next seqs are asked for every claimed run, won or not, so that both statements
    share the pipeline; a statement under READ COMMITTED sees what the claim's row locks
    waited for, as when it was sent after the claim's answer."""
    ids = [w.run_id for w in claims]
    claiming = await send(
        raw,
        _CLAIM,
        {
            "ids": ids,
            "topics": [w.fence.topic for w in claims],
            "parts": [w.fence.partition for w in claims],
            "epochs": [w.fence.epoch for w in claims],
            "workers": [w.worker_id for w in claims],
            "to": RunStatus.RUNNING.value,
            **edges([RunStatus.RUNNING]),
        },
    )
    seqs = await send(raw, _NEXT_SEQS, {"ids": ids, "chunk": ChunkKind.CHUNK.value})

    async def read() -> dict[str, Claim]:
        won = {r.id: r for r in await claiming.fetchall()}
        out = {}
        for run_id, next_seq, chunks in await seqs.fetchall():
            row = won.get(run_id)
            if row is None:
                continue
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

    return read


async def _owned(
    raw: psycopg.AsyncConnection[Any], parts: Sequence[ChunkWrite | FinishWrite]
) -> Read[list[tuple[ChunkWrite | FinishWrite, RunSteer]]]:
    """The parts whose fences still own their runs, each with its run's steer."""
    owned = await send(
        raw,
        _OWNED,
        {
            "topics": [w.fence.topic for w in parts],
            "parts": [w.fence.partition for w in parts],
            "epochs": [w.fence.epoch for w in parts],
            "ids": [w.run_id for w in parts],
            "active": _ACTIVE,
        },
    )

    async def read() -> list[tuple[ChunkWrite | FinishWrite, RunSteer]]:
        return [
            (parts[int(i) - 1], RunSteer(bool(cancel), reason, int(version)))
            for i, cancel, reason, version in await owned.fetchall()
        ]

    return read


async def _insert_calls(
    raw: psycopg.AsyncConnection[Any], calls: Sequence[LedgerCall]
) -> Read[list[PricedCall]]:
    """Price and write the ledger rows of ``calls`` (schemas/ledger.py, the statement
    every writer of the ledger uses); those written, priced."""
    rows = await send(raw, _INSERT_CALLS, ledger.calls_params(calls)) if calls else None

    async def read() -> list[PricedCall]:
        return ledger.priced_calls(await rows.fetchall()) if rows is not None else []

    return read


async def _spent_budgets(
    raw: psycopg.AsyncConnection[Any], batches: Sequence[ChunkWrite | FinishWrite]
) -> Read[dict[str, Exceeded]]:
    """The budgets spent now (koda_runtime.lifecycle.ledger.exceeded, admission's rule)
    of the users whose chunk batches carry ledger rows, by user: read after those rows
    added their cost, in the same transaction. A run streaming past its user's budget
    stops there (processors/streaming.py)."""
    users = sorted({c.user_id for w in batches for c in w.ledger})
    rows = await send(raw, ledger.BUDGETS_OF_DRIVER, {"users": users}) if users else None

    async def read() -> dict[str, Exceeded]:
        if rows is None:
            return {}
        now = datetime.now(UTC)
        reads = ledger.budget_reads(await rows.fetchall())
        return {u: by for u, r in reads.items() if (by := exceeded(r.state, now)) is not None}

    return read


async def _insert_chunks(
    raw: psycopg.AsyncConnection[Any], parts: Sequence[ChunkWrite | FinishWrite]
) -> Read[dict[str, list[int]]]:
    """Insert the parts' chunks idempotently; the seqs actually inserted, by run, sorted
    (every part has an entry, empty when nothing was new)."""
    chunks = [c for w in parts for c in w.chunks]
    rows = None
    if chunks:
        rows = await send(
            raw,
            _INSERT_CHUNKS,
            {
                "ids": [c.run_id for c in chunks],
                "seqs": [c.seq for c in chunks],
                "kinds": [c.kind.value for c in chunks],
                "contents": [c.content for c in chunks],
                "attempts": [c.attempt for c in chunks],
            },
        )

    async def read() -> dict[str, list[int]]:
        inserted: dict[str, list[int]] = {w.run_id: [] for w in parts}
        for run_id, seq in await rows.fetchall() if rows is not None else []:
            inserted[run_id].append(int(seq))
        return {run_id: sorted(seqs) for run_id, seqs in inserted.items()}

    return read


async def _insert_usage(
    raw: psycopg.AsyncConnection[Any], finishes: Sequence[FinishWrite]
) -> Read[dict[str, dict[int, Decimal]]]:
    """The usage rows of ``finishes``, priced; the costs of the rows inserted, by run and
    call index."""
    calls = [(w.run_id, i, u) for w in finishes for i, u in enumerate(w.usage)]
    rows = None
    if calls:
        rows = await send(
            raw,
            _INSERT_USAGE,
            {
                "ids": [r for r, _, _ in calls],
                "idx": [i for _, i, _ in calls],
                "models": [u.model for _, _, u in calls],
                "pt": [u.prompt_tokens for _, _, u in calls],
                "ct": [u.completion_tokens for _, _, u in calls],
            },
        )

    async def read() -> dict[str, dict[int, Decimal]]:
        costs: dict[str, dict[int, Decimal]] = {}
        for run_id, index, cost in await rows.fetchall() if rows is not None else []:
            costs.setdefault(run_id, {})[int(index)] = cost
        return costs

    return read


async def _transition(
    raw: psycopg.AsyncConnection[Any], parts: Sequence[ChunkWrite | FinishWrite]
) -> Read[None]:
    """Move every part's run that changes status (a first output, a finish) in one UPDATE;
    reading it raises TransitionRejected when a move matched no row."""
    moves = [(w, target) for w in parts if (target := w.target) is not None]
    targets = [t for _, t in moves]
    moved = None
    if moves:
        moved = await send(
            raw,
            _TRANSITION,
            {
                "ids": [w.run_id for w, _ in moves],
                "epochs": [w.fence.epoch for w, _ in moves],
                "targets": [t.value for t in targets],
                "terminals": [t.terminal for t in targets],
                "errors": [w.error if isinstance(w, FinishWrite) else None for w, _ in moves],
                "firsts": [w.first_output for w, _ in moves],
                **edges(targets),
            },
        )

    async def read() -> None:
        if moved is not None:
            _all_moved(len(await moved.fetchall()), len(moves), targets)

    return read


def _storable(text: str) -> bool:
    """Whether Postgres text can hold ``text``: no NUL, and valid UTF-8 once encoded."""
    if "\x00" in text:
        return False
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True
