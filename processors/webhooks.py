"""``koda webhooks dispatch``: ended runs call their owners' webhooks, at least once.

Beside the runs, never on their path: workers produce a run's terminal event to the
chunk topic and go on; this role reads that topic with a consumer group of its own
(``<env>.koda.webhooks``) and does two things.

* **Intake.** Each polled batch's terminal records (a ``done``, ``error`` or
  ``cancelled`` event, or a compacted run's ``final`` record) name runs that ended.
  One statement makes their deliveries (schemas/webhooks.py ``create_deliveries``,
  idempotent on ``(webhook_id, run_id)``); only then are the batch's offsets committed.
  A dispatcher killed between the two reads the batch again and makes nothing twice.
  A failed statement or commit drops the consumer, which starts again from the
  committed offsets.
* **Delivery.** Due rows are claimed ``FOR UPDATE SKIP LOCKED`` and leased for the
  request's timeout plus :data:`LEASE_MARGIN_S` (replicas never send one delivery at
  the same time; one killed mid-POST leaves it due again when the lease ends), at most
  ``KODA_WEBHOOK_CONCURRENCY`` in flight and ``KODA_WEBHOOK_PER_ENDPOINT`` per
  endpoint, so a slow receiver holds a few slots and never the others. Each attempt
  re-checks the URL and the addresses its host resolves to *now* (DNS rebinding),
  POSTs the run with the Standard Webhooks headers (``webhook-id`` the delivery's id,
  the same at every attempt) within ``KODA_WEBHOOK_TIMEOUT``, and records the attempt.
  A 2xx delivers it; anything else (3xx included: redirects are not followed) retries
  after ``KODA_WEBHOOK_RETRY_FIRST`` doubling up to ``KODA_WEBHOOK_RETRY_MAX``, with
  jitter, until ``KODA_WEBHOOK_HORIZON`` after the delivery was made: then ``failed``.

The body (JSON)::

    {"type": "run.ended", "timestamp": <the run's finished_at>,
     "data": {"run_id", "user_id", "session_id", "status", "output", "error",
              "cost_usd" (a decimal string from the ledger, or null),
              "schedule_id", "scheduled_for", "finished_at"}}

With ``KODA_WEBHOOK_PORT`` (or ``--port``) it serves ``/livez`` (the loops made
progress within :data:`STALL_AFTER_S`), ``/readyz`` (the last Postgres round trip and
the last poll succeeded) and ``/metrics``: ``koda_webhook_deliveries_total{outcome}``,
``koda_webhook_attempt_seconds{outcome}``, ``koda_webhook_oldest_pending_seconds``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import time
from datetime import UTC, datetime
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import ThreadedResolver
from confluent_kafka import Consumer, KafkaException, Message
from prometheus_client import Counter, Gauge, Histogram
from sqlalchemy.ext.asyncio import AsyncEngine

from koda_runtime import __version__, metrics
from koda_runtime.kafka import consumer_config
from koda_runtime.lifecycle.chunks import TERMINAL_KINDS, split_chunk_key
from koda_runtime.schemas.db import async_engine
from koda_runtime.schemas.webhooks import (
    Claimed,
    claim_due,
    create_deliveries,
    finish_attempt,
    oldest_pending_age_s,
    outgoing,
    release_claims,
)
from koda_runtime.settings import Settings
from koda_runtime.topics.catalogue import RUN_CHUNKS
from koda_runtime.topics.records.codec import decode_keyed_chunk, decode_keyed_final
from koda_runtime.webhooks import (
    UrlPolicy,
    WebhookUrlRefused,
    address_refused,
    check_url,
    retry_delay,
    sign,
)

log = logging.getLogger("koda.webhooks")

ROLE = "webhooks"
POLL_BATCH = 500
POLL_S = 1.0
# Claimed rows stay leased this much longer than the request's timeout: room for the
# reads before the POST and the write after it.
LEASE_MARGIN_S = 5.0
# Postgres connections of one dispatcher: the intake, the claims and the attempts' short
# reads and writes share them (deploy/ counts them against max_connections).
POOL_SIZE = 4
GAUGE_EVERY_S = 5.0
STALL_AFTER_S = 120.0
MAX_ERROR_CHARS = 500
RESPONSE_READ_BYTES = 64 * 1024

DELIVERIES = Counter(
    "koda_webhook_deliveries_total",
    "Webhook attempts by outcome: delivered (2xx), retry (failed, tried again later), "
    "failed (failed past KODA_WEBHOOK_HORIZON: given up).",
    ["outcome"],
    registry=metrics.REGISTRY,
)
ATTEMPT_SECONDS = Histogram(
    "koda_webhook_attempt_seconds",
    "Duration of one webhook POST, by outcome (delivered, retry, failed).",
    ["outcome"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
    registry=metrics.REGISTRY,
)
OLDEST_PENDING = Gauge(
    "koda_webhook_oldest_pending_seconds",
    "Age of the oldest webhook delivery not yet delivered or given up (0: none).",
    registry=metrics.REGISTRY,
)
CREATED = Counter(
    "koda_webhook_deliveries_made_total",
    "Webhook deliveries made from the chunk topic's terminal records.",
    registry=metrics.REGISTRY,
)


class GuardedResolver(AbstractResolver):
    """Resolves at every connection (no cache) and refuses a name any of whose addresses
    the policy refuses; the connection then goes to the addresses it checked."""

    def __init__(self, policy: UrlPolicy) -> None:
        self.policy = policy
        self._inner = ThreadedResolver()

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        results = await self._inner.resolve(host, port, family)
        if not self.policy.allow_private:
            for result in results:
                if address_refused(result["host"]):
                    raise WebhookUrlRefused(
                        f"{host} resolves to {result['host']}, a non-public address",
                        rule="address",
                    )
        return results

    async def close(self) -> None:
        await self._inner.close()


def terminal_runs(records: list[Message]) -> set[str]:
    """The runs whose terminal event (or final record) is among ``records``; records
    that are not koda's are skipped."""
    ended: set[str] = set()
    for msg in records:
        value = msg.value()
        if msg.error() is not None or value is None:
            continue
        try:
            run_id, seq = split_chunk_key((msg.key() or b"").decode("utf-8", "replace"))
            if seq is None:
                decode_keyed_final(run_id, value)
                ended.add(run_id)
            elif decode_keyed_chunk(run_id, seq, value).kind in TERMINAL_KINDS:
                ended.add(run_id)
        except Exception:  # noqa: BLE001, S112 - a record that is not koda's changes nothing
            continue
    return ended


def body_of(run: dict[str, Any]) -> bytes:
    """The POST body of a run (the same bytes at every attempt)."""
    payload = {"type": "run.ended", "timestamp": run["finished_at"], "data": run}
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()


class Dispatcher:
    """One replica of the webhook dispatcher; any number may run at once."""

    def __init__(self, settings: Settings, *, engine: AsyncEngine | None = None) -> None:
        self.settings = settings
        self.policy = UrlPolicy.of(settings)
        self.engine = engine or async_engine(settings, pool_size=POOL_SIZE)
        self.lease_s = settings.webhook_timeout_s + LEASE_MARGIN_S
        self.claim = f"{settings.worker_id}-{os.urandom(6).hex()}"
        self.wake = asyncio.Event()
        self.in_flight: dict[str, int] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self.last_progress = time.monotonic()
        self.intake_error: str | None = "not polled yet"
        self.delivery_error: str | None = None

    # -- intake ------------------------------------------------------------------------

    def _consumer(self) -> Consumer:
        conf = consumer_config(self.settings, ROLE, self.settings.names.webhooks_group())
        # The workers' session timeout: a dispatcher killed leaves its partitions unread
        # for this long (librdkafka's default is 45 s).
        timings = {
            "session.timeout.ms": int(self.settings.session_timeout_s * 1000),
            "heartbeat.interval.ms": int(self.settings.heartbeat_interval_s * 1000),
        }
        consumer = Consumer(conf | timings | {"enable.partition.eof": False})
        consumer.subscribe([self.settings.names.topic(RUN_CHUNKS)])
        return consumer

    async def intake(self, stopping: asyncio.Event) -> None:
        """Read terminal records, make their deliveries, then commit; until ``stopping``."""
        delay = 1.0
        while not stopping.is_set():
            consumer = await asyncio.to_thread(self._consumer)
            try:
                while not stopping.is_set():
                    records = await asyncio.to_thread(consumer.consume, POLL_BATCH, POLL_S)
                    self.last_progress = time.monotonic()
                    fatal = [e for m in records if (e := m.error()) is not None and e.fatal()]
                    if fatal:
                        raise KafkaException(fatal[0])
                    ended = terminal_runs(records)
                    if ended:
                        async with self.engine.begin() as conn:
                            made = await create_deliveries(conn, sorted(ended))
                        if made:
                            CREATED.inc(made)
                            self.wake.set()
                    if any(m.error() is None for m in records):
                        await asyncio.to_thread(consumer.commit, asynchronous=False)
                    self.intake_error = None
                    delay = 1.0
            except Exception as exc:  # noqa: BLE001 - rides out Kafka and Postgres outages
                self.intake_error = f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]
                log.warning("event=webhook_intake_failed error=%s", self.intake_error)
            finally:
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(consumer.close)
            if not stopping.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stopping.wait(), delay)
                delay = min(delay * 2, 30.0)

    # -- delivery ----------------------------------------------------------------------

    async def deliver(self, stopping: asyncio.Event) -> None:
        """Claim due deliveries and send them, at most KODA_WEBHOOK_CONCURRENCY at once."""
        connector = aiohttp.TCPConnector(
            resolver=GuardedResolver(self.policy), use_dns_cache=False, limit=0
        )
        async with aiohttp.ClientSession(
            connector=connector, headers={"user-agent": f"koda-webhooks/{__version__}"}
        ) as session:
            while not stopping.is_set():
                self.last_progress = time.monotonic()
                claimed: list[Claimed] = []
                free = self.settings.webhook_concurrency - len(self.tasks)
                if free > 0:
                    try:
                        claimed = await self._claim(free)
                        self.delivery_error = None
                    except Exception as exc:  # noqa: BLE001 - Postgres away: try again
                        self.delivery_error = f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]
                        log.warning("event=webhook_claim_failed error=%s", self.delivery_error)
                for c in claimed:
                    self.in_flight[c.webhook_id] = self.in_flight.get(c.webhook_id, 0) + 1
                    task = asyncio.create_task(self._send(session, c))
                    self.tasks.add(task)
                    task.add_done_callback(self._done(c.webhook_id))
                if claimed and len(self.tasks) < self.settings.webhook_concurrency:
                    continue  # more may be due
                self.wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.wake.wait(), POLL_S)
            if self.tasks:
                # Attempts in flight finish within their timeout; their leases cover them.
                await asyncio.wait(self.tasks, timeout=self.settings.webhook_timeout_s + 1)

    def _done(self, webhook_id: str) -> Any:
        def done(task: asyncio.Task[None]) -> None:
            self.tasks.discard(task)
            left = self.in_flight.get(webhook_id, 1) - 1
            if left > 0:
                self.in_flight[webhook_id] = left
            else:
                self.in_flight.pop(webhook_id, None)
            self.wake.set()
            if not task.cancelled() and task.exception() is not None:
                log.error("event=webhook_attempt_crashed error=%r", task.exception())

        return done

    async def _claim(self, free: int) -> list[Claimed]:
        cap = self.settings.webhook_per_endpoint
        busy = [w for w, n in self.in_flight.items() if n >= cap]
        claimed = await claim_due(self.engine, free, busy, self.lease_s, self.claim)
        kept: list[Claimed] = []
        extra: list[Claimed] = []
        counts = dict(self.in_flight)
        for c in claimed:
            if counts.get(c.webhook_id, 0) < cap:
                counts[c.webhook_id] = counts.get(c.webhook_id, 0) + 1
                kept.append(c)
            else:
                extra.append(c)
        if extra:
            await self._release(extra)
        return kept

    async def _release(self, rows: list[Claimed]) -> None:
        """Hand back claimed rows over an endpoint's cap: due again, attempt not counted."""
        await release_claims(self.engine, [c.id for c in rows], self.claim)

    async def _send(self, session: aiohttp.ClientSession, c: Claimed) -> None:
        started_at = datetime.now(UTC)
        t0 = time.monotonic()
        status_code: int | None = None
        error: str | None = None
        out = await outgoing(self.engine, c.webhook_id, c.run_id)
        if out is None:
            return  # the webhook or the run was deleted; its delivery row went with it
        body = body_of(out.run)
        timestamp = int(time.time())
        headers = {
            "content-type": "application/json",
            "webhook-id": c.id,
            "webhook-timestamp": str(timestamp),
            "webhook-signature": sign(out.secret, c.id, timestamp, body),
        }
        try:
            check_url(out.url, self.policy)
            async with asyncio.timeout(self.settings.webhook_timeout_s):
                async with session.post(
                    out.url, data=body, headers=headers, allow_redirects=False
                ) as resp:
                    status_code = resp.status
                    await resp.content.read(RESPONSE_READ_BYTES)
            if not 200 <= status_code < 300:
                error = f"HTTP {status_code}" + (
                    " (redirects are not followed)" if 300 <= status_code < 400 else ""
                )
        except WebhookUrlRefused as exc:
            error = exc.message
        except TimeoutError:
            limit = self.settings.webhook_timeout_s
            error = f"timeout: no answer within KODA_WEBHOOK_TIMEOUT={limit:g}s"
        except (aiohttp.ClientError, OSError) as exc:
            error = f"{type(exc).__name__}: {exc}"
        duration = time.monotonic() - t0
        if error is None:
            outcome, retry_in = "delivered", 0.0
        elif (started_at - c.created_at).total_seconds() >= self.settings.webhook_horizon_s:
            outcome, retry_in = "failed", 0.0
        else:
            outcome = "retry"
            retry_in = retry_delay(
                c.attempt, self.settings.webhook_retry_first_s, self.settings.webhook_retry_max_s
            )
        DELIVERIES.labels(outcome=outcome).inc()
        ATTEMPT_SECONDS.labels(outcome=outcome).observe(duration)
        if error is not None:
            log.info(
                "event=webhook_attempt_failed delivery=%s attempt=%d outcome=%s error=%s",
                c.id,
                c.attempt,
                outcome,
                error[:200],
            )
        await finish_attempt(
            self.engine,
            c,
            self.claim,
            started_at=started_at,
            duration_ms=int(duration * 1000),
            status_code=status_code,
            error=None if error is None else error[:MAX_ERROR_CHARS],
            status="pending" if outcome == "retry" else outcome,
            retry_in_s=retry_in,
        )

    # -- the gauge, probes, the whole ---------------------------------------------------

    async def gauge(self, stopping: asyncio.Event) -> None:
        while not stopping.is_set():
            try:
                OLDEST_PENDING.set(await oldest_pending_age_s(self.engine))
            except Exception as exc:  # noqa: BLE001 - shown on /readyz through the claims
                log.debug("webhook gauge: %s", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), GAUGE_EVERY_S)

    def live(self) -> tuple[bool, dict[str, Any]]:
        idle = time.monotonic() - self.last_progress
        return idle < STALL_AFTER_S, {"idle_s": round(idle, 1)}

    def ready(self) -> tuple[bool, dict[str, Any]]:
        problem = self.intake_error or self.delivery_error
        return problem is None, {"error": problem, "in_flight": len(self.tasks)}

    async def run(self, stopping: asyncio.Event) -> None:
        try:
            await asyncio.gather(
                self.intake(stopping), self.deliver(stopping), self.gauge(stopping)
            )
        finally:
            await self.engine.dispose()


async def serve_health(dispatcher: Dispatcher, port: int, host: str) -> web.AppRunner:
    """``/livez``, ``/readyz`` and ``/metrics`` on ``host:port`` in this event loop."""

    async def probe(check: Any) -> web.Response:
        ok, detail = check()
        return web.json_response({"ok": ok, **detail}, status=200 if ok else 503)

    async def livez(_request: web.Request) -> web.Response:
        return await probe(dispatcher.live)

    async def readyz(_request: web.Request) -> web.Response:
        return await probe(dispatcher.ready)

    async def metrics_route(request: web.Request) -> web.Response:
        body, content_type = metrics.exposition(request.headers.get("Accept"))
        return web.Response(body=body, headers={"Content-Type": content_type})

    app = web.Application()
    app.router.add_get("/livez", livez)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics_route)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner


def run_dispatcher(settings: Settings, port: int | None = None) -> None:
    """The role's process: dispatch until SIGTERM or SIGINT, then finish the attempts in
    flight (within their timeout) and stop."""

    async def main() -> None:
        stopping = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stopping.set)
        dispatcher = Dispatcher(settings)
        chosen = settings.webhook_port if port is None else port
        runner = (
            None if not chosen else await serve_health(dispatcher, chosen, settings.worker_host)
        )
        log.info(
            "event=webhook_dispatcher_started group=%s concurrency=%d",
            settings.names.webhooks_group(),
            settings.webhook_concurrency,
        )
        try:
            await dispatcher.run(stopping)
        finally:
            if runner is not None:
                await runner.cleanup()

    asyncio.run(main())
