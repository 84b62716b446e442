"""Caps on what one user may create or hold, and the answers a capped request gets.

Where a user creates work or holds a resource there is a cap
(docs/decisions/0014-per-user-quotas.md): schedules, open SSE streams (per user and per
gateway), merges into one run and the merged input's size, memories
(processors/memory/store.py), and ``run-now`` goes through the same rate limiter and
caps as ``POST /v1/runs``.

Stores raise :class:`CapReached` (koda/caps.py, a domain refusal: nothing was
written); the HTTP layer answers :func:`limit_reached`'s :class:`LimitReached`, whose
body names the cap:
``{"error": {"code", "message", "field", "limit": {"setting", "cap", "count"}}}``.
A cap the user can only lift by removing something (schedules, merges) is 409; one
that frees itself as time passes or streams close is 429 with ``Retry-After``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import ClientDisconnect, Request

from koda_runtime import metrics
from koda_runtime.caps import BODY_READ, STREAMS, STREAMS_PER_USER, CapReached
from koda_runtime.gateway.errors import BadRequest, GatewayError
from koda_runtime.gateway.intake import read_body

# When a stream slot frees is not known (a stream ends with its run or its client):
# as for the cap on active runs, a few seconds between tries.
STREAMS_RETRY_AFTER_S = 5


class LimitReached(GatewayError):
    """The answer to a capped request; ``error.limit`` names the setting, cap and count."""

    def __init__(
        self,
        message: str,
        *,
        status: int,
        code: str,
        setting: str,
        cap: int,
        count: int,
        field: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        headers = {} if retry_after_s is None else {"Retry-After": str(retry_after_s)}
        super().__init__(message, field=field, code=code, headers=headers)
        self.status = status
        self.setting = setting
        self.cap = cap
        self.count = count

    def body(self) -> dict[str, Any]:
        out = super().body()
        out["error"]["limit"] = {"setting": self.setting, "cap": self.cap, "count": self.count}
        return out


# quota -> (status, code, field) of its answer
_ANSWERS: dict[str, tuple[int, str, str | None]] = {
    "schedules": (409, "too_many_schedules", None),
    "merges": (409, "too_many_merges", None),
    "merged_bytes": (409, "merged_input_too_large", "input"),
}


def limit_reached(exc: CapReached) -> LimitReached:
    """The HTTP answer to ``exc``, counted in ``koda_quota_refusals_total{quota}``."""
    status, code, field = _ANSWERS[exc.quota]
    metrics.QUOTA_REFUSALS.labels(quota=exc.quota).inc()
    return LimitReached(
        exc.message,
        status=status,
        code=code,
        setting=exc.setting,
        cap=exc.cap,
        count=exc.count,
        field=field,
    )


class RequestTimeout(GatewayError):
    """408: the body did not arrive within KODA_BODY_READ_TIMEOUT; the connection closes."""

    status = 408
    code = "request_timeout"

    def __init__(self, timeout_s: float) -> None:
        super().__init__(
            f"the request body did not arrive within {BODY_READ}={timeout_s:g} s",
            field="body",
            headers={"Connection": "close"},
        )


class ClientGone(BadRequest):
    """The client went away before its whole body arrived (400 ``client_disconnected``)."""

    code = "client_disconnected"

    def __init__(self) -> None:
        super().__init__("the client disconnected before sending the whole body", field="body")


async def read_body_within(request: Request, limit: int, timeout_s: float) -> bytes:
    """:func:`read_body` of ``request``, refused with 408 when it takes over ``timeout_s``:
    a client that sends its body slowly holds a connection and a task for that long only.
    Every route reads its body here, so a client that disconnects mid-body is one
    :class:`ClientGone` everywhere."""
    stream: AsyncIterator[bytes] = request.stream()
    try:
        async with asyncio.timeout(timeout_s):
            return await read_body(request.headers.get("content-length"), stream, limit)
    except TimeoutError:
        raise RequestTimeout(timeout_s) from None
    except ClientDisconnect:
        raise ClientGone() from None


class StreamSlot:
    """One open stream's place in :class:`StreamSlots`; :meth:`release` frees it (once)."""

    def __init__(self, slots: StreamSlots, user_id: str) -> None:
        self._slots = slots
        self.user_id = user_id
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._slots._release(self.user_id)


class StreamSlots:
    """Open SSE streams of one gateway, counted per user and in all.

    ``per_user`` and ``total`` are the caps (0: none). In this process only, like the
    rate limiter: behind N gateways a user may hold up to N x ``per_user`` streams.
    """

    def __init__(self, per_user: int, total: int) -> None:
        self.per_user = per_user
        self.total = total
        self.open = 0
        self._by_user: dict[str, int] = {}

    def of(self, user_id: str) -> int:
        """Streams ``user_id`` has open here."""
        return self._by_user.get(user_id, 0)

    def acquire(self, user_id: str) -> StreamSlot:
        """A slot for one more stream of ``user_id``; LimitReached (429) at either cap."""
        mine = self.of(user_id)
        if self.per_user and mine >= self.per_user:
            raise self._refusal(
                "streams_per_user",
                STREAMS_PER_USER,
                self.per_user,
                mine,
                f"you have {mine} event streams open on this gateway and "
                f"{STREAMS_PER_USER}={self.per_user} allows no more: close one, or retry "
                f"after {STREAMS_RETRY_AFTER_S} s",
            )
        if self.total and self.open >= self.total:
            raise self._refusal(
                "streams",
                STREAMS,
                self.total,
                self.open,
                f"this gateway holds {STREAMS}={self.total} event streams, its most: "
                f"retry after {STREAMS_RETRY_AFTER_S} s",
            )
        self._by_user[user_id] = mine + 1
        self.open += 1
        return StreamSlot(self, user_id)

    def _release(self, user_id: str) -> None:
        left = self._by_user.get(user_id, 0) - 1
        if left > 0:
            self._by_user[user_id] = left
        else:
            self._by_user.pop(user_id, None)
        self.open = max(0, self.open - 1)

    @staticmethod
    def _refusal(quota: str, setting: str, cap: int, count: int, message: str) -> LimitReached:
        metrics.QUOTA_REFUSALS.labels(quota=quota).inc()
        return LimitReached(
            message,
            status=429,
            code="too_many_streams",
            setting=setting,
            cap=cap,
            count=count,
            retry_after_s=STREAMS_RETRY_AFTER_S,
        )


def stream_slots(request: Request) -> StreamSlots:
    """The app's :class:`StreamSlots`, made on first use from its components' settings."""
    state = request.app.state
    slots: StreamSlots | None = getattr(state, "stream_slots", None)
    if slots is None:
        settings = state.components.settings
        slots = StreamSlots(settings.max_streams_per_user, settings.max_streams)
        state.stream_slots = slots
    return slots
