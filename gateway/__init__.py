"""The HTTP gateway: authenticate, rate-limit/admit, persist, publish (docs/design.md §1, §9).

    create_app(settings)   the ASGI app (composition root; connects in its lifespan)
    serve(settings)        uvicorn in the foreground, graceful on SIGTERM
    runs_app               ``koda runs submit|show|follow``
    Sweeper                republishes pending runs whose publish was lost

Modules: ``app`` (composition), ``routes`` (HTTP), ``intake`` (request checks),
``auth``, ``ratelimit``, ``admission`` (persist + publish), ``store`` (SQL),
``sse`` (the events endpoint), ``livefeed`` (chunk-topic tail), ``eventstream`` (SSE wire),
``publisher`` (producer), ``sweeper``, ``errors``, ``models``, ``cli``.
"""

from gateway.app import create_app
from gateway.cli import runs_app, serve
from gateway.publisher import RunPublisher
from gateway.sweeper import Sweeper

__all__ = ["RunPublisher", "Sweeper", "create_app", "runs_app", "serve"]
