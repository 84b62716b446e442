"""KODA_CHUNK_COALESCE: the text chunks of one batch are one chunk, seq stays gap-free."""

from __future__ import annotations

from typing import Any

from koda_runtime.lifecycle.chunks import ChunkKind, SeqCounter
from koda_runtime.processors.streaming import COALESCE_MAX_CHARS, ChunkBatcher


def batcher(coalesce: bool) -> ChunkBatcher:
    unused: Any = None  # add() and take() touch neither the writer nor the emitter
    return ChunkBatcher(unused, unused, unused, "r", 1, SeqCounter(5), [], 32, coalesce=coalesce)


def test_consecutive_text_chunks_of_a_batch_become_one() -> None:
    b = batcher(True)
    for token in ("Hel", "lo", ", ", "world"):
        b.add(ChunkKind.CHUNK, token)
    b.add(ChunkKind.TOOL, '{"call": "x"}')
    b.add(ChunkKind.CHUNK, "!")
    taken = b.take()
    assert [(c.seq, c.kind, c.content) for c in taken] == [
        (5, ChunkKind.CHUNK, "Hello, world"),
        (6, ChunkKind.TOOL, '{"call": "x"}'),
        (7, ChunkKind.CHUNK, "!"),
    ]
    b.add(ChunkKind.CHUNK, "next batch")  # a new batch starts a new chunk
    assert [(c.seq, c.content) for c in b.take()] == [(8, "next batch")]


def test_without_it_every_token_is_its_own_chunk() -> None:
    b = batcher(False)
    for token in ("a", "b", "c"):
        b.add(ChunkKind.CHUNK, token)
    assert [(c.seq, c.content) for c in b.take()] == [(5, "a"), (6, "b"), (7, "c")]


def test_a_coalesced_chunk_stops_growing_at_its_bound() -> None:
    b = batcher(True)
    b.add(ChunkKind.CHUNK, "x" * (COALESCE_MAX_CHARS - 1))
    b.add(ChunkKind.CHUNK, "yy")
    taken = b.take()
    assert [len(c.content) for c in taken] == [COALESCE_MAX_CHARS - 1, 2]
    assert [c.seq for c in taken] == [5, 6]
