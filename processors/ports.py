"""What the worker's executor needs of Postgres and of Kafka, as protocols.

``RunStore`` (schemas/runs/worker.py) and ``Emitter`` (processors/emitter.py) are the
real ones; the unit tests (tests/unit/test_executor.py) run the executor over
in-memory ones, so its rules (retry, give-up, cancel, merge, cut-off, the order of
writes, deliveries and acks) are checked without services.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from koda_runtime.lifecycle.chunks import Chunk
from koda_runtime.lifecycle.ledger import LedgerCall
from koda_runtime.processors.groupcommit import GroupStore
from koda_runtime.schemas.epochs import Fence
from koda_runtime.schemas.ledger import PricedCall
from koda_runtime.schemas.runs.worker import RunRow, SteerObserver


@dataclass(frozen=True)
class Record:
    """The parts of a Kafka message the executor needs (decoupled from Faust)."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: Any


class WorkerStore(GroupStore, Protocol):
    """The run store as the executor uses it: reads, the group write, and the two
    writes outside a group (a failure count, the ledger rows of an attempt that ends
    without a finish)."""

    observer: SteerObserver | None

    async def load_run(self, run_id: str) -> RunRow | None: ...

    async def unfinished_predecessors(self, run: RunRow, limit: int = 50) -> list[RunRow]: ...

    async def record_failure(self, fence: Fence, run_id: str) -> int | None: ...

    async def record_calls(self, calls: Sequence[LedgerCall]) -> list[PricedCall]: ...

    async def messages(self, run_id: str, below: int | None = None) -> list[Chunk]: ...

    async def erased(self, user_id: str) -> bool: ...


class RunOutput(Protocol):
    """The records a run produces: chunks, run events and dead letters. ``chunks`` and
    ``event`` return delivery futures (the run awaits them before its record is acked);
    ``dead_letter`` returns once the broker has the letter of ``record``."""

    async def chunks(
        self, partition: int, chunks: Sequence[Chunk]
    ) -> list[asyncio.Future[Any]]: ...

    async def event(
        self, partition: int, run_id: str, event: str, **fields: Any
    ) -> asyncio.Future[Any]: ...

    async def dead_letter(
        self, record: Record, *, attempts: int, reason: str, error: str
    ) -> None: ...
