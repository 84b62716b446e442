"""The decoder drops an erased user's records (topics/replay/erased.py): the trigger, the
records of its runs (known from the trigger, a usage record or beforehand), and keeps
the ledger's calls under the pseudonym; other users' records are untouched."""

from __future__ import annotations

from typing import Any

from koda_runtime.lifecycle.ids import uuid7
from koda_runtime.schemas.erasures import pseudonym, user_digest
from koda_runtime.topics.catalogue import RUN_CHUNKS
from koda_runtime.topics.replay import tables as t
from koda_runtime.topics.replay.erased import Erased
from koda_runtime.topics.replay.rows import RecordDecoder, RowBatch
from tests.unit.replay_records import AT, NAMES, PRICES, chunk, letter, requested, transition, usage


def decode_with(erased: Erased, *messages: Any) -> RowBatch:
    batch = RowBatch()
    decoder = RecordDecoder(NAMES, PRICES, erased=erased)
    for m in messages:
        decoder.add(m, batch)
    return batch


def history(run: str, user: str, n: int) -> list[Any]:
    at = 10 * n
    return [
        requested(at, run, user),
        transition(at + 1, run, "running", 1, AT, worker="w1"),
        chunk(at, run, 0, "chunk", f"{user} text"),
        chunk(at + 1, run, 1, "done", "{}"),
        usage(at + 2, run, 0, 2, 5, AT, user_id=user, attempt=1),
        letter(n, run, user, "unknown_run"),
    ]


def test_an_erased_users_records_are_dropped_and_the_ledger_keeps_a_pseudonym() -> None:
    bob, alice = uuid7(), uuid7()
    erased = Erased(frozenset({user_digest("bob")}))
    batch = decode_with(erased, *history(bob, "bob", 0), *history(alice, "alice", 1))
    for table in t.TABLES:
        rows = batch.rows_of(table)
        if table is t.LEDGER:
            users = {r[0]: r[4] for r in rows}
            assert users == {bob: pseudonym("bob"), alice: "alice"}
            continue
        assert all(bob not in r and "bob" not in r for r in rows), (table.name, rows)
    assert {r[0] for r in batch.rows_of(t.RUNS)} == {alice}
    assert {r[0] for r in batch.rows_of(t.CHUNKS)} == {alice}
    assert erased.runs == {bob} and erased.dropped == 6  # its ledger row is not dropped


def test_records_of_an_erased_run_known_beforehand_are_dropped_whatever_comes_first() -> None:
    bob = uuid7()
    erased = Erased(frozenset({user_digest("bob")}), {bob})
    # Its chunks and transition come before its trigger (the topics are read side by side).
    batch = decode_with(erased, *reversed(history(bob, "bob", 0)))
    assert not any(batch.rows_of(x) for x in t.TABLES if x is not t.LEDGER)


def test_nobody_erased_drops_nothing() -> None:
    run = uuid7()
    erased = Erased()
    batch = decode_with(erased, *history(run, "bob", 0))
    assert {r[0] for r in batch.rows_of(t.CHUNKS)} == {run} and erased.dropped == 0
    assert {r[4] for r in batch.rows_of(t.LEDGER)} == {"bob"}


def test_an_erased_runs_chunks_are_dropped_on_the_fast_paths_of_a_poll() -> None:
    """A poll of chunk records only, the topic told by the reader (no record asked):
    decoded in DuckDB or as columns, an erased run's records are still dropped."""
    bob, alice = uuid7(), uuid7()
    poll = [chunk(i, run, i // 2, "chunk", f"t{i}") for i, run in enumerate([bob, alice] * 3)]
    for arrow in (True, False):
        erased = Erased(frozenset({user_digest("bob")}), {bob})
        decoder = RecordDecoder(NAMES, PRICES, arrow_chunks=arrow, erased=erased)
        batch = RowBatch()
        try:
            decoder.add_many(poll, batch, NAMES.topic(RUN_CHUNKS))
        finally:
            decoder.close()
        assert bool(batch.chunk_parts) == arrow  # the fast path it was meant to take
        assert {r[0] for r in batch.rows_of(t.CHUNKS)} == {alice}, arrow
        assert set(batch.chunk_runs) == {alice} and erased.dropped == 3
        assert len(batch) == 6  # every record read counts, dropped or not
