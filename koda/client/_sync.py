""":class:`Client`: koda's HTTP API over ``httpx.Client``."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
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


class Client:
    """A koda gateway at ``base_url``, with ``token``: a user's own token (``dev:<user>``
    in dev) or a service token acting for ``on_behalf_of`` (sent as ``X-Koda-User``;
    every method also takes ``user=`` for one call).

    Errors: :class:`ApiError` (the gateway refused: status, code, field, message) and
    :class:`GatewayUnreachable`.
    """

    def __init__(
        self,
        base_url: str,
        token: str,
        *,
        on_behalf_of: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.base_url = base_url
        self.token = token
        self.on_behalf_of = on_behalf_of
        self.timeout_s = timeout_s
        self._transport = transport
        self._http = httpx.Client(base_url=base_url, timeout=timeout_s, transport=transport)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _headers(self, user: str | None) -> dict[str, str]:
        return headers(self.token, user if user is not None else self.on_behalf_of)

    def _call(
        self,
        method: str,
        path: str,
        user: str | None,
        extra: Mapping[str, str] | None = None,
        **kwargs: Any,
    ) -> Any:
        sent = self._headers(user) | dict(extra or {})
        try:
            response = self._http.request(method, path, headers=sent, **kwargs)
        except httpx.HTTPError as exc:
            raise GatewayUnreachable(f"cannot reach the gateway at {self.base_url}: {exc}") from exc
        if response.status_code >= 400:
            raise ApiError.of(response)
        return response.json()

    def submit(
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
        return Accepted.of(self._call("POST", "/v1/runs", user, extra, json=body))

    def submit_batch(
        self, items: Sequence[BatchItem | Mapping[str, Any]], *, user: str | None = None
    ) -> list[BatchResult]:
        """Submit many runs at once (``POST /v1/runs/batch``): one result per item."""
        answer = self._call("POST", "/v1/runs/batch", user, json=batch_body(items))
        return batch_results(answer)

    def get(self, run_id: str, *, user: str | None = None) -> dict[str, Any]:
        """The run and its output so far (``GET /v1/runs/{id}``)."""
        run: dict[str, Any] = self._call("GET", run_path(run_id), user)
        return run

    def cancel(
        self, run_id: str, *, reason: str | None = None, user: str | None = None
    ) -> dict[str, Any]:
        """Cancel the run (idempotent); the answer says whether it has ended yet."""
        body = None if reason is None else {"reason": reason}
        answer: dict[str, Any] = self._call("POST", run_path(run_id, "/cancel"), user, json=body)
        return answer

    def history(
        self,
        session_id: str | None = None,
        *,
        status: str | None = None,
        limit: int | None = None,
        before: str | None = None,
        user: str | None = None,
    ) -> dict[str, Any]:
        """A page of runs, newest first: a session's turns, or all the user's runs
        (``{"runs": [...], "next_before": ...}``; pass ``next_before`` as ``before``)."""
        path, params = history_request(session_id, status, limit, before)
        page: dict[str, Any] = self._call("GET", path, user, params=params)
        return page

    def follow(
        self,
        run_id: str,
        *,
        after: int | None = None,
        user: str | None = None,
        give_up_s: float = FOLLOW_GIVE_UP_S,
        on_retry: OnRetry | None = None,
    ) -> Iterator[Event]:
        """The run's events (after seq ``after``) until its terminal event.

        A dropped connection, a 5xx or the gateway's ``reconnect`` is resumed with
        ``Last-Event-ID``: no event is repeated or skipped. ``on_retry(error, last_seq)``
        hears of each lost connection. Raises :class:`ApiError` for a refusal (404: not
        the user's run) and :class:`GatewayUnreachable` after ``give_up_s`` without any
        answer.
        """
        resume = Resume(after, give_up_s)
        with httpx.Client(
            base_url=self.base_url,
            timeout=follow_timeout(self.timeout_s),
            transport=self._transport,
        ) as http:
            while True:
                try:
                    yield from self._stream_once(http, run_id, user, resume)
                    if resume.ended:
                        return
                except (httpx.HTTPError, RetryableStatus) as exc:
                    if on_retry is not None:
                        on_retry(exc, resume.last)
                except StreamOver:
                    return
                resume.check_patience(self.base_url)
                time.sleep(resume.retry_s)

    def _stream_once(
        self, http: httpx.Client, run_id: str, user: str | None, resume: Resume
    ) -> Iterator[Event]:
        sent = self._headers(user) | resume.headers()
        with http.stream("GET", run_path(run_id, "/events"), headers=sent) as response:
            resume.heard()
            if response.status_code == 204:
                raise StreamOver  # over, and nothing follows the last seq we have
            if response.status_code >= 500:
                raise RetryableStatus(f"HTTP {response.status_code}")
            if response.status_code >= 400:
                response.read()
                raise ApiError.of(response)
            parser = EventParser()
            for chunk in response.iter_bytes():
                resume.heard()
                for event in parser.feed(chunk):
                    if parser.retry is not None:
                        resume.retry_s = parser.retry / 1000.0
                    if not resume.see(event):
                        return  # the gateway cut this viewer: reconnect
                    yield event
                    if resume.ended:
                        return


__all__ = ["Client"]
