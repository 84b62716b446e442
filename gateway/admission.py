"""Admit a validated request: choose ids and key, persist idempotently, publish.

The gateway never runs a job and never retries one: it writes the run, produces
one ``run.requested`` record, and waits up to ``publish_wait_s`` for the broker's
acknowledgement before answering. A slow or failed publish does not fail the
request: the run is durable in Postgres and the sweeper publishes it later.

Admission is a group commit (:class:`AdmissionQueue`): the requests that arrive
while one transaction is in flight are written together by the next, and their
records are enqueued together right after its commit, each request still getting
its own answer.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import psycopg
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError

from koda_runtime import metrics, tracing
from koda_runtime.batching import AGAIN, Again, Batcher
from koda_runtime.errors import DatabaseError, PublishError
from koda_runtime.gateway.intake import RunRequest
from koda_runtime.gateway.principal import created_by
from koda_runtime.lifecycle.control import MERGE, ControlRecord
from koda_runtime.lifecycle.ids import (
    dedup_bucket,
    derived_idempotency_key,
    scoped_idempotency_key,
    uuid7,
)
from koda_runtime.lifecycle.ledger import Period
from koda_runtime.naming import Names
from koda_runtime.schemas.runs.admission import AdmittedRun, NewRun, RunAdmission
from koda_runtime.schemas.runs.control import ControlStore, MergeCaps
from koda_runtime.topics.catalogue import RUN_CONTROL, partition_for_key
from koda_runtime.topics.kafka.publisher import Delivery, RunPublisher
from koda_runtime.topics.records.codec import RunRequested

log = logging.getLogger(__name__)


PUBLISH_WAIT_S = 2.0
MARK_INTERVAL_S = 0.05
MARK_BATCH = 500
# Requests admitted by one transaction at most; more wait for the next one.
ADMIT_BATCH = 256
# Times a request is tried again when its key conflicted with a run that then vanished.
ADMIT_ATTEMPTS = 3
# KODA_DEDUP_WINDOW_S's default: a body repeated without a key is one run within it.
DEDUP_WINDOW_S = 10.0


def idempotency_key_for(
    user_id: str,
    request: RunRequest,
    client_key: str | None,
    now_s: float | None = None,
    window_s: float = DEDUP_WINDOW_S,
) -> tuple[str, str | None]:
    """The stored key: the client's own scoped to the user, else one derived from intent
    (koda/lifecycle/ids.py); and, for a key derived from the body alone (no
    client_message_id), the key of the previous dedup window, else None.

    A repeat in the next window is the same run only if the previous window's run is
    younger than ``window_s`` (:meth:`Admissions.admit` asks): so a double click that
    straddles two windows is still one run, and a repeat ``window_s`` later never is.
    """
    if client_key is not None:
        return scoped_idempotency_key(user_id, client_key), None
    args = (user_id, request.session_id, request.client_message_id, request.canonical())
    if request.client_message_id is not None:
        return derived_idempotency_key(*args), None
    bucket = dedup_bucket(time.time() if now_s is None else now_s, window_s)
    return derived_idempotency_key(*args, bucket), derived_idempotency_key(*args, bucket - 1)


class PublishedMarks:
    """Sets ``published_at`` for delivered runs, many runs per UPDATE.

    One transaction per delivered run was a third of a submission's Postgres work.
    ``published_at`` only tells the sweeper which runs it may leave alone, and it
    looks at runs older than ``sweep_after_s`` (seconds), so a mark that lands
    ``MARK_INTERVAL_S`` later changes nothing; a mark that is lost costs at most
    one harmless republish, as before. A :class:`~koda_runtime.batching.Batcher`
    (its failure rules) whose flusher waits ``interval_s`` before its first UPDATE.
    """

    def __init__(self, store: RunAdmission, interval_s: float = MARK_INTERVAL_S) -> None:
        self.store = store
        self.interval_s = interval_s
        self._marks: Batcher[str, None] = Batcher(
            self._write, name="mark-published", max_batch=MARK_BATCH, delay_s=interval_s
        )

    def note(self, run_id: str) -> None:
        """Mark ``run_id`` published within ``interval_s``."""
        self._marks.put(run_id)

    async def close(self) -> None:
        """Let a scheduled flush finish and write what is left."""
        await self._marks.close()

    async def _write(self, ids: list[str]) -> list[None]:
        try:
            await self.store.mark_published(ids)
        except DatabaseError as exc:
            # The records are out; the worst case is harmless duplicates from the sweeper.
            log.warning("event=mark_published_failed runs=%d error=%s", len(ids), exc)
        return [None for _ in ids]


Committed = Callable[[list[AdmittedRun]], None]


@dataclass(eq=False)
class _Attempt:
    run: NewRun
    attempts: int = 0


class AdmissionQueue:
    """Group commit for admissions: one transaction for all the requests waiting.

    One flusher at a time takes every request queued (up to ``max_batch``) and admits
    them with :meth:`RunAdmission.admit_batch`, while the next requests queue behind it:
    under load a transaction carries as many requests as arrived during the previous
    one, and a lone request is written at once (no timer). ``committed`` is called
    with the batch's created runs, in arrival order, after the commit and before the
    next transaction starts, so records enqueued there keep admission order.

    ``max_active`` is the cap on a user's runs not yet ended (0: none), applied by
    :meth:`RunAdmission.admit_batch` under per-user locks.

    Each request gets its own answer: its run, its own refusal, or DatabaseError when
    the transaction failed (then nothing of the batch was written). A batch that fails
    on one request's data (not a lost connection) is tried again one request at a
    time, so a request Postgres cannot store fails alone. The queue, the flusher and
    these failure rules are koda/batching.py's :class:`~koda_runtime.batching.Batcher`.
    A request whose client went away is admitted all the same (its answer is dropped).
    """

    def __init__(
        self,
        store: RunAdmission,
        committed: Committed,
        *,
        budgets: bool = True,
        max_active: int = 0,
        max_batch: int = ADMIT_BATCH,
    ) -> None:
        self.store = store
        self.committed = committed
        self.budgets = budgets
        self.max_active = max_active
        self.max_batch = max_batch
        self._batcher: Batcher[_Attempt, AdmittedRun] = Batcher(
            self._admit,
            name="admission-flusher",
            max_batch=max_batch,
            retry_alone=_data_error,
        )

    async def admit(self, run: NewRun) -> AdmittedRun:
        """``run`` admitted in the next transaction (see :meth:`RunAdmission.admit`)."""
        return await self._batcher.submit(_Attempt(run))

    @property
    def waiting(self) -> int:
        """Requests queued for the next transaction (not the one in flight)."""
        return self._batcher.waiting

    async def close(self) -> None:
        """Let the flusher write what is queued."""
        await self._batcher.close()

    async def _admit(self, batch: list[_Attempt]) -> list[AdmittedRun | BaseException | Again]:
        metrics.ADMISSION_BATCH_RUNS.observe(len(batch))
        try:
            answers = await self.store.admit_batch(
                [w.run for w in batch], budgets=self.budgets, max_active=self.max_active
            )
            created = [a for a in answers if isinstance(a, AdmittedRun) and a.created]
            if created:
                self.committed(created)
        except DatabaseError:
            raise
        except Exception:  # a bug: every waiter still hears of it (koda/batching.py)
            log.exception("event=admission_batch_failed runs=%d", len(batch))
            raise
        outcomes: list[AdmittedRun | BaseException | Again] = []
        for w, answer in zip(batch, answers, strict=True):
            if answer is not None:
                outcomes.append(answer)
                continue
            w.attempts += 1
            outcomes.append(
                AGAIN
                if w.attempts < ADMIT_ATTEMPTS
                else DatabaseError(
                    f"idempotency key conflicted but no run was found after {w.attempts} tries"
                )
            )
        return outcomes


def _data_error(exc: Exception, batch: Sequence[_Attempt]) -> bool:
    """Try each request of a failed batch alone when one request's data failed it."""
    if not isinstance(exc, DatabaseError) or _lost_connection(exc):
        return False
    log.warning("event=admission_batch_failed runs=%d error=%s", len(batch), exc)
    return True


def _lost_connection(exc: DatabaseError) -> bool:
    """True when Postgres itself failed (connection, server), not one request's data.

    The batch's statements go to psycopg itself (its errors arrive unwrapped) and its
    transaction through SQLAlchemy (wrapped in a DBAPIError)."""
    cause = exc.__cause__
    if isinstance(cause, psycopg.Error):
        return isinstance(cause, psycopg.OperationalError | psycopg.InterfaceError)
    return (
        not isinstance(cause, DBAPIError)
        or cause.connection_invalidated
        or isinstance(cause, OperationalError | InterfaceError)
    )


class Admissions:
    """Turns requests into durable, published runs."""

    def __init__(
        self,
        store: RunAdmission,
        publisher: RunPublisher,
        *,
        partitions: int,
        max_claims: int,
        publish_wait_s: float = PUBLISH_WAIT_S,
        control: ControlStore | None = None,
        merge_window_s: float = 30.0,
        dedup_window_s: float = DEDUP_WINDOW_S,
        names: Names | None = None,
        budgets: bool = True,
        max_active: int = 0,
    ) -> None:
        self.control = control
        self.merge_window_s = merge_window_s
        self.dedup_window_s = dedup_window_s
        self.max_claims = max_claims
        self.control_topic = None if names is None else names.topic(RUN_CONTROL)
        self.store = store
        self.budgets = budgets
        self.publisher = publisher
        self.partitions = partitions
        self.publish_wait_s = publish_wait_s
        self._deliveries: dict[str, asyncio.Future[Delivery]] = {}
        self._marks = PublishedMarks(store)
        self.max_active = max_active
        self.queue = AdmissionQueue(
            store, self._publish_all, budgets=budgets, max_active=max_active
        )

    async def submit(
        self,
        user_id: str,
        request: RunRequest,
        client_key: str | None,
        *,
        merge_caps: MergeCaps | None = None,
    ) -> AdmittedRun:
        """Persist the run for this key (or find the existing one) and publish a new one.

        Raises SessionNotOwned when the session belongs to another user, OverBudget when
        the user has spent a budget, TooManyActiveRuns when the user already has
        ``max_active`` runs not yet ended (0: no cap), DatabaseError when Postgres fails.
        Nothing is written in any of these cases; a replay of an existing key is never
        refused.

        Into a session whose latest run is running or streaming and younger than
        ``merge_window_s``, the message is merged into that run instead (the answer
        names that run, ``merged``); the worker executing it is signalled to start
        over on the merged input. The rerun bills the whole input again, so a spent
        budget refuses a merge as it refuses a new run (OverBudget), and ``merge_caps``
        bound the merges into one run and the merged input's bytes (CapReached). A merge
        is not a new run, so the cap on active runs does not refuse it. A run that has
        had ``max_claims`` claims takes no more merges (its rerun would be given up).
        """
        key, previous = idempotency_key_for(
            user_id, request, client_key, window_s=self.dedup_window_s
        )
        if previous is not None and (
            await self.store.recent_by_key(previous, self.dedup_window_s) is not None
        ):
            key = previous  # the same body within the window: that run answers
        if request.session_id is not None and self.control is not None:
            merged = await self.control.merge(
                user_id,
                request.session_id,
                key,
                request.input,
                self.merge_window_s,
                self.max_claims,
                budgets=self.budgets,
                caps=merge_caps,
            )
            if merged is not None:
                if not merged.replayed:
                    metrics.RUNS_MERGED.inc()
                    log.info(
                        "event=run_merged run_id=%s user_id=%s input_version=%d",
                        merged.run_id,
                        user_id,
                        merged.input_version,
                    )
                    await self.signal(
                        ControlRecord(
                            merged.run_id, user_id, MERGE, input_version=merged.input_version
                        )
                    )
                return AdmittedRun(
                    run_id=merged.run_id,
                    user_id=user_id,
                    session_id=merged.session_id,
                    status=merged.status,
                    created_at=merged.created_at,
                    created=not merged.replayed,
                    merged=True,
                )
        new = NewRun(
            run_id=uuid7(),
            user_id=user_id,
            session_id=request.session_id or uuid7(),
            create_session=request.session_id is None,
            idempotency_key=key,
            input=request.input,
            metadata=request.metadata,
            partition=partition_for_key(user_id.encode(), self.partitions),
            traceparent=tracing.traceparent(),  # the request's span (koda/tracing.py)
            created_by=created_by(user_id),  # the request's principal (gateway/principal.py)
        )
        run = await self.queue.admit(new)
        for period in run.soft_alerts:
            await self._soft_alert(user_id, period)
        if not run.created:
            metrics.ADMISSIONS.labels(outcome="replayed").inc()
            log.info(
                "event=run_replayed run_id=%s user_id=%s status=%s",
                run.run_id,
                user_id,
                run.status,
            )
            return run
        metrics.ADMISSIONS.labels(outcome="created").inc()
        log.info(
            "event=run_admitted run_id=%s user_id=%s session_id=%s partition=%d",
            run.run_id,
            user_id,
            run.session_id,
            new.partition,
        )
        await self._await_delivery(run)
        return run

    async def signal(self, record: ControlRecord) -> None:
        """Produce a run-control record (key user_id) and wait up to ``publish_wait_s``.

        Best effort: the request is durable in Postgres already, and the worker's
        writes find it there when the record is late or lost.
        """
        if self.control_topic is None:
            return
        try:
            # The signal's span (in the merge request's trace; a cancel's starts one),
            # which the worker's `koda.control` span continues (koda/tracing.py).
            with tracing.span(f"koda.signal {record.action}", kind=tracing.SpanKind.PRODUCER):
                tp = tracing.traceparent()
                await asyncio.wait_for(
                    self.publisher.send(
                        self.control_topic,
                        record.user_id.encode(),
                        record.encode(),
                        [(tracing.HEADER, tp.encode())] if tp else [],
                    ),
                    self.publish_wait_s,
                )
        except (PublishError, TimeoutError) as exc:
            log.warning(
                "event=control_publish_failed run_id=%s action=%s error=%s",
                record.run_id,
                record.action,
                exc,
            )

    async def _soft_alert(self, user_id: str, period: Period) -> None:
        """One log line and one count per user and period, whichever gateway sees it first."""
        try:
            first = await self.store.mark_soft_alert(user_id, period)
        except DatabaseError as exc:
            log.warning("event=budget_alert_failed user_id=%s error=%s", user_id, exc)
            return
        if first:
            metrics.BUDGET_SOFT_ALERTS.labels(period=period.value).inc()
            log.warning("event=budget_soft_threshold user_id=%s period=%s", user_id, period.value)

    def _publish_all(self, runs: list[AdmittedRun]) -> None:
        """Enqueue one record per created run, in admission order (the queue's commit hook)."""
        for run in runs:
            delivery = self.publisher.publish(
                RunRequested(
                    run_id=run.run_id,
                    user_id=run.user_id,
                    session_id=run.session_id,
                    created_at=run.created_at.isoformat(),
                ),
                traceparent=run.traceparent,
            )
            self._deliveries[run.run_id] = delivery
            delivery.add_done_callback(functools.partial(self._delivered, run))

    def _delivered(self, run: AdmittedRun, delivery: asyncio.Future[Delivery]) -> None:
        self._deliveries.pop(run.run_id, None)
        if delivery.cancelled():
            return  # abandoned at drain: published_at stays NULL, the sweeper publishes it
        exc = delivery.exception()
        if exc is not None:
            log.warning(
                "event=publish_failed run_id=%s user_id=%s error=%s (the sweeper retries)",
                run.run_id,
                run.user_id,
                exc,
            )
            return
        self._marks.note(run.run_id)
        where = delivery.result()
        # DEBUG: run_admitted and the access line already log every submission, and a
        # third line per request cost the gateway about 3 % of its CPU under load.
        log.debug(
            "event=run_published run_id=%s user_id=%s partition=%d offset=%d",
            run.run_id,
            run.user_id,
            where.partition,
            where.offset,
        )

    async def _await_delivery(self, run: AdmittedRun) -> None:
        """Wait up to ``publish_wait_s`` for the run's record to be acknowledged."""
        delivery = self._deliveries.get(run.run_id)
        if delivery is None:
            return  # settled already
        try:
            await asyncio.wait_for(asyncio.shield(delivery), self.publish_wait_s)
        except TimeoutError:
            log.warning(
                "event=publish_slow run_id=%s user_id=%s wait_s=%.1f",
                run.run_id,
                run.user_id,
                self.publish_wait_s,
            )
        except PublishError:
            pass  # logged by _delivered; the run is durable and the sweeper publishes it

    async def drain(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for outstanding deliveries, then abandon the rest.

        An abandoned run keeps ``published_at`` NULL, so a sweeper publishes it.
        """
        await self.queue.close()
        pending = set(self._deliveries.values())
        if pending:
            _done, still = await asyncio.wait(pending, timeout=timeout_s)
            for future in still:
                future.cancel()
        await self._marks.close()
