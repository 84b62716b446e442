"""What :class:`~koda_runtime.client.Client` and :class:`~koda_runtime.client.AsyncClient`
share: headers, bodies, answers, errors, and the state of a followed stream.

No I/O here: the two clients differ only in how they wait.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import httpx

from koda_runtime.errors import KodaError
from koda_runtime.sse import RECONNECT, Event

# The header naming the user a service token acts for (gateway/principal.py).
ON_BEHALF_HEADER = "X-Koda-User"
DEFAULT_TIMEOUT_S = 10.0
# A stream silent for this long is dead (the gateway sends keep-alives every 15 s).
FOLLOW_READ_TIMEOUT_S = 60.0
FOLLOW_DEFAULT_RETRY_S = 1.0
FOLLOW_GIVE_UP_S = 300.0

Input = str | Mapping[str, Any]


class ClientError(KodaError):
    """Every error the client raises."""


class GatewayUnreachable(ClientError):
    """The gateway could not be reached (or, following, not for ``give_up_s``)."""


class ApiError(ClientError):
    """The gateway refused a request: its HTTP ``status`` and koda's error object."""

    def __init__(
        self, status: int, code: str, message: str, field: str | None = None, body: Any = None
    ) -> None:
        where = f" ({field})" if field else ""
        super().__init__(f"HTTP {status} {code}{where}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.field = field
        self.body = body

    @classmethod
    def of(cls, response: httpx.Response) -> ApiError:
        """The error a refused ``response`` (read already) carries."""
        try:
            body = response.json()
            error = body["error"]
            return cls(
                response.status_code,
                str(error["code"]),
                str(error["message"]),
                error.get("field"),
                body,
            )
        except (ValueError, KeyError, TypeError):
            return cls(response.status_code, "http_error", response.text[:200])


@dataclass(frozen=True)
class Accepted:
    """A submitted run (``POST /v1/runs``'s 202): the same key always answers the same run."""

    run_id: str
    status: str
    events_url: str
    merged: bool = False

    @classmethod
    def of(cls, obj: Mapping[str, Any]) -> Accepted:
        return cls(
            str(obj["run_id"]), str(obj["status"]), str(obj["events_url"]), bool(obj.get("merged"))
        )


@dataclass(frozen=True)
class BatchItem:
    """One run of :meth:`Client.submit_batch`: its own key, and (service tokens) its user."""

    input: Input
    idempotency_key: str
    user: str | None = None
    session_id: str | None = None
    metadata: Mapping[str, Any] | None = None
    client_message_id: str | None = None

    def wire(self) -> dict[str, Any]:
        item = run_body(self.input, self.session_id, self.metadata, self.client_message_id)
        item["idempotency_key"] = self.idempotency_key
        if self.user is not None:
            item["user"] = self.user
        return item


@dataclass(frozen=True)
class BatchResult:
    """One item's answer: ``run`` when it was accepted, else ``error``."""

    status: int
    run: Accepted | None = None
    error: ApiError | None = None

    @property
    def ok(self) -> bool:
        return self.run is not None


def headers(token: str, user: str | None) -> dict[str, str]:
    found = {"Authorization": f"Bearer {token}"}
    if user is not None:
        found[ON_BEHALF_HEADER] = user
    return found


def run_body(
    input: Input,
    session_id: str | None,
    metadata: Mapping[str, Any] | None,
    client_message_id: str | None,
) -> dict[str, Any]:
    body: dict[str, Any] = {"input": input if isinstance(input, str) else dict(input)}
    if session_id is not None:
        body["session_id"] = session_id
    if metadata is not None:
        body["metadata"] = dict(metadata)
    if client_message_id is not None:
        body["client_message_id"] = client_message_id
    return body


def batch_body(items: Sequence[BatchItem | Mapping[str, Any]]) -> dict[str, Any]:
    return {"runs": [i.wire() if isinstance(i, BatchItem) else dict(i) for i in items]}


def batch_results(obj: Mapping[str, Any]) -> list[BatchResult]:
    results = []
    for item in obj["runs"]:
        status = int(item["status"])
        if item.get("run") is not None:
            results.append(BatchResult(status, run=Accepted.of(item["run"])))
        else:
            error = item.get("error") or {}
            results.append(
                BatchResult(
                    status,
                    error=ApiError(
                        status,
                        str(error.get("code", "error")),
                        str(error.get("message", "")),
                        error.get("field"),
                        item,
                    ),
                )
            )
    return results


def run_path(run_id: str, tail: str = "") -> str:
    return f"/v1/runs/{quote(run_id, safe='')}{tail}"


def history_request(
    session_id: str | None, status: str | None, limit: int | None, before: str | None
) -> tuple[str, dict[str, str]]:
    """The path and query of a history page: a session's runs, or the user's."""
    params: dict[str, str] = {}
    if limit is not None:
        params["limit"] = str(limit)
    if before is not None:
        params["before"] = before
    if session_id is not None and status is None:
        return f"/v1/sessions/{quote(session_id, safe='')}/runs", params
    if session_id is not None:
        params["session_id"] = session_id
    if status is not None:
        params["status"] = status
    return "/v1/runs", params


class Resume:
    """A followed run's place: the last seq seen, across connections.

    :meth:`see` says what an event means: yield it (and stop after it when it is
    terminal), or reconnect (the gateway cut this viewer).
    """

    def __init__(self, after: int | None, give_up_s: float) -> None:
        self.last = after
        self.retry_s = FOLLOW_DEFAULT_RETRY_S
        self.give_up_s = give_up_s
        self.heard_at = time.monotonic()
        self.ended = False

    def headers(self) -> dict[str, str]:
        found = {"Accept": "text/event-stream"}
        if self.last is not None:
            found["Last-Event-ID"] = str(self.last)
        return found

    def heard(self) -> None:
        self.heard_at = time.monotonic()

    def see(self, event: Event) -> bool:
        """Note ``event``; False for a ``reconnect`` (not for the caller's eyes)."""
        if event.seq is not None:
            self.last = event.seq
        if event.event == RECONNECT:
            return False
        if event.terminal:
            self.ended = True
        return True

    def check_patience(self, base_url: object) -> None:
        """Raise GatewayUnreachable once the gateway has been silent for ``give_up_s``."""
        if time.monotonic() - self.heard_at > self.give_up_s:
            raise GatewayUnreachable(
                f"gave up: no answer from {base_url} for {self.give_up_s:.0f}s"
            )


class StreamOver(Exception):
    """The stream answered 204: the run is over and nothing follows the last seq."""


class RetryableStatus(KodaError):
    """A 5xx answer to a stream: try again after the retry interval."""


def follow_timeout(timeout_s: float) -> httpx.Timeout:
    return httpx.Timeout(timeout_s, read=FOLLOW_READ_TIMEOUT_S)
