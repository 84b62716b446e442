"""Chunk kinds and the seq rules of docs/design.md §5.

A run's events carry a contiguous ``seq`` from 0 that never resets. A retry or a
successor that finds earlier output first emits ``reset`` so viewers drop the
partial answer, then keeps counting.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import Enum

from koda_runtime.lifecycle.states import RunStatus


class ChunkKind(str, Enum):
    CHUNK = "chunk"
    RESET = "reset"
    STATUS = "status"
    DONE = "done"
    ERROR = "error"
    CANCELLED = "cancelled"
    # Tool activity of a model run (a call and its result), shown to viewers; not part
    # of the answer text.
    TOOL = "tool"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_KINDS


# The event that ends a run's output, by the terminal status the run ends in.
END_KIND: Mapping[RunStatus, ChunkKind] = {
    RunStatus.DONE: ChunkKind.DONE,
    RunStatus.FAILED: ChunkKind.ERROR,
    RunStatus.CANCELLED: ChunkKind.CANCELLED,
}
# The kinds a run's last event can have: nothing of the run follows one of them. As the
# enum is a str, a wire value ("done") is found in the set too.
TERMINAL_KINDS: frozenset[ChunkKind] = frozenset(END_KIND.values())


def end_kind(status: RunStatus) -> ChunkKind:
    """The kind of the event that ends a run's output when it ends ``status``."""
    try:
        return END_KIND[status]
    except KeyError:
        raise ValueError(f"{status.value} is not a terminal status: no event ends it") from None


SEQ_WIDTH = 10  # zero padding of seq in chunk keys: <run_id>:0000000042
FINAL_SUFFIX = "final"  # <run_id>:final carries a compacted run's whole text


@dataclass(frozen=True)
class Chunk:
    """One output event of a run."""

    run_id: str
    seq: int
    kind: ChunkKind
    content: str
    attempt: int


def chunk_key(run_id: str, seq: int) -> str:
    """The compacted topic's key: ``<run_id>:<seq>`` with seq zero-padded."""
    if seq < 0:
        raise ValueError(f"seq must be >= 0, got {seq}")
    return f"{run_id}:{seq:0{SEQ_WIDTH}d}"


def final_key(run_id: str) -> str:
    """The key of the one record that carries a compacted run's whole text."""
    return f"{run_id}:{FINAL_SUFFIX}"


def split_chunk_key(key: str) -> tuple[str, int | None]:
    """``(run_id, seq)`` of a chunk-topic key; seq is None for a run's final record.

    Raises ValueError for a key that is neither ``<run_id>:<seq>`` nor ``<run_id>:final``.
    """
    run_id, sep, tail = key.rpartition(":")
    if not sep or not run_id:
        raise ValueError(f"not a chunk key: {key[:80]!r}")
    if tail == FINAL_SUFFIX:
        return run_id, None
    if len(tail) != SEQ_WIDTH or not tail.isdigit():
        raise ValueError(f"not a chunk key: {key[:80]!r}")
    return run_id, int(tail)


class SeqCounter:
    """Hands out the next seq of one run, starting where earlier attempts stopped."""

    def __init__(self, next_seq: int) -> None:
        if next_seq < 0:
            raise ValueError(f"next_seq must be >= 0, got {next_seq}")
        self._next = next_seq

    @property
    def next(self) -> int:
        return self._next

    def take(self) -> int:
        seq = self._next
        self._next += 1
        return seq

    def give_back(self, seq: int) -> None:
        """Return the last seq taken (its event was never written)."""
        if seq != self._next - 1:
            raise ValueError(f"only the last seq taken ({self._next - 1}) can be given back")
        self._next = seq


def visible_output(events: Iterable[tuple[int, str, str]]) -> str:
    """The answer a run gave: its ``chunk`` contents after the last ``reset``, by seq.

    ``events`` are ``(seq, kind, content)`` in any order.
    """
    ordered = sorted(events)
    last_reset = max((seq for seq, kind, _ in ordered if kind == ChunkKind.RESET.value), default=-1)
    return "".join(
        content
        for seq, kind, content in ordered
        if kind == ChunkKind.CHUNK.value and seq > last_reset
    )
