""":class:`AsyncClient`: :class:`~koda_runtime.client.Client`'s methods, awaitable."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

import httpx

from koda_runtime.client._wire import (
    DEFAULT_TIMEOUT_S,
    FOLLOW_GIVE_UP_S,
    Accepted,
    ApiError,
    BatchItem,
    BatchResult,
    GatewayUnreachable,
    Input,
    Resume,
    RetryableStatus,
    StreamOver,
    batch_body,
    batch_results,
    follow_timeout,
    headers,
    history_request,
    run_body,
    run_path,
)
from koda_runtime.sse import Event, EventParser

OnRetry = Callable[[Exception, int | None], None]


class AsyncClient:
    """As :class:`~koda_runtime.client.Client`, over ``httpx.AsyncClient``; ``follow``
    is an async iterator."""

    def __init__(
        self,
        base_url: str,
        token: str,
        *,
        on_behalf_of: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.base_url = base_url
        self.token = token
        self.on_behalf_of = on_behalf_of
        self.timeout_s = timeout_s
        self._transport = transport
        self._http = httpx.AsyncClient(base_url=base_url, timeout=timeout_s, transport=transport)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    def _headers(self, user: str | None) -> dict[str, str]:
        return headers(self.token, user if user is not None else self.on_behalf_of)

    async def _call(
        self,
        method: str,
        path: str,
        user: str | None,
        extra: Mapping[str, str] | None = None,
        **kwargs: Any,
    ) -> Any:
        sent = self._headers(user) | dict(extra or {})
        try:
            response = await self._http.request(method, path, headers=sent, **kwargs)
        except httpx.HTTPError as exc:
            raise GatewayUnreachable(f"cannot reach the gateway at {self.base_url}: {exc}") from exc
        if response.status_code >= 400:
            raise ApiError.of(response)
        return response.json()

    async def submit(
        self,
        input: Input,
        *,
        session_id: str | None = None,
        idempotency_key: str | None = None,
        client_message_id: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        user: str | None = None,
    ) -> Accepted:
        """Submit one run (``POST /v1/runs``); the same key answers the same run."""
        extra = {} if idempotency_key is None else {"Idempotency-Key": idempotency_key}
        body = run_body(input, session_id, metadata, client_message_id)
        return Accepted.of(await self._call("POST", "/v1/runs", user, extra, json=body))

    async def submit_batch(
        self, items: Sequence[BatchItem | Mapping[str, Any]], *, user: str | None = None
    ) -> list[BatchResult]:
        """Submit many runs at once (``POST /v1/runs/batch``): one result per item."""
        answer = await self._call("POST", "/v1/runs/batch", user, json=batch_body(items))
        return batch_results(answer)

    async def get(self, run_id: str, *, user: str | None = None) -> dict[str, Any]:
        """The run and its output so far (``GET /v1/runs/{id}``)."""
        run: dict[str, Any] = await self._call("GET", run_path(run_id), user)
        return run

    async def cancel(
        self, run_id: str, *, reason: str | None = None, user: str | None = None
    ) -> dict[str, Any]:
        """Cancel the run (idempotent); the answer says whether it has ended yet."""
        body = None if reason is None else {"reason": reason}
        answer: dict[str, Any] = await self._call(
            "POST", run_path(run_id, "/cancel"), user, json=body
        )
        return answer

    async def history(
        self,
        session_id: str | None = None,
        *,
        status: str | None = None,
        limit: int | None = None,
        before: str | None = None,
        user: str | None = None,
    ) -> dict[str, Any]:
        """A page of runs, newest first: a session's turns, or all the user's runs."""
        path, params = history_request(session_id, status, limit, before)
        page: dict[str, Any] = await self._call("GET", path, user, params=params)
        return page

    async def follow(
        self,
        run_id: str,
        *,
        after: int | None = None,
        user: str | None = None,
        give_up_s: float = FOLLOW_GIVE_UP_S,
        on_retry: OnRetry | None = None,
    ) -> AsyncIterator[Event]:
        """The run's events until its terminal event, resumed with ``Last-Event-ID``
        across dropped connections (see :meth:`Client.follow`)."""
        resume = Resume(after, give_up_s)
        async with httpx.AsyncClient(
            base_url=self.base_url,
            timeout=follow_timeout(self.timeout_s),
            transport=self._transport,
        ) as http:
            while True:
                try:
                    async for event in self._stream_once(http, run_id, user, resume):
                        yield event
                    if resume.ended:
                        return
                except (httpx.HTTPError, RetryableStatus) as exc:
                    if on_retry is not None:
                        on_retry(exc, resume.last)
                except StreamOver:
                    return
                resume.check_patience(self.base_url)
                await asyncio.sleep(resume.retry_s)

    async def _stream_once(
        self, http: httpx.AsyncClient, run_id: str, user: str | None, resume: Resume
    ) -> AsyncIterator[Event]:
        sent = self._headers(user) | resume.headers()
        async with http.stream("GET", run_path(run_id, "/events"), headers=sent) as response:
            resume.heard()
            if response.status_code == 204:
                raise StreamOver
            if response.status_code >= 500:
                raise RetryableStatus(f"HTTP {response.status_code}")
            if response.status_code >= 400:
                await response.aread()
                raise ApiError.of(response)
            parser = EventParser()
            async for chunk in response.aiter_bytes():
                resume.heard()
                for event in parser.feed(chunk):
                    if parser.retry is not None:
                        resume.retry_s = parser.retry / 1000.0
                    if not resume.see(event):
                        return
                    yield event
                    if resume.ended:
                        return


__all__ = ["AsyncClient"]
