"""The batching helper (koda/batching.py) as pure code: each test provokes one of its
failure rules: a failed flush fails every waiter of its batch and not the next batch; a
cancelled waiter neither breaks the flusher nor, when withdrawn, is flushed; the flusher
restarts after it ended; retry-alone isolates the poison item; AGAIN requeues; close()
drains (default) or fails what is pending."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from koda_runtime.batching import AGAIN, Again, Batcher


class Sink:
    """A flush whose batches the test releases one at a time; records each batch."""

    def __init__(self, poison: str | None = None) -> None:
        self.batches: list[list[str]] = []
        self.alone: list[list[str]] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.fail_next: Exception | None = None
        self.poison = poison

    async def flush(self, items: list[str]) -> list[str | BaseException | Again]:
        self.batches.append(items)
        await self.gate.wait()
        if self.fail_next is not None:
            failure, self.fail_next = self.fail_next, None
            raise failure
        if self.poison is not None and self.poison in items:
            raise ValueError(f"cannot store {self.poison!r}")
        return [item.upper() for item in items]

    async def flush_alone(self, items: list[str]) -> list[str | BaseException | Again]:
        self.alone.append(items)
        return await self.flush(items)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def always(exc: Exception, items: Sequence[str]) -> bool:
    return True


async def test_a_failing_flush_fails_every_waiter_of_its_batch_and_not_the_next() -> None:
    sink = Sink()
    batcher: Batcher[str, str] = Batcher(sink.flush, name="t")
    sink.gate.clear()
    first = asyncio.create_task(batcher.submit("a"))
    await settle()
    sink.fail_next = ConnectionError("postgres went away")
    second = [asyncio.create_task(batcher.submit(k)) for k in ("b", "c")]
    await settle()
    sink.gate.set()
    with pytest.raises(ConnectionError, match="went away"):
        await first
    assert [await t for t in second] == ["B", "C"]
    assert sink.batches == [["a"], ["b", "c"]]


async def test_every_waiter_of_a_failed_batch_hears_the_error() -> None:
    sink = Sink()
    batcher: Batcher[str, str] = Batcher(sink.flush, name="t")
    sink.fail_next = RuntimeError("a bug in the flush")
    answers = await asyncio.gather(
        *(batcher.submit(k) for k in ("a", "b", "c")), return_exceptions=True
    )
    assert [type(a) for a in answers] == [RuntimeError] * 3
    assert sink.batches == [["a", "b", "c"]]


async def test_a_flush_returning_too_few_outcomes_fails_its_batch() -> None:
    async def short(items: list[str]) -> Sequence[str]:
        return items[:1]

    batcher: Batcher[str, str] = Batcher(short, name="short")
    answers = await asyncio.gather(batcher.submit("a"), batcher.submit("b"), return_exceptions=True)
    assert all(isinstance(a, RuntimeError) and "1 outcomes" in str(a) for a in answers), answers


async def test_per_item_errors_and_again_are_each_requests_own() -> None:
    tries: dict[str, int] = {}

    async def flush(items: list[str]) -> list[str | BaseException | Again]:
        out: list[str | BaseException | Again] = []
        for item in items:
            tries[item] = tries.get(item, 0) + 1
            if item == "refused":
                out.append(PermissionError("refused"))
            elif item == "later" and tries[item] < 3:
                out.append(AGAIN)
            else:
                out.append(item)
        return out

    batcher: Batcher[str, str] = Batcher(flush, name="t")
    ok, refused, later = await asyncio.gather(
        batcher.submit("ok"),
        batcher.submit("refused"),
        batcher.submit("later"),
        return_exceptions=True,
    )
    assert ok == "ok" and isinstance(refused, PermissionError) and later == "later"
    assert tries == {"ok": 1, "refused": 1, "later": 3}


async def test_a_cancelled_waiter_does_not_break_the_flusher() -> None:
    sink = Sink()
    batcher: Batcher[str, str] = Batcher(sink.flush, name="t")
    sink.gate.clear()
    gone = asyncio.create_task(batcher.submit("gone"))
    stays = asyncio.create_task(batcher.submit("stays"))
    await settle()
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    sink.gate.set()
    assert await stays == "STAYS"
    assert await batcher.submit("next") == "NEXT"  # the flusher still serves
    assert sink.batches == [["gone", "stays"], ["next"]]  # flushed all the same


async def test_a_withdrawn_waiter_not_yet_taken_is_never_flushed() -> None:
    sink = Sink()
    batcher: Batcher[str, str] = Batcher(sink.flush, name="t", withdraw=True)
    sink.gate.clear()
    first = asyncio.create_task(batcher.submit("first"))
    await settle()
    cut = asyncio.create_task(batcher.submit("cut"))
    kept = asyncio.create_task(batcher.submit("kept"))
    await settle()
    assert batcher.queued == ["cut", "kept"]
    cut.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cut
    assert batcher.queued == ["kept"]
    sink.gate.set()
    assert (await first, await kept) == ("FIRST", "KEPT")
    assert sink.batches == [["first"], ["kept"]]


async def test_the_flusher_ends_when_the_queue_is_empty_and_restarts() -> None:
    sink = Sink()
    batcher: Batcher[str, str] = Batcher(sink.flush, name="t")
    assert await batcher.submit("a") == "A"
    first = batcher.flusher
    assert first is not None
    await first  # ended: nothing queued
    assert await batcher.submit("b") == "B"
    assert batcher.flusher is not first
    assert sink.batches == [["a"], ["b"]]


async def test_one_flusher_at_a_time_and_batches_hold_at_most_max_batch() -> None:
    sink = Sink()
    batcher: Batcher[str, str] = Batcher(sink.flush, name="t", max_batch=2)
    sink.gate.clear()
    tasks = [asyncio.create_task(batcher.submit(str(i))) for i in range(5)]
    await settle()
    flusher = batcher.flusher
    more = asyncio.create_task(batcher.submit("5"))
    await settle()
    assert batcher.flusher is flusher  # a request never starts a second flusher
    sink.gate.set()
    assert [await t for t in [*tasks, more]] == [str(i) for i in range(6)]
    assert sink.batches == [["0", "1"], ["2", "3"], ["4", "5"]]


async def test_retry_alone_isolates_the_poison_item() -> None:
    sink = Sink(poison="bad")
    batcher: Batcher[str, str] = Batcher(
        sink.flush, name="t", retry_alone=always, flush_alone=sink.flush_alone
    )
    good, bad, also = await asyncio.gather(
        batcher.submit("good"),
        batcher.submit("bad"),
        batcher.submit("also"),
        return_exceptions=True,
    )
    assert (good, also) == ("GOOD", "ALSO")
    assert isinstance(bad, ValueError) and "'bad'" in str(bad)
    assert sink.alone == [["good"], ["bad"], ["also"]]


async def test_without_retry_alone_the_poison_item_fails_its_whole_batch() -> None:
    """The control case of the test above: the caller's choice is what isolates it."""
    sink = Sink(poison="bad")
    batcher: Batcher[str, str] = Batcher(sink.flush, name="t", retry_alone=lambda exc, items: False)
    answers = await asyncio.gather(
        batcher.submit("good"), batcher.submit("bad"), return_exceptions=True
    )
    assert [type(a) for a in answers] == [ValueError, ValueError]
    assert sink.batches == [["good", "bad"]]


async def test_a_batch_of_one_is_not_retried_alone() -> None:
    sink = Sink(poison="bad")
    batcher: Batcher[str, str] = Batcher(
        sink.flush, name="t", retry_alone=always, flush_alone=sink.flush_alone
    )
    with pytest.raises(ValueError, match="bad"):
        await batcher.submit("bad")
    assert sink.alone == []


async def test_close_drains_what_is_queued_by_default() -> None:
    sink = Sink()
    batcher: Batcher[str, str] = Batcher(sink.flush, name="t", delay_s=0.01)
    batcher.put("a")
    batcher.put("b")
    await batcher.close()
    assert sink.batches == [["a", "b"]]
    assert batcher.waiting == 0


async def test_close_without_drain_fails_the_batch_in_flight_and_the_queue() -> None:
    sink = Sink()
    batcher: Batcher[str, str] = Batcher(
        sink.flush, name="t", closed=lambda: RuntimeError("the test batcher was closed")
    )
    sink.gate.clear()
    flying = asyncio.create_task(batcher.submit("flying"))
    await settle()
    queued = asyncio.create_task(batcher.submit("queued"))
    await settle()
    await batcher.close(drain=False)
    for task in (flying, queued):
        with pytest.raises(RuntimeError, match="test batcher was closed"):
            await task
    assert sink.batches == [["flying"]]
    sink.gate.set()
    assert await batcher.submit("after") == "AFTER"  # a closed batcher starts again


async def test_a_flusher_cancelled_from_outside_cancels_every_waiter() -> None:
    sink = Sink()
    batcher: Batcher[str, str] = Batcher(sink.flush, name="t")
    sink.gate.clear()
    flying = asyncio.create_task(batcher.submit("flying"))
    await settle()
    queued = asyncio.create_task(batcher.submit("queued"))
    await settle()
    assert batcher.flusher is not None
    batcher.flusher.cancel()
    await batcher.close()
    for task in (flying, queued):
        with pytest.raises(asyncio.CancelledError):
            await task
    assert batcher.waiting == 0


def test_a_batch_bound_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="max_batch must be at least 1, got 0"):
        Batcher(Sink().flush, name="t", max_batch=0)
