"""Chunk kinds and the seq rules of docs/design.md §5.

A run's events carry a contiguous ``seq`` from 0 that never resets. A retry or a
successor that finds earlier output first emits ``reset`` so viewers drop the
partial answer, then keeps counting.
"""

from __future__ import annotations

import re
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
    # A tool call that waits for a person (JSON: call_id, name, arguments, step); the run
    # is `waiting` until POST /v1/runs/{id}/approve or /reject (gateway/approvals.py).
    APPROVAL_REQUIRED = "approval_required"

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


# The most UTF-8 bytes one chunk's content holds. A longer text chunk is written as
# several chunks of the same kind with consecutive seqs (:func:`split_content`); any
# other kind (a tool event is one JSON value) over it ends the run ``failed``. As a
# ``run.chunk/1`` record (JSON, escapes included) a chunk stays far below the
# producer's 1 MiB request limit.
MAX_CHUNK_BYTES = 64 * 1024

# What Postgres text and UTF-8 cannot hold: NUL and surrogate code points (a Python str
# can carry lone ones). :func:`storable` replaces each by U+FFFD.
_UNSTORABLE = re.compile(r"[\x00\ud800-\udfff]")
REPLACEMENT_CHAR = "\ufffd"


def storable(text: str) -> str:
    """``text`` with every NUL and surrogate code point replaced by U+FFFD: what Postgres
    text and a UTF-8 record can hold. Handler output is cleaned once, before batching."""
    return _UNSTORABLE.sub(REPLACEMENT_CHAR, text)


def split_content(text: str, limit: int = MAX_CHUNK_BYTES) -> list[str]:
    """``text`` cut into pieces of at most ``limit`` UTF-8 bytes, between code points;
    joined, the pieces are ``text``. ``text`` must be :func:`storable`."""
    if limit < 4:
        raise ValueError(f"limit must hold one code point (4 bytes), got {limit}")
    if len(text) * 4 <= limit:  # no code point is longer than 4 bytes
        return [text]
    data = text.encode()
    if len(data) <= limit:
        return [text]
    pieces = []
    start = 0
    while start < len(data):
        end = min(start + limit, len(data))
        while end < len(data) and data[end] & 0xC0 == 0x80:  # inside a code point
            end -= 1
        pieces.append(data[start:end].decode())
        start = end
    return pieces


def content_bytes(text: str) -> int:
    """The UTF-8 size of a storable ``text``."""
    return len(text) if text.isascii() else len(text.encode())


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

    def rewind(self, seq: int) -> None:
        """Return every seq taken from ``seq`` on (none of their events was written)."""
        if not 0 <= seq <= self._next:
            raise ValueError(f"cannot rewind to {seq}: the next seq is {self._next}")
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
