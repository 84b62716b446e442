"""In-memory stand-ins for the worker executor's ports (processors/ports.py).

``FakeStore`` keeps the rules the real store keeps in SQL: a claim takes the state
machine's edge into ``running`` under the partition's current epoch; a chunk batch or
a finish is written only while its fence owns an active run, all or nothing per group;
a transition the state machine has no edge for is refused. ``FakeOutput`` records what
is produced, checks that every chunk is in the store before it is produced, and can
hold deliveries back. ``ScriptedHandler`` plays one script per attempt.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace
from decimal import Decimal
from typing import Any

from koda_runtime.errors import TransitionRejected
from koda_runtime.lifecycle.chunks import Chunk, ChunkKind
from koda_runtime.lifecycle.handler import Item, RunContext
from koda_runtime.lifecycle.ledger import LedgerCall
from koda_runtime.lifecycle.states import ACTIVE, RunStatus, can_transition
from koda_runtime.processors.ports import Record
from koda_runtime.schemas.epochs import Fence
from koda_runtime.schemas.ledger import PricedCall
from koda_runtime.schemas.runs.worker import (
    Batched,
    ChunkWrite,
    Claim,
    ClaimWrite,
    Finished,
    GroupResult,
    GroupWrite,
    PublishedWrite,
    RunRow,
    RunSteer,
    SteerObserver,
)

TOPIC = "unit-runs"


@dataclass
class Row:
    id: str
    user_id: str
    status: RunStatus = RunStatus.PENDING
    input: dict[str, Any] = field(default_factory=dict)
    attempt: int = 0
    fence: int = 0
    failures: int = 0
    input_version: int = 0
    cancel_reason: str | None = None
    cancel_requested: bool = False
    published_seq: int | None = None
    error: str | None = None
    usage: dict[int, Any] = field(default_factory=dict)


class FakeStore:
    def __init__(self) -> None:
        self.runs: dict[str, Row] = {}  # in creation order
        self.messages_of: dict[str, dict[int, Chunk]] = {}
        self.epochs: dict[int, int] = {}
        self.ledger: dict[tuple[str | None, int, int], LedgerCall] = {}
        self.observer: SteerObserver | None = None
        self.groups: list[list[GroupWrite]] = []
        self.fail_next_group: Exception | None = None
        self.erased_users: set[str] = set()

    # -- set-up ------------------------------------------------------------------

    def add(self, run_id: str, user_id: str = "u", **fields: Any) -> Row:
        row = Row(run_id, user_id, **fields)
        self.runs[run_id] = row
        self.messages_of[run_id] = {}
        return row

    def own(self, partition: int) -> Fence:
        """Take ``partition`` (its epoch grows by one); the new owner's fence."""
        self.epochs[partition] = self.epochs.get(partition, 0) + 1
        return Fence(TOPIC, partition, self.epochs[partition])

    def kinds(self, run_id: str) -> list[str]:
        return [self.messages_of[run_id][s].kind.value for s in sorted(self.messages_of[run_id])]

    # -- reads -------------------------------------------------------------------

    def _row(self, r: Row) -> RunRow:
        older = [o for o in self._before(r) if o.user_id == r.user_id and not o.status.terminal]
        return RunRow(
            r.id,
            r.user_id,
            "s",
            r.status,
            dict(r.input),
            r.attempt,
            r.fence,
            bool(older),
            r.published_seq,
        )

    def _before(self, r: Row) -> list[Row]:
        order = list(self.runs)
        return [self.runs[i] for i in order[: order.index(r.id)]]

    async def load_run(self, run_id: str) -> RunRow | None:
        r = self.runs.get(run_id)
        return None if r is None else self._row(r)

    async def unfinished_predecessors(self, run: RunRow, limit: int = 50) -> list[RunRow]:
        rows = [
            self._row(o)
            for o in self._before(self.runs[run.id])
            if o.user_id == run.user_id and not o.status.terminal
        ]
        return rows[:limit]

    async def messages(self, run_id: str, below: int | None = None) -> list[Chunk]:
        got = self.messages_of[run_id]
        return [got[s] for s in sorted(got) if below is None or s < below]

    async def erased(self, user_id: str) -> bool:
        return user_id in self.erased_users

    # -- writes outside a group --------------------------------------------------

    def _owns(self, fence: Fence, r: Row) -> bool:
        return (
            self.epochs.get(fence.partition) == fence.epoch
            and r.fence == fence.epoch
            and r.status in ACTIVE
        )

    async def record_failure(self, fence: Fence, run_id: str) -> int | None:
        r = self.runs[run_id]
        if not self._owns(fence, r):
            return None
        r.failures += 1
        return r.failures

    async def record_calls(self, calls: Sequence[LedgerCall]) -> list[PricedCall]:
        return self._insert_calls(calls)

    def _insert_calls(self, calls: Sequence[LedgerCall]) -> list[PricedCall]:
        out = []
        for c in calls:
            key = (c.run_id, c.attempt, c.call_index)
            if key not in self.ledger:
                self.ledger[key] = c
                out.append(PricedCall(c.run_id, c.attempt, c.call_index, Decimal("0.001"), 1))
        return out

    # -- the group write ---------------------------------------------------------

    async def write_group(self, writes: Sequence[GroupWrite]) -> list[GroupResult]:
        self.groups.append(list(writes))
        if self.fail_next_group is not None:
            exc, self.fail_next_group = self.fail_next_group, None
            raise exc
        runs = {i: replace(r, usage=dict(r.usage)) for i, r in self.runs.items()}
        messages = {i: dict(m) for i, m in self.messages_of.items()}
        ledger = dict(self.ledger)
        try:
            return [self._apply(w) for w in writes]
        except Exception:  # all or nothing, as one transaction
            self.runs, self.messages_of, self.ledger = runs, messages, ledger
            raise

    def _apply(self, w: GroupWrite) -> GroupResult:
        if isinstance(w, PublishedWrite):
            r = self.runs.get(w.run_id)
            if r is not None and r.status.terminal and r.published_seq is None:
                r.published_seq = w.seq
            return None
        r = self.runs[w.run_id]
        if isinstance(w, ClaimWrite):
            epoch = w.fence.epoch
            if (
                not can_transition(r.status, RunStatus.RUNNING)
                or r.fence > epoch
                or self.epochs.get(w.fence.partition) != epoch
            ):
                return None
            r.status, r.attempt, r.fence = RunStatus.RUNNING, r.attempt + 1, epoch
            got = self.messages_of[r.id]
            return Claim(
                attempt=r.attempt,
                next_seq=max(got, default=-1) + 1,
                had_output=any(c.kind is ChunkKind.CHUNK for c in got.values()),
                queue_age_s=0.0,
                failures=r.failures,
                input=dict(r.input),
                input_version=r.input_version,
                cancel_requested=r.cancel_requested,
                cancel_reason=r.cancel_reason,
            )
        if not self._owns(w.fence, r):
            return None
        steer = RunSteer(r.cancel_requested, r.cancel_reason, r.input_version)
        if self.observer is not None and steer.changed_for(w):
            self.observer(w.run_id, steer)
        refused = steer.supersedes(w)
        if refused is not None:
            return refused
        got = self.messages_of[r.id]
        inserted = sorted(c.seq for c in w.chunks if c.seq not in got)
        for c in w.chunks:
            got.setdefault(c.seq, c)
        if w.target is not None:
            if not can_transition(r.status, w.target):
                raise TransitionRejected(f"run {r.id}: no edge {r.status.value} → {w.target}")
            r.status = w.target
        if isinstance(w, ChunkWrite):
            return Batched(inserted, self._insert_calls(w.ledger))
        r.error = w.error
        costs = {}
        for i, u in enumerate(w.usage):
            if i not in r.usage:
                r.usage[i] = u
                costs[i] = Decimal(0)
        return Finished(inserted, costs, self._insert_calls(w.ledger))


@dataclass
class Sent:
    what: str  # chunk, event, dead_letter
    run_id: str | None
    fields: dict[str, Any]


class FakeOutput:
    """Records everything produced; with ``hold`` deliveries wait for :meth:`deliver`."""

    def __init__(self, store: FakeStore, *, hold: bool = False) -> None:
        self.store = store
        self.hold = hold
        self.sent: list[Sent] = []
        self.waiting: list[asyncio.Future[Any]] = []

    def _future(self) -> asyncio.Future[Any]:
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        if self.hold:
            self.waiting.append(fut)
        else:
            fut.set_result(None)
        return fut

    def deliver(self) -> None:
        for fut in self.waiting:
            if not fut.done():
                fut.set_result(None)
        self.waiting = []

    async def chunks(self, partition: int, chunks: Sequence[Chunk]) -> list[asyncio.Future[Any]]:
        out = []
        for c in chunks:
            # Postgres first, then the topic: nothing is produced before it is stored.
            assert self.store.messages_of[c.run_id].get(c.seq) == c, f"{c} produced unstored"
            self.sent.append(Sent("chunk", c.run_id, {"seq": c.seq, "kind": c.kind.value}))
            out.append(self._future())
        return out

    async def event(
        self, partition: int, run_id: str, event: str, **fields: Any
    ) -> asyncio.Future[Any]:
        self.sent.append(Sent(event, run_id, fields))
        return self._future()

    async def dead_letter(self, record: Record, **fields: Any) -> None:
        self.sent.append(Sent("dead_letter", None, {**vars(record), **fields}))

    def of(self, run_id: str) -> list[str]:
        """What was produced of the run, in order: chunk kinds and event names."""
        return [
            s.fields["kind"] if s.what == "chunk" else f"{s.what}:{s.fields.get('to', '')}"
            for s in self.sent
            if s.run_id == run_id
        ]

    def letters(self) -> list[dict[str, Any]]:
        return [s.fields for s in self.sent if s.what == "dead_letter"]


Step = Item | BaseException | Callable[[], Any]


class ScriptedHandler:
    """Plays ``scripts[attempt - 1]``: items are yielded, an exception is raised, a
    callable is called (an awaitable it returns is awaited)."""

    name = "scripted"
    model = "m-unit"

    def __init__(self, *scripts: list[Step]) -> None:
        self.scripts = scripts
        self.contexts: list[RunContext] = []

    async def stream(self, ctx: RunContext) -> AsyncIterator[Item]:
        self.contexts.append(ctx)
        for step in self.scripts[min(ctx.attempt, len(self.scripts)) - 1]:
            if isinstance(step, BaseException):
                raise step
            if callable(step):
                result = step()
                if asyncio.iscoroutine(result) or isinstance(result, asyncio.Future):
                    await result
                continue
            yield step

    async def aclose(self) -> None:
        return None
