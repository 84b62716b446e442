"""Reads by key, coalesced: the keys asked for while one read is in flight are read by
the next one, together.

A poll hands the worker many runs at once, one per partition chain, and each chain
starts by reading its run's row. One statement per run was a connection checkout and a
round trip each. :class:`CoalescedReads` sends the first request at once (no timer, so
a lone read waits for nothing) and the requests that arrive meanwhile in one read
after it, as the group commit does for writes.

Failure mode: a read that fails fails every request of its batch, each with the error
its own read would have raised; the requests queued behind it get a read of their own.
A caller that goes away (cancelled) is skipped when its answer arrives; a reader
cancelled itself (the loop closing) cancels every request still waiting.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

V = TypeVar("V")

MAX_BATCH = 256


class CoalescedReads(Generic[V]):
    """``read(keys)`` returns the values of the keys it found; :meth:`get` is one key's.

    At most ``max_batch`` keys go into one read; more wait for the next.
    """

    def __init__(
        self, read: Callable[[list[str]], Awaitable[dict[str, V]]], *, max_batch: int = MAX_BATCH
    ) -> None:
        self._read = read
        self._max_batch = max_batch
        self._waiting: list[tuple[str, asyncio.Future[V | None]]] = []
        self._reader: asyncio.Task[None] | None = None
        self.reads = 0  # reads sent, for tests and the bench

    async def get(self, key: str) -> V | None:
        """``key``'s value, or None when the read did not find it."""
        answer: asyncio.Future[V | None] = asyncio.get_running_loop().create_future()
        self._waiting.append((key, answer))
        if self._reader is None or self._reader.done():
            self._reader = asyncio.create_task(self._drain(), name="coalesced-reads")
        return await answer

    async def close(self) -> None:
        """Let the reads in flight and queued finish."""
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)

    async def _drain(self) -> None:
        while self._waiting:
            batch = self._waiting[: self._max_batch]
            del self._waiting[: self._max_batch]
            self.reads += 1
            try:
                found = await self._read(sorted({key for key, _ in batch}))
            except asyncio.CancelledError:
                # The reader itself was cancelled (the loop is closing): nobody may wait on.
                for _, answer in batch + self._waiting:
                    answer.cancel()
                self._waiting.clear()
                raise
            except Exception as exc:  # noqa: BLE001 - handed to every request of the batch
                for _, answer in batch:
                    if not answer.done():
                        answer.set_exception(exc)
                continue
            for key, answer in batch:
                if not answer.done():
                    answer.set_result(found.get(key))
