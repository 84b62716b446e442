"""The worker's HTTP endpoints on ``KODA_WORKER_PORT``: ``/livez``, ``/readyz``, ``/metrics``.

* ``/livez`` answers "restart me?": 503 once the event loop has been blocked for
  more than ``KODA_LOOP_STALL`` s. A probe task wakes every ``TICK_S`` and
  records how late it woke; a loop that runs no task cannot run the handler
  either, so an orchestrator's probe times out, and the first probe after the
  block sees how long it lasted.
* ``/readyz`` answers "is this worker part of the group?": 200 once it has
  joined (its first assignment, or, for a member the group gives nothing, the
  coordinator's word: topics/kafka/intake.py), and while a revoke in progress is
  younger than the rebalance timeout. 503 before joining and when stuck revoking.
* ``/metrics``: koda's Prometheus registry.

The server runs in the worker's event loop (aiohttp), started and stopped with
the Faust app. Never a check of Postgres or Kafka: those show in the metrics.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from koda_runtime import metrics
from koda_runtime.background import BackgroundTask

log = logging.getLogger("koda.worker")

TICK_S = 0.5
ROUTES = ("/livez", "/readyz", "/metrics")


@dataclass(frozen=True)
class Check:
    """The answer of one probe: ``ok`` and details for people."""

    ok: bool
    detail: dict[str, Any] = field(default_factory=dict)


class LoopProbe:
    """Measures how late the event loop wakes a task that sleeps ``TICK_S``."""

    def __init__(self, stall_s: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.stall_s = stall_s
        self._clock = clock
        self.last_tick = clock()
        self.lag_s = 0.0
        self._task = BackgroundTask("koda-loop-probe", self.run)

    def tick(self, lag_s: float) -> None:
        self.lag_s = max(0.0, lag_s)
        self.last_tick = self._clock()
        metrics.EVENT_LOOP_LAG_SECONDS.set(self.lag_s)

    def check(self) -> Check:
        """Unhealthy when the last wake-up was late by more than ``stall_s``, or is overdue."""
        overdue = max(0.0, self._clock() - self.last_tick - TICK_S)
        blocked = max(self.lag_s, overdue)
        detail = {"loop_lag_s": round(blocked, 3), "stall_after_s": self.stall_s}
        return Check(blocked <= self.stall_s, detail)

    async def run(self) -> None:
        while True:
            started = self._clock()
            await asyncio.sleep(TICK_S)
            self.tick(self._clock() - started - TICK_S)

    def start(self) -> None:
        self.last_tick = self._clock()
        self._task.start()

    async def stop(self) -> None:
        await self._task.stop()


class GroupMembership:
    """Follows the runs member's rebalances: joined, and not stuck rebalancing.

    The worker's rebalance hooks call ``on_rebalance_start`` when a revoke begins and
    ``on_rebalance_end`` at every assignment (and once an idle member has joined).
    """

    def __init__(
        self, stuck_after_s: float, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.stuck_after_s = stuck_after_s
        self._clock = clock
        self.started_at: float | None = None
        self.ended_at: float | None = None

    def on_rebalance_start(self, app: Any) -> dict[str, Any]:
        self.started_at = self._clock()
        return {}

    def on_rebalance_end(self, app: Any, state: Any) -> None:
        self.ended_at = self._clock()

    def check(self) -> Check:
        now = self._clock()
        if self.ended_at is None:
            return Check(False, {"reason": "has not joined the consumer group yet"})
        rebalancing = self.started_at is not None and self.started_at > self.ended_at
        detail: dict[str, Any] = {
            "rebalancing": rebalancing,
            "assigned_s_ago": round(now - self.ended_at, 3),
        }
        if rebalancing:
            assert self.started_at is not None
            for_s = now - self.started_at
            detail["rebalancing_for_s"] = round(for_s, 3)
            if for_s > self.stuck_after_s:
                detail["reason"] = f"stuck rebalancing for more than {self.stuck_after_s:g}s"
                return Check(False, detail)
        return Check(True, detail)


class HealthServer:
    """A small aiohttp server for the probes and the metrics, in the worker's loop."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        live: Callable[[], Check],
        ready: Callable[[], Check],
    ) -> None:
        self.host = host
        self.port = port
        self._live = live
        self._ready = ready
        self._runner: web.AppRunner | None = None

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/livez", self._probe(self._live))
        app.router.add_get("/readyz", self._probe(self._ready))
        app.router.add_get("/metrics", self._metrics)
        return app

    @staticmethod
    def _probe(fn: Callable[[], Check]) -> Callable[[web.Request], Any]:
        async def handler(_request: web.Request) -> web.Response:
            check = fn()
            body = {"status": "ok" if check.ok else "unavailable", **check.detail}
            return web.json_response(body, status=200 if check.ok else 503)

        return handler

    @staticmethod
    async def _metrics(request: web.Request) -> web.Response:
        # OpenMetrics (with the run histograms' trace exemplars) when the scraper asks.
        body, content_type = metrics.exposition(request.headers.get("Accept"))
        response = web.Response(body=body)
        response.headers["Content-Type"] = content_type
        return response

    async def start(self) -> None:
        """Bind and serve; raises OSError when the port is taken."""
        runner = web.AppRunner(self.app(), access_log=None, handle_signals=False)
        await runner.setup()
        try:
            await web.TCPSite(runner, self.host, self.port).start()
        except OSError:
            await runner.cleanup()
            raise
        self._runner = runner
        log.info("event=health_server_started host=%s port=%d", self.host, self.port)

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
