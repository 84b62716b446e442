"""Compact the chunk topic: a finished run's per-chunk records become one final record.

``koda chunks compact [--older-than S] [--every S]`` takes runs that are terminal,
finished more than S seconds ago (default ``KODA_COMPACT_AFTER``, 24 h) and not yet
compacted, in batches. Each batch is one Postgres transaction that holds its runs'
rows (``FOR UPDATE SKIP LOCKED``: two compactors never take the same run):

1. read the runs' messages (Postgres keeps every message, always);
2. produce ``<run_id>:final`` (``run.final/1``: the text after the last reset and the
   terminal kind) to the run's partition, *then* a tombstone for every
   ``<run_id>:<seq>``. Final first: a reader at any moment finds either the chunks or
   the final text (see :mod:`koda_runtime.topics.chunklog`);
3. wait for every delivery; only then set ``runs.compacted_at`` and commit.

A crash anywhere before the commit leaves ``compacted_at`` null and the next pass
produces the same keys again, which the compacted topic collapses: idempotent. The
broker's log cleaner later drops the superseded chunks, and the tombstones after the
topic's ``delete.retention.ms``. SSE keeps serving compacted runs from Postgres.

Each round of ``--every`` first runs the **completeness pass** (:meth:`ChunkCompactor.
repair_once`, alone: ``koda chunks repair``): runs terminal for longer than
``KODA_REPAIR_AFTER`` (30 s) whose ``runs.published_seq`` is still null, i.e. no one
has seen all their messages acknowledged on the topic (a worker died between a commit
and its produce and no worker met the run again; see processors/republish.py). Their
messages are produced again from Postgres, and once all are delivered
``published_seq`` is set. No row lock is held while producing, so a worker's own mark
never waits for the pass; two passes at once only produce the same records twice.

With ``--port`` the loop serves ``/livez``, ``/readyz`` and ``/metrics`` (:func:`serve_health`;
the deploy files' compactor role). ``/livez`` is 503 once the loop has made no progress
(a round ended, a batch was written, a record was enqueued, a second of waiting passed)
for ``STALL_AFTER_S``: a statement or a flush that hangs. ``/readyz`` is 200 once a round
has completed and while the last one did not fail. ``koda_chunk_upkeep_last_pass_
timestamp_seconds`` is the time the last round completed (the alert KodaChunkUpkeepLate).
Two compactors at once are safe (see above), only wasteful: deploy one.

**Outages.** A round that meets Postgres or Kafka away (or any other error) fails; the
loop logs ``event=chunk_upkeep_failed cause=postgres|kafka|other``, counts
``koda_chunk_upkeep_failures_total{cause}``, answers 503 on ``/readyz`` naming the cause,
and tries again after 1 s, doubling up to ``--every``; ``/livez`` stays 200 (a restart
would not bring the store back). Nothing is lost or marked wrongly: a batch is marked
compacted in the transaction that follows its delivered records, and a run's
``published_seq`` only after its records were delivered, so a round cut anywhere is
redone by the next one with the same keys. Started while a dependency is away, the
role waits for it the same way (``koda chunks compact --every`` checks neither at start).

    KodaError
    └── CompactionError   the broker did not acknowledge the records of a batch
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import psycopg
from confluent_kafka import KafkaError, KafkaException, Message, Producer
from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError, SQLAlchemyError

from koda_runtime import metrics
from koda_runtime.errors import DatabaseError, KodaError
from koda_runtime.kafka import producer_config
from koda_runtime.lifecycle.chunks import (
    TERMINAL_KINDS,
    chunk_key,
    end_kind,
    final_key,
    visible_output,
)
from koda_runtime.lifecycle.states import RunStatus
from koda_runtime.metrics import CHUNK_RUNS_COMPACTED, CHUNKS_REPUBLISHED
from koda_runtime.schemas.db import sync_engine
from koda_runtime.schemas.runs import upkeep
from koda_runtime.settings import Settings
from koda_runtime.topics.catalogue import RUN_CHUNKS, partition_for_key
from koda_runtime.topics.records.codec import (
    RUN_CHUNK,
    RUN_FINAL,
    FinalRecord,
    chunk_value,
    headers_for,
)

log = logging.getLogger(__name__)

ROLE = "compactor"
DELIVERY_TIMEOUT_S = 60.0
# The loop notes progress at least every second of waiting, every record enqueued and
# every batch written; the longest legitimate silence is a flush (DELIVERY_TIMEOUT_S)
# after a full producer queue (as long again). Past this, /livez asks for a restart.
STALL_AFTER_S = 5 * DELIVERY_TIMEOUT_S
CLOSE_FLUSH_S = 5.0
# After a failed round the next comes this soon, doubling per failure up to --every.
RETRY_FIRST_S = 1.0
ROUTES = ("/livez", "/readyz", "/metrics")


class CompactionError(KodaError):
    """The broker did not acknowledge a batch's records; nothing was marked compacted."""


@dataclass(frozen=True)
class RepairReport:
    """What a completeness pass did: runs it completed and chunk records it produced."""

    runs: int
    chunks: int


@dataclass(frozen=True)
class CompactionReport:
    runs: int
    tombstones: int

    def __add__(self, other: CompactionReport) -> CompactionReport:
        return CompactionReport(self.runs + other.runs, self.tombstones + other.tombstones)


class ChunkCompactor:
    """Runs compaction passes; ``engine`` and ``producer`` are built from settings if omitted."""

    def __init__(
        self,
        settings: Settings,
        *,
        engine: Engine | None = None,
        producer: Producer | None = None,
    ) -> None:
        self.settings = settings
        self.topic = settings.names.topic(RUN_CHUNKS)
        self._own_engine = engine is None
        self.engine = engine if engine is not None else sync_engine(settings)
        self.producer = (
            producer if producer is not None else Producer(producer_config(settings, ROLE))
        )
        self.clock: Callable[[], float] = time.monotonic
        self.last_progress = self.clock()
        self.rounds = 0  # rounds completed without error
        self.last_error: str | None = None  # of the last round, None when it completed

    def _progress(self) -> None:
        self.last_progress = self.clock()

    def close(self) -> None:
        # Every batch and pass waited for its own deliveries: what is left is a failed
        # round's, which the next round produces again. Bounded, for a stop in an outage.
        self.producer.flush(CLOSE_FLUSH_S)
        if self._own_engine:
            self.engine.dispose()

    def compact_once(self, older_than_s: float | None = None, batch: int = 100) -> CompactionReport:
        """Compact every eligible run now, ``batch`` runs per transaction."""
        older = self.settings.compact_after_s if older_than_s is None else older_than_s
        total = CompactionReport(0, 0)
        while True:
            report = self._compact_batch(older, batch)
            total += report
            if report.runs < batch:
                return total

    def repair_once(self, older_than_s: float | None = None, batch: int = 200) -> RepairReport:
        """Produce again the messages of runs terminal for over ``older_than_s`` seconds
        (default ``KODA_REPAIR_AFTER``) that are not known to be whole on the topic."""
        older = self.settings.repair_after_s if older_than_s is None else older_than_s
        runs_done = chunks = 0
        # Keyset pagination along the partial index: each batch starts where the last one
        # ended, so a backlog (the first passes after the upgrade) costs one index range.
        after: tuple[Any, str] | None = None
        while True:
            with self.engine.connect() as conn:
                runs = upkeep.unpublished(conn, older, after, batch)
                if not runs:
                    break
                ids = [r.id for r in runs]
                by_run = upkeep.messages_by_run(conn, ids)
            self._republish(runs, by_run)
            seqs = [by_run[i][-1].seq if by_run[i] else -1 for i in ids]
            with self.engine.begin() as conn:
                upkeep.mark_published(conn, ids, seqs)
            produced = sum(len(by_run[i]) for i in ids)
            if produced:
                CHUNKS_REPUBLISHED.labels(by="pass").inc(produced)
                log.info("event=chunks_republished runs=%d chunks=%d", len(ids), produced)
            runs_done += len(ids)
            chunks += produced
            self._progress()
            after = (runs[-1].finished_at, runs[-1].id)
            if len(runs) < batch:
                break
        return RepairReport(runs_done, chunks)

    def _republish(self, runs: Sequence[Any], by_run: dict[str, list[Any]]) -> None:
        """Produce ``runs``' messages again and wait for every delivery."""
        failures: list[str] = []

        def on_delivery(err: KafkaError | None, _msg: Message) -> None:
            if err is not None:
                failures.append(err.str())

        for run in runs:
            partition = run.partition
            if partition is None:
                partition = partition_for_key(run.user_id.encode(), self.settings.partitions)
            for m in by_run[run.id]:
                value = chunk_value(run.id, m.seq, m.kind, m.content, m.attempt)
                self._produce(chunk_key(run.id, m.seq), value, partition, RUN_CHUNK, on_delivery)
        remaining = self.producer.flush(DELIVERY_TIMEOUT_S)
        if remaining or failures:
            detail = failures[0] if failures else f"{remaining} records undelivered"
            raise CompactionError(f"republishing {len(runs)} runs' chunks failed: {detail}")

    def run_forever(
        self,
        every_s: float,
        older_than_s: float | None = None,
        should_stop: Callable[[], bool] = lambda: False,
    ) -> None:
        """A round every ``every_s`` seconds until ``should_stop()``.

        A round that fails (Postgres or Kafka away, or anything else) is logged, counted in
        ``koda_chunk_upkeep_failures_total{cause}`` and makes ``/readyz`` fail; the next
        one comes after ``RETRY_FIRST_S``, doubling per failure up to ``every_s``, and the
        first that completes makes the role ready again."""
        metrics.CHUNK_UPKEEP_INTERVAL_SECONDS.set(every_s)
        failures = 0
        while not should_stop():
            self._progress()
            wait_s = every_s
            try:
                self.repair_once()
                report = self.compact_once(older_than_s)
            except Exception as exc:  # noqa: BLE001 - the role outlives any failed round
                failures += 1
                cause = failure_cause(exc)
                detail = describe_failure(exc)
                self.last_error = f"{cause}: {detail}"
                metrics.CHUNK_UPKEEP_FAILURES.labels(cause=cause).inc()
                wait_s = min(every_s, RETRY_FIRST_S * 2 ** min(failures - 1, 16))
                line = "event=chunk_upkeep_failed cause=%s failures=%d retry_in_s=%.1f error=%s"
                if cause == "other":
                    log.exception(line, cause, failures, wait_s, detail)
                else:
                    log.warning(line, cause, failures, wait_s, detail)
            else:
                if failures:
                    log.info("event=chunk_upkeep_resumed after_failures=%d", failures)
                failures = 0
                self.rounds += 1
                self.last_error = None
                metrics.CHUNK_UPKEEP_LAST_PASS.set_to_current_time()
                log.info(
                    "event=compaction_pass runs=%d tombstones=%d", report.runs, report.tombstones
                )
            self._progress()
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline and not should_stop():
                time.sleep(max(0.0, min(1.0, deadline - time.monotonic())))
                self._progress()

    def live(self) -> tuple[bool, dict[str, Any]]:
        """``/livez``: False once the loop has made no progress for ``STALL_AFTER_S``."""
        silent = self.clock() - self.last_progress
        detail = {"silent_s": round(silent, 3), "stall_after_s": STALL_AFTER_S}
        return silent <= STALL_AFTER_S, detail

    def ready(self) -> tuple[bool, dict[str, Any]]:
        """``/readyz``: True once a round has completed and while the last did not fail."""
        detail: dict[str, Any] = {"rounds": self.rounds}
        if self.last_error is not None:
            detail["reason"] = f"the last round failed: {self.last_error}"
            return False, detail
        if self.rounds == 0:
            detail["reason"] = "no round has completed yet"
            return False, detail
        return True, detail

    def _compact_batch(self, older_than_s: float, batch: int) -> CompactionReport:
        with self.engine.begin() as conn:
            runs = upkeep.claim_for_compaction(conn, older_than_s, batch)
            if not runs:
                return CompactionReport(0, 0)
            ids = [r.id for r in runs]
            by_run = upkeep.messages_by_run(conn, ids)
            failures: list[str] = []
            tombstones = 0
            for run in runs:
                partition = run.partition
                if partition is None:
                    partition = partition_for_key(run.user_id.encode(), self.settings.partitions)
                tombstones += self._produce_run(
                    run.id, run.status, partition, by_run[run.id], failures
                )
            remaining = self.producer.flush(DELIVERY_TIMEOUT_S)
            if remaining or failures:
                detail = failures[0] if failures else f"{remaining} records undelivered"
                # Raising rolls the transaction back: nothing is marked compacted.
                raise CompactionError(f"compacting {len(ids)} runs failed: {detail}")
            upkeep.mark_compacted(conn, ids)
        CHUNK_RUNS_COMPACTED.inc(len(ids))
        self._progress()
        return CompactionReport(len(ids), tombstones)

    def _produce_run(
        self, run_id: str, status: str, partition: int, messages: list[Any], failures: list[str]
    ) -> int:
        if not messages:
            return 0  # never produced anything (failed before its first event)

        def on_delivery(err: KafkaError | None, _msg: Message) -> None:
            if err is not None:
                failures.append(err.str())

        last = messages[-1]
        ends = [m for m in messages if m.kind in TERMINAL_KINDS]
        end = ends[-1] if ends else None
        final = FinalRecord(
            run_id=run_id,
            last_seq=last.seq,
            end=end.kind if end is not None else end_kind(RunStatus(status)).value,
            end_content=end.content if end is not None else "",
            content=visible_output((m.seq, m.kind, m.content) for m in messages),
            attempt=last.attempt,
        )
        self._produce(final_key(run_id), final.encode(), partition, RUN_FINAL, on_delivery)
        for m in messages:
            self._produce(chunk_key(run_id, m.seq), None, partition, RUN_CHUNK, on_delivery)
        return len(messages)

    def _produce(
        self, key: str, value: bytes | None, partition: int, schema: str, on_delivery: Any
    ) -> None:
        deadline = time.monotonic() + DELIVERY_TIMEOUT_S
        while True:
            try:
                self.producer.produce(
                    self.topic,
                    key=key.encode(),
                    value=value,
                    partition=partition,
                    headers=list(headers_for(schema)),
                    on_delivery=on_delivery,
                )
                self.producer.poll(0)
                self._progress()
                return
            except BufferError:
                # The local queue is full: let deliveries drain it, bounded in time.
                if time.monotonic() > deadline:
                    raise CompactionError("the producer queue stayed full") from None
                self.producer.poll(0.5)
            except KafkaException as exc:
                raise CompactionError(f"cannot enqueue {key}: {exc}") from exc


def failure_cause(exc: BaseException) -> str:
    """``postgres``, ``kafka`` or ``other``: which dependency a failed round met."""
    if isinstance(exc, SQLAlchemyError | psycopg.Error | DatabaseError):
        return "postgres"
    if isinstance(exc, CompactionError | KafkaException):
        return "kafka"
    return "other"


def describe_failure(exc: BaseException) -> str:
    """One line naming the error: the driver's message for a database error, never the
    statement or its parameters (SQLAlchemy's text carries both)."""
    inner = exc.orig if isinstance(exc, DBAPIError) and exc.orig is not None else exc
    lines = str(inner).strip().splitlines()
    return f"{type(inner).__name__}: {lines[0] if lines else '(no message)'}"


def serve_health(compactor: ChunkCompactor, port: int, host: str) -> ThreadingHTTPServer:
    """Serve ``/livez``, ``/readyz`` (JSON, 200 or 503) and ``/metrics`` on ``host:port``
    from a daemon thread; ``shutdown()`` the returned server to stop it. ``port`` 0 picks
    a free port (``server.server_port``)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                body, content_type = metrics.exposition(self.headers.get("Accept"))
                self._send(200, content_type, body)
                return
            checks = {"/livez": compactor.live, "/readyz": compactor.ready}
            if path not in checks:
                self._send(404, "application/json", b'{"error": "not found"}')
                return
            ok, detail = checks[path]()
            body = json.dumps({"ok": ok, **detail}).encode()
            self._send(200 if ok else 503, "application/json", body)

        def _send(self, status: int, content_type: str, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            pass  # probes every few seconds: not worth a log line each

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="koda-compactor-health", daemon=True).start()
    return server
