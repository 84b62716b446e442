"""koda's Python client: submit runs, follow their output, cancel, read history.

::

    from koda_runtime.client import Client

    with Client("https://koda.example", token, on_behalf_of="u1") as koda:
        run = koda.submit("Summarise my week", idempotency_key="week-42")
        for event in koda.follow(run.run_id):      # resumes by itself on a dropped link
            if event.event == "chunk":
                print(event.json()["content"], end="")

``AsyncClient`` has the same methods, awaitable (``follow`` is an async iterator).
``token`` is a user's own token (``dev:<user>`` in dev) or a service token
(KODA_SERVICE_TOKENS) acting for ``on_behalf_of``. ``koda runs`` uses this client.
"""

from __future__ import annotations

from koda_runtime.client._async import AsyncClient
from koda_runtime.client._sync import Client
from koda_runtime.client._wire import (
    ON_BEHALF_HEADER,
    Accepted,
    ApiError,
    BatchItem,
    BatchResult,
    ClientError,
    GatewayUnreachable,
)
from koda_runtime.sse import Event

__all__ = [
    "ON_BEHALF_HEADER",
    "Accepted",
    "ApiError",
    "AsyncClient",
    "BatchItem",
    "BatchResult",
    "Client",
    "ClientError",
    "Event",
    "GatewayUnreachable",
]
