"""Waiting helpers: poll a condition with a deadline instead of sleeping blindly."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Literal, TypeVar

T = TypeVar("T")

# A condition answers its value once it holds, and None or False until then: the wait
# returns that value, so its type is the condition's without the falsy "not yet".
Pending = None | Literal[False]


def wait_until(
    condition: Callable[[], T | Pending],
    *,
    timeout: float = 30.0,
    interval: float = 0.1,
    what: str = "",
) -> T:
    """Return the first truthy value of ``condition()``; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or condition}")
        time.sleep(interval)


async def async_wait_until(
    condition: Callable[[], Awaitable[T | Pending]],
    *,
    timeout: float = 30.0,
    interval: float = 0.1,
    what: str = "",
) -> T:
    """Async twin of :func:`wait_until`."""
    deadline = time.monotonic() + timeout
    while True:
        value = await condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or condition}")
        await asyncio.sleep(interval)


async def loop_until(
    condition: Callable[[], object], *, timeout: float = 5.0, what: str = ""
) -> None:
    """Turn the event loop until an in-memory ``condition()`` holds; fail after ``timeout``.

    For unit tests whose state changes only when other tasks run: it checks every
    millisecond, where :func:`async_wait_until` polls a service."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or condition}")
        await asyncio.sleep(0.001)
