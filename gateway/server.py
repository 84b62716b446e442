"""Run the gateway in the foreground: :func:`serve`.

``serve`` runs uvicorn. On SIGTERM or Ctrl-C uvicorn stops accepting connections,
lets in-flight requests finish (up to ``GRACEFUL_SHUTDOWN_S``), then the lifespan
drains deliveries and closes the producer and the engine; the process exits 0. A
second Ctrl-C forces the exit; a second SIGTERM changes nothing (one drain only).

Bounds on what clients hold (:func:`uvicorn_config`): at most
KODA_GATEWAY_LIMIT_CONCURRENCY connections or requests at once (beyond it uvicorn
answers 503; open SSE streams are capped below it, KODA_SSE_MAX_STREAMS), an idle
keep-alive connection closed after KODA_GATEWAY_KEEPALIVE. uvicorn has no timeout on
reading a request: the gateway bounds the bodies it reads itself
(KODA_BODY_READ_TIMEOUT, 408, gateway/quotas.py); a client slow to send its head is
for the proxy in front (its header timeout) to cut.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

from koda_runtime.gateway.app import create_app
from koda_runtime.gateway.bootstrap import build_components
from koda_runtime.gateway.sse import StalledStreamLogFilter
from koda_runtime.logs import configure_logging
from koda_runtime.settings import Settings

# In-flight requests get 15 s, then the lifespan drains up to 5 s of deliveries and
# flushes the producer up to 3 s: within an orchestrator's 25 s grace period.
GRACEFUL_SHUTDOWN_S = 15


class _Server(uvicorn.Server):
    """uvicorn, minus re-raising the signal after a graceful stop.

    uvicorn re-raises SIGTERM once it has shut down, so the process dies by the
    signal (status 143) even though every request finished; a gateway that
    drained cleanly exits 0. On the first signal open SSE streams are cut with a
    ``reconnect`` event, so their clients move on instead of holding the shutdown.
    """

    on_exit: Callable[[], None] | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.on_exit is not None and not self.should_exit:
            self.on_exit()
        super().handle_exit(sig, frame)

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        originals = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)


def uvicorn_config(app: Any, settings: Settings) -> uvicorn.Config:
    """uvicorn's configuration for ``app``: address, lifespan and the bounds above."""
    return uvicorn.Config(
        app,
        host=settings.gateway_host,
        port=settings.gateway_port,
        lifespan="on",
        log_config=None,
        access_log=False,  # RequestMetrics logs one key=value line per request instead
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        server_header=False,
        limit_concurrency=settings.gateway_limit_concurrency or None,
        timeout_keep_alive=settings.gateway_keepalive_s,
    )


def serve(settings: Settings) -> None:
    """Serve the gateway on ``settings.gateway_host:gateway_port`` until SIGTERM/SIGINT."""
    configure_logging()
    logging.getLogger("uvicorn.error").addFilter(StalledStreamLogFilter())
    components = build_components(settings)
    app = create_app(settings, components=components)
    server = _Server(uvicorn_config(app, settings))
    # Cut every open stream: clients reconnect, to another gateway if any. Safe from
    # a signal handler: the work is scheduled on the gateway's loop.
    server.on_exit = lambda: components.feed.close_all_threadsafe("shutdown")
    server.run()
    if not server.started:
        # Startup failed (port taken, lifespan error): uvicorn already logged why.
        raise SystemExit(3)
