"""A client that leaves mid-body gets one clear refusal on every route: the body reader
(gateway/quotas.py ``read_body_within``) turns Starlette's ClientDisconnect into
``ClientGone`` (400 ``client_disconnected``, naming the body)."""

from __future__ import annotations

from typing import Any

import pytest
from starlette.requests import Request

from koda_runtime.gateway.errors import BadRequest
from koda_runtime.gateway.quotas import ClientGone, read_body_within


def leaving_request() -> Request:
    """A POST whose client sends half of its declared body, then disconnects."""
    messages: list[dict[str, Any]] = [
        {"type": "http.request", "body": b'{"input": ', "more_body": True},
        {"type": "http.disconnect"},
    ]

    async def receive() -> dict[str, Any]:
        return messages.pop(0)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/runs",
        "headers": [(b"content-length", b"40"), (b"content-type", b"application/json")],
    }
    return Request(scope, receive)


async def test_a_client_leaving_mid_body_is_a_clear_400_naming_the_body() -> None:
    with pytest.raises(ClientGone) as caught:
        await read_body_within(leaving_request(), limit=1 << 20, timeout_s=5)
    gone = caught.value
    assert isinstance(gone, BadRequest)
    assert (gone.status, gone.code, gone.field) == (400, "client_disconnected", "body")
    assert "disconnected before sending the whole body" in str(gone)
