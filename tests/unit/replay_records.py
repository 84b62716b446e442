"""Records as the replay reads them, without a broker: a stand-in for confluent-kafka's
``Message``, builders for every record type koda writes, and ``decode`` into rows."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from koda_runtime.lifecycle.chunks import chunk_key, final_key
from koda_runtime.naming import AppEnv, Names
from koda_runtime.topics.catalogue import RUN_CHUNKS, RUN_EVENTS, RUNS, RUNS_DLQ
from koda_runtime.topics.records.codec import (
    DEAD_LETTER,
    RUN_CHUNK,
    RUN_EVENT,
    RUN_FINAL,
    RUN_REQUESTED,
    FinalRecord,
    RunRequested,
    chunk_value,
    dead_letter_value,
    headers_for,
)
from koda_runtime.topics.replay.prices import Price, PriceBook
from koda_runtime.topics.replay.rows import RecordDecoder, RowBatch

NAMES = Names(AppEnv.DEV, "unit")
TS = 1_764_000_000_000  # 2025-11-24, a record timestamp in ms


@dataclass
class FakeMessage:
    topic_: str
    partition_: int
    offset_: int
    key_: bytes | None
    value_: bytes | None
    headers_: list[tuple[str, bytes]] | None = field(default=None)
    ts: int = TS

    def topic(self) -> str:
        return self.topic_

    def partition(self) -> int:
        return self.partition_

    def offset(self) -> int:
        return self.offset_

    def key(self) -> bytes | None:
        return self.key_

    def value(self) -> bytes | None:
        return self.value_

    def headers(self) -> list[tuple[str, bytes]] | None:
        return self.headers_

    def timestamp(self) -> tuple[int, int]:
        return (1, self.ts)

    def error(self) -> None:
        return None


def requested(offset: int, run_id: str, user: str, created_at: str = "") -> FakeMessage:
    value = RunRequested(run_id, user, f"s-{user}", created_at).encode()
    return FakeMessage(
        NAMES.topic(RUNS), 0, offset, user.encode(), value, headers_for(RUN_REQUESTED)
    )


def event(offset: int, run_id: str, at: str, **fields: Any) -> FakeMessage:
    value = json.dumps({"run_id": run_id, "at": at, **fields}).encode()
    return FakeMessage(
        NAMES.topic(RUN_EVENTS), 1, offset, run_id.encode(), value, headers_for(RUN_EVENT)
    )


def transition(
    offset: int,
    run_id: str,
    to: str,
    attempt: int,
    at: str,
    worker: str | None = None,
    **fields: Any,
) -> FakeMessage:
    extra = {"worker_id": worker, **fields} if worker else dict(fields)
    return event(offset, run_id, at, event="transition", to=to, attempt=attempt, **extra)


def usage(
    offset: int, run_id: str, index: int, pt: int, ct: int, at: str, **extra: Any
) -> FakeMessage:
    return event(
        offset,
        run_id,
        at,
        event="usage",
        call_index=index,
        model="demo-1",
        prompt_tokens=pt,
        completion_tokens=ct,
        **extra,
    )


def chunk(
    offset: int, run_id: str, seq: int, kind: str, content: str, attempt: int = 1
) -> FakeMessage:
    return FakeMessage(
        NAMES.topic(RUN_CHUNKS),
        2,
        offset,
        chunk_key(run_id, seq).encode(),
        chunk_value(run_id, seq, kind, content, attempt),
        headers_for(RUN_CHUNK),
    )


def tombstone(offset: int, run_id: str, seq: int | None) -> FakeMessage:
    key = final_key(run_id) if seq is None else chunk_key(run_id, seq)
    return FakeMessage(
        NAMES.topic(RUN_CHUNKS), 2, offset, key.encode(), None, headers_for(RUN_CHUNK)
    )


def final(offset: int, run_id: str, last_seq: int, end: str, content: str) -> FakeMessage:
    value = FinalRecord(run_id, last_seq, end, '{"status": "done"}', content, 1).encode()
    return FakeMessage(
        NAMES.topic(RUN_CHUNKS),
        2,
        offset,
        final_key(run_id).encode(),
        value,
        headers_for(RUN_FINAL),
    )


def letter(offset: int, run_id: str, user: str, reason: str) -> FakeMessage:
    original = RunRequested(run_id, user, f"s-{user}", "").encode()
    value = dead_letter_value(
        key=user.encode(),
        value=original,
        headers=headers_for(RUN_REQUESTED),
        topic=NAMES.topic(RUNS),
        partition=0,
        offset=9,
        attempts=0,
        reason=reason,
        error="why",
    )
    return FakeMessage(
        NAMES.topic(RUNS_DLQ), 0, offset, user.encode(), value, headers_for(DEAD_LETTER)
    )


PRICES = PriceBook(
    {"demo-1": [Price(datetime(2000, 1, 1, tzinfo=UTC), Decimal("0.15"), Decimal("0.60"))]}
)
AT = "2025-11-24T10:00:00+00:00"


def decode(*messages: Any, prices: PriceBook = PRICES) -> RowBatch:
    batch = RowBatch()
    decoder = RecordDecoder(NAMES, prices)
    for m in messages:
        decoder.add(m, batch)
    return batch
