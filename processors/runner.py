"""Execute one runs-topic record: decode, claim, stream, retry, finish or dead-letter.

``RunExecutor.process`` returns normally when the record may be acked (its
outcome is durable in Postgres and on the topics), and raises :class:`FencedOut`
when this worker no longer owns the partition: then nothing is acked and the
successor redoes the work. ``asyncio.CancelledError`` (handoff ceiling) also
leaves the record unacked.

Any other exception makes the record's chain try it again in place (processors/
chains.py). Before the record's run is claimed that is bounded (:class:`RecordTries`):
a record that keeps failing there (a bug, a record no code path expected, or an
outage that lasts) is dead-lettered ``failed_before_claim`` after
``KODA_RECORD_TRIES`` tries spaced :data:`RECORD_TRY_SPACING_S`, then twice that, and
so on, so an outage of a minute or two turns no good record into a dead letter. Once
its run is claimed, the run's own attempt bounds apply.

The executor is a thin service: what an attempt leads to (start, retry, give up,
reset) is decided by :mod:`koda_runtime.lifecycle.attempts`; it talks to Postgres through a
:class:`~koda_runtime.processors.ports.WorkerStore` (every claim, batch and finish through the
group writer) and to Kafka through a :class:`~koda_runtime.processors.ports.RunOutput`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from koda_runtime import tracing
from koda_runtime.errors import HandlerError, RecordError
from koda_runtime.lifecycle.attempts import (
    ERROR_ROW_CHARS,
    MAX_CLAIMS_PER_ATTEMPT,
    GiveUp,
    Retry,
    after_claim,
    after_failure,
    end_event,
    first_output,
)
from koda_runtime.lifecycle.chunks import ChunkKind, SeqCounter, storable
from koda_runtime.lifecycle.handler import CancelToken, Handler, RunContext, RunFailed, Usage
from koda_runtime.lifecycle.ledger import Outcome
from koda_runtime.lifecycle.retry import RetryPolicy
from koda_runtime.lifecycle.states import RunStatus
from koda_runtime.lifecycle.turns import Turn
from koda_runtime.metrics import (
    QUEUE_AGE_SECONDS,
    RETRIES,
    RUN_DURATION_SECONDS,
    RUNS,
    RUNS_WAITING,
)
from koda_runtime.processors import faults
from koda_runtime.processors.billing import Billing
from koda_runtime.processors.chains import Parked
from koda_runtime.processors.control import ControlBoard, RunControl
from koda_runtime.processors.fences import FencedOut
from koda_runtime.processors.groupcommit import GroupWriter
from koda_runtime.processors.history import history_for
from koda_runtime.processors.memory.distiller import distiller_for
from koda_runtime.processors.ports import Record, RunOutput, WorkerStore
from koda_runtime.processors.republish import ChunkRepair
from koda_runtime.processors.streaming import (
    AttemptLimits,
    CallTally,
    ChunkBatcher,
    OutputRefused,
    refusal,
    stream,
)
from koda_runtime.processors.tools import AwaitingApproval, build_toolbox
from koda_runtime.schemas.epochs import Fence
from koda_runtime.schemas.runs.worker import ClaimWrite, Finished, FinishWrite, RunRow, Superseded
from koda_runtime.settings import Settings
from koda_runtime.topics.records.codec import (
    RUN_REQUESTED,
    RunRequested,
    decode_run_requested,
    header_value,
    headers_for,
)

__all__ = [
    "MAX_CLAIMS_PER_ATTEMPT",
    "ChunkBatcher",
    "Predecessor",
    "Record",
    "RecordTries",
    "RunExecutor",
]

log = logging.getLogger("koda.worker")

# A run waiting for a person looks at its row again this often even when no control
# record woke it (one was missed): Postgres holds the decision.
APPROVAL_RECHECK_S = 30.0

# The offset a dead letter names for a trigger the worker made itself (a predecessor's;
# schemas/record_specs.py documents it).
NO_OFFSET = -1

# A failure before the claim counts as a try only this long after the first try, then
# twice as long after the second, and so on: KODA_RECORD_TRIES tries (default 5) span at
# least 8 + 16 + 32 + 64 = 120 s. The chain retries every 0.2 s doubling up to 10 s, so
# the uncounted failures in between cost little; a database outage shorter than that
# span dead-letters nothing.
RECORD_TRY_SPACING_S = 8.0
# A record not seen failing for this long is no longer retried here (revoked, or it
# passed): its tally is dropped.
FORGET_TRIES_AFTER_S = 900.0


@dataclass
class Tally:
    """The failures of one record before its run was claimed."""

    first: float  # monotonic time of the first failure
    last: float  # of the latest failure
    counted_at: float  # of the latest failure counted as a try
    tries: int = 1
    failures: int = 1


class RecordTries:
    """Counts, per record (topic, partition, offset), its failures before its run is
    claimed, and says when it has had its ``tries``.

    The count lives in the worker process: a record the chain retries in place is the
    same record each time, and one that comes back after a rebalance to the same worker
    keeps its tally. A restarted worker starts counting again, which only lengthens the
    bound.
    """

    def __init__(
        self,
        tries: int,
        *,
        spacing_s: float = RECORD_TRY_SPACING_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.tries = tries
        self.spacing_s = spacing_s
        self._clock = clock
        self._tallies: dict[tuple[str, int, int], Tally] = {}
        self._pruned = clock()

    def failed(self, record: Record) -> Tally | None:
        """Count a failure of ``record``; its tally once it has had its tries (it stays
        counted until :meth:`forget`), else None."""
        now = self._clock()
        self._prune(now)
        where = (record.topic, record.partition, record.offset)
        tally = self._tallies.get(where)
        if tally is None:
            tally = self._tallies[where] = Tally(now, now, now)
        else:
            tally.failures += 1
            tally.last = now
            if now - tally.counted_at >= self.spacing_s * 2 ** (tally.tries - 1):
                tally.tries += 1
                tally.counted_at = now
        return tally if tally.tries >= self.tries else None

    def forget(self, record: Record) -> None:
        """``record`` succeeded or was dead-lettered: drop its tally."""
        if self._tallies:
            self._tallies.pop((record.topic, record.partition, record.offset), None)

    def __len__(self) -> int:
        return len(self._tallies)

    def _prune(self, now: float) -> None:
        if now - self._pruned < 60.0:
            return
        self._pruned = now
        for where, tally in list(self._tallies.items()):
            if now - tally.last > FORGET_TRIES_AFTER_S:
                del self._tallies[where]


@dataclass
class Progress:
    """How far one ``process`` call got: ``claimed`` once a run was claimed in it."""

    claimed: bool = False


@dataclass(frozen=True)
class Predecessor:
    """A user's older unfinished run, run before ``record``'s own: the user's order is
    the order of creation, and its own trigger is late or lost, so none is in hand."""

    run: RunRow
    record: Record  # the record whose run waits for this one

    @property
    def partition(self) -> int:
        return self.record.partition

    @property
    def offset(self) -> int:
        return self.record.offset

    def letter(self) -> Record:
        """What its dead letter carries: a ``run.requested`` trigger for the run, with no
        offset, as no record of it was read."""
        run = self.run
        return Record(
            self.record.topic,
            self.record.partition,
            NO_OFFSET,
            run.user_id.encode(),
            RunRequested(run.id, run.user_id, run.session_id, "").encode(),
            headers_for(RUN_REQUESTED),
        )


Trigger = Record | Predecessor

# The word a fenced-out finish names itself by, in its error.
_FINISH_VERB = {RunStatus.DONE: "finish", RunStatus.FAILED: "fail", RunStatus.CANCELLED: "cancel"}


def _all_delivered(run_id: str, delivered: list[Any]) -> bool:
    """Whether every delivery of a finished run succeeded. A record the broker refused
    for itself (:func:`refusal`) is logged: the run stays ended, but is not marked
    whole on the chunk topic. Any other failure is raised (the chain tries again)."""
    failures = [d for d in delivered if isinstance(d, BaseException)]
    for failure in failures:
        if refusal(failure) is None:
            raise failure
    for failure in failures:
        log.error("event=output_refused run_id=%s after its finish: %s", run_id, refusal(failure))
    return not failures


def _run_spans(trigger: Trigger, run_id: str, worker_id: str) -> AbstractContextManager[Any]:
    """The run's attempt spans (koda/tracing.py): children of the trace the record's
    headers carry; a predecessor run, which has no record in hand, is linked to it."""
    if not tracing.ON:
        return contextlib.nullcontext()
    record = trigger.record if isinstance(trigger, Predecessor) else trigger
    header = header_value(record.headers, tracing.HEADER)
    own = not isinstance(trigger, Predecessor)
    return tracing.run_spans(
        parent=header if own else None,
        links=() if own else tracing.links_to(header),
        attributes={
            "koda.run_id": run_id,
            "koda.worker_id": worker_id,
            "messaging.system": "kafka",
            "messaging.destination.name": record.topic,
            "messaging.destination.partition.id": str(record.partition),
            "messaging.kafka.offset": record.offset,
        },
    )


def _model_of(handler: Handler) -> str:
    """The model an estimated call is priced as: the handler's, else its name."""
    return str(getattr(handler, "model", handler.name))


class ModelSlots:
    """The worker's cap on runs calling the model at once (``KODA_MODEL_CONCURRENCY``,
    the provider's quota; 0: none but ``KODA_MAX_INFLIGHT``).

    A run takes its slot before its claim and keeps it through its attempts, so a run
    waiting here is still ``pending`` in Postgres and counted in
    ``koda_runs_waiting{reason="model_cap"}``; the cluster's figure is workers x cap.
    """

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.waiting = 0
        self._sem = asyncio.Semaphore(cap) if cap > 0 else None

    @contextlib.asynccontextmanager
    async def hold(self) -> AsyncIterator[None]:
        if self._sem is None:
            yield
            return
        self.waiting += 1
        RUNS_WAITING.labels(reason="model_cap").set(self.waiting)
        try:
            await self._sem.acquire()
        finally:
            self.waiting -= 1
            RUNS_WAITING.labels(reason="model_cap").set(self.waiting)
        try:
            yield
        finally:
            self._sem.release()


class RunExecutor:
    """Runs records through the lifecycle; one instance per worker process."""

    def __init__(
        self,
        settings: Settings,
        store: WorkerStore,
        emitter: RunOutput,
        handler: Handler,
        writer: GroupWriter,
    ) -> None:
        """``writer`` groups the claims, chunk batches and finishes into shared
        transactions on ``store``; whoever built it closes it (the worker's composition
        root, after the final commit)."""
        self.settings = settings
        self.store = store
        self.emitter = emitter
        self.handler = handler
        self.writer = writer
        self.repair = ChunkRepair(store, emitter, self.writer)
        self.policy = RetryPolicy(settings.max_attempts, settings.retry_base_s)
        self.worker_id = settings.worker_id
        self.board = ControlBoard()
        store.observer = self.board.observe
        self.billing = Billing(settings.cost_ledger, store, emitter, _model_of(handler))
        self.model_slots = ModelSlots(settings.model_concurrency)
        self.tries = RecordTries(settings.record_tries)
        self.history = history_for(store, settings.context_tokens)
        # The tools users add and their journal (processors/tools/): ConfigError at start
        # for a module that does not import or a bad declaration.
        self.toolbox = build_toolbox(settings, store)
        use_tools = getattr(handler, "use_tools", None)
        if callable(use_tools):
            use_tools(self.toolbox)
        # Distils a done run's memories off its path (processors/memory/distiller.py);
        # None when the handler does not remember.
        self.distiller = distiller_for(handler, settings)

    async def process(self, record: Record, fence: Fence, cancel: CancelToken) -> None:
        """Do the record's work; return when it may be acked.

        A failure before the record's run is claimed is raised for the chain to retry
        until the record has had its tries (:class:`RecordTries`); then the record is
        dead-lettered ``failed_before_claim`` with the last error, and acked.
        """
        if self.distiller is not None:
            self.distiller.start()  # no-op while it runs
        progress = Progress()
        try:
            await self._process(record, fence, progress)
        except (FencedOut, Parked):
            raise
        except Exception as exc:
            if progress.claimed:
                raise  # the run's own attempts and claims bound it from here
            tally = self.tries.failed(record)
            if tally is None:
                raise
            error = (
                f"failed {tally.failures} times over {tally.last - tally.first:.0f} s before "
                f"its run was claimed ({tally.tries} tries counted); last error: "
                f"{type(exc).__name__}: {exc}"
            )
            log.warning(
                "dead-letter reason=failed_before_claim partition=%d offset=%d: %s",
                record.partition,
                record.offset,
                error[:500],
            )
            await self._dead_letter(record, 0, "failed_before_claim", error)
        self.tries.forget(record)

    async def _process(self, record: Record, fence: Fence, progress: Progress) -> None:
        where = f"partition={record.partition} offset={record.offset}"
        try:
            req = decode_run_requested(record.key, record.value, record.headers)
        except RecordError as exc:
            log.warning("dead-letter reason=%s %s", exc.reason, where)
            await self._dead_letter(record, 0, exc.reason, exc.detail)
            return
        faults.before_claim(self.settings.test_fault, req.user_id)
        run = await self.store.load_run(req.run_id)
        if run is None:
            if await self.store.erased(req.user_id):
                # Its user was erased (gateway/erasure.py): nothing of the run may come
                # back, not even as a dead letter holding the user's id.
                log.info("skip erased run_id=%s %s", req.run_id, where)
                return
            await self._dead_letter(record, 0, "unknown_run", f"no run {req.run_id} in Postgres")
            return
        if run.user_id != req.user_id:
            await self._dead_letter(record, 0, "user_mismatch", "record user is not the run's")
            return
        if run.status.terminal:
            log.info("skip terminal run_id=%s status=%s %s", run.id, run.status.value, where)
            await self.repair.terminal(run, fence.partition)
            return
        for pred in await self.store.unfinished_predecessors(run) if run.older_unfinished else []:
            log.info("predecessor first run_id=%s before=%s", pred.id, run.id)
            await self._execute(Predecessor(pred, record), pred, fence, progress)
        await self._execute(record, run, fence, progress)

    async def _execute(
        self, trigger: Trigger, run: RunRow, fence: Fence, progress: Progress
    ) -> None:
        if run.status is RunStatus.WAITING:
            await self._still_waiting(run.id)
        async with self.model_slots.hold():
            control = self.board.open(run.id)
            try:
                with _run_spans(trigger, run.id, self.worker_id):  # one span per attempt
                    await self._attempts(trigger, run, fence, control, progress)
            finally:
                self.board.close(run.id)
                self.toolbox.release(run.id)

    async def _attempts(
        self,
        trigger: Trigger,
        run: RunRow,
        fence: Fence,
        control: RunControl,
        progress: Progress,
    ) -> None:
        run_id, inp = run.id, run.input
        started = time.monotonic()
        # Every attempt's deliveries are awaited before the ack, retries' included.
        futures: list[asyncio.Future[Any]] = []
        resumed = False
        # The calls of attempts a merge stopped: in the ledger with their own attempt, and
        # in the run's usage rows with the run's ending.
        billed: list[Usage] = []
        turns: tuple[Turn, ...] | None = None
        while True:
            span = tracing.attempt()
            with tracing.span("koda.claim"):
                claim = await self.writer.claim(ClaimWrite(fence, run_id, self.worker_id))
            if claim is None:
                current = await self.store.load_run(run_id)
                if current is not None and current.status.terminal:
                    return  # someone finished it first; nothing to do
                raise FencedOut(f"run {run_id}: claim fenced out")
            progress.claimed = True
            claimed_at = time.monotonic()  # the attempt's deadline counts from here
            attempt = claim.attempt
            if span.is_recording():
                span.set_attribute("koda.attempt", attempt)
            rerun = control.attempt_version < claim.input_version
            token = control.begin(claim.input_version)
            if claim.input is not None:
                inp = claim.input
            if attempt == 1 and claim.queue_age_s is not None:
                QUEUE_AGE_SECONDS.observe(max(0.0, claim.queue_age_s))
            batcher = ChunkBatcher(
                self.writer,
                self.emitter,
                fence,
                run_id,
                attempt,
                SeqCounter(claim.next_seq),
                futures,
                self.settings.chunk_batch_size,
                claim.input_version,
                coalesce=self.settings.chunk_coalesce,
            )
            if turns is None:  # the session's earlier runs have ended: read once per run
                turns = await self.history.turns(run_id, inp)
            ctx = RunContext(
                run_id,
                run.user_id,
                inp,
                attempt,
                token,
                turns,
                max_output_tokens=self.settings.max_output_tokens or None,
            )
            self.toolbox.bind(run_id, attempt, fence)  # the tool journal's writes are fenced
            if claim.cancel_requested:
                # The request is durable: whoever claims next ends the run, never reruns it.
                if not resumed:  # earlier output may be in Postgres only (its writer died)
                    futures += await self.repair.resumed(run_id, fence.partition, claim.next_seq)
                await self._cancel(batcher, ctx, claim.cancel_reason, billed, [])
                return
            futures.append(
                await self.emitter.event(
                    fence.partition,
                    run_id,
                    "transition",
                    to=RunStatus.RUNNING.value,
                    attempt=attempt,
                    worker_id=self.worker_id,
                    **({"reason": "merged", "input_version": claim.input_version} if rerun else {}),
                )
            )
            start = after_claim(
                attempt,
                claim.failures,
                had_output=claim.had_output,
                rerun=rerun,
                policy=self.policy,
            )
            if isinstance(start, GiveUp):
                # Given up before anything is sent again: output an earlier attempt left
                # in Postgres only is the completeness pass's (processors/republish.py).
                await self._give_up(
                    trigger, batcher, ctx, start, whole=resumed or claim.next_seq == 0
                )
                return
            if not resumed:  # earlier output may be in Postgres only (its writer died)
                futures += await self.repair.resumed(run_id, fence.partition, claim.next_seq)
                resumed = True
            if start.reset:
                batcher.add(ChunkKind.RESET, json.dumps({"attempt": attempt}))
                if start.flush_reset:
                    await batcher.flush()
            log.info(
                "run start run_id=%s user_id=%s attempt=%d partition=%d offset=%d",
                run_id,
                run.user_id,
                attempt,
                trigger.partition,
                trigger.offset,
            )
            tally = CallTally([])
            batcher.book = self.billing.book(ctx, tally)
            try:
                await stream(
                    self.handler.stream(ctx),
                    batcher,
                    control,
                    tally,
                    ctx=ctx,
                    window_s=self.settings.chunk_batch_ms / 1000.0,
                    started=started,
                    limits=AttemptLimits(
                        claimed_at + self.settings.max_run_s,
                        self.settings.max_run_s,
                        self.settings.max_output_bytes,
                    ),
                )
            except AwaitingApproval as waiting:
                await self._wait(batcher, ctx, tally, waiting)  # the run is `waiting` now
                raise Parked(self._waiter(run_id, self.toolbox.approval_timeout_s)) from None
            except HandlerError as exc:
                if not control.stopping:  # stopped on purpose: the handler's complaint is moot
                    after = await self._failed(batcher, ctx, tally, exc)
                    if isinstance(after, GiveUp):
                        await self._give_up(trigger, batcher, ctx, after)
                        return
                    # Output already written stays; the next attempt starts with `reset`.
                    await asyncio.sleep(after.backoff_s)
                    continue
            except (FencedOut, asyncio.CancelledError):
                await self.billing.record_cut(fence, ctx, tally)
                raise
            own = tally.settled(self.billing.model)
            if control.cancel_requested:
                await self._cancel(batcher, ctx, control.cancel_reason, billed, own, tally.written)
                return
            if not control.stopping:
                try:
                    finished = await self._end(
                        RunStatus.DONE,
                        batcher,
                        ctx,
                        billed=billed,
                        own=own,
                        written=tally.written,
                        input_version=claim.input_version,
                        cut=tally,
                    )
                except OutputRefused as exc:  # nothing of the finish was written
                    after = await self._failed(batcher, ctx, tally, exc)
                    if isinstance(after, GiveUp):
                        await self._give_up(trigger, batcher, ctx, after)
                        return
                    raise TypeError("a refused finish is a final failure") from exc
                if isinstance(finished, Finished):
                    RUN_DURATION_SECONDS.labels(outcome="done").observe(time.monotonic() - started)
                    log.info("run done run_id=%s attempt=%d", run_id, attempt)
                    return
                # The row changed under this attempt and no signal said so: the finish
                # refused to write. Act on the row.
                if finished.cancelled:
                    control.cancel(finished.cancel_reason)
                    await self._cancel(
                        batcher, ctx, finished.cancel_reason, billed, own, tally.written
                    )
                    return
                control.merged(finished.input_version)
            futures += await self._merged_stop(batcher, ctx, tally)
            billed = [*billed, *own]

    async def _still_waiting(self, run_id: str) -> None:
        """A ``waiting`` run goes on (is claimed) once its tool step is decided, a cancel
        is requested or ``KODA_APPROVAL_TIMEOUT_S`` passed; until then :class:`Parked`."""
        journal = self.toolbox.journal
        if journal is None:
            return
        event = self.board.park(run_id)  # before the read: a decision after it wakes us
        pending = await journal.pending(run_id)
        if (
            pending is None
            or pending.status != RunStatus.WAITING.value
            or pending.cancel_requested
            or pending.decision is not None
            or pending.step is None
            or pending.age_s >= self.toolbox.approval_timeout_s
        ):
            self.board.unpark(run_id, event)
            return
        left = self.toolbox.approval_timeout_s - pending.age_s
        log.info(
            "run still waiting run_id=%s step=%s: no decision yet (%.0f s left)",
            run_id,
            pending.step,
            left,
        )
        raise Parked(self._waiter(run_id, left), f"run {run_id} waits for approval")

    def _waiter(self, run_id: str, left_s: float) -> Callable[[], Awaitable[None]]:
        """Wait (no slot held) for a control record of ``run_id``, its approval timeout,
        or :data:`APPROVAL_RECHECK_S`; then the chain processes its record again."""
        event = self.board.park(run_id)

        async def wait() -> None:
            try:
                await asyncio.wait_for(event.wait(), timeout=min(left_s, APPROVAL_RECHECK_S))
            except TimeoutError:
                pass
            finally:
                self.board.unpark(run_id, event)

        return wait

    async def _wait(
        self, batcher: ChunkBatcher, ctx: RunContext, tally: CallTally, waiting: AwaitingApproval
    ) -> None:
        """The model called a tool that needs a person: the ``approval_required`` event
        with what this attempt said, its calls billed (``cancelled``: the resumed attempt
        answers again), then ``→ waiting`` under the fence and its transition event."""
        fence, run_id = batcher.fence, ctx.run_id
        self.board.park(run_id)  # a decision right after the move wakes the wait
        batcher.add(ChunkKind.APPROVAL_REQUIRED, waiting.event())
        await batcher.flush()
        await asyncio.gather(*batcher.futures)
        sent = await self.billing.record_attempt(fence, ctx, tally, Outcome.CANCELLED)
        if self.toolbox.journal is not None:
            await self.toolbox.journal.park(fence, run_id)
        sent.append(
            await self.emitter.event(
                fence.partition, run_id, "transition", to=RunStatus.WAITING.value,
                attempt=ctx.attempt,
            )
        )  # fmt: skip
        await asyncio.gather(*sent)
        log.info(
            "run waiting run_id=%s attempt=%d step=%d tool=%s: for a person's approval",
            run_id,
            ctx.attempt,
            waiting.step,
            waiting.name,
        )

    async def _failed(
        self, batcher: ChunkBatcher, ctx: RunContext, tally: CallTally, exc: HandlerError
    ) -> Retry | GiveUp:
        """A handler failure: keep what the attempt said (seq stays contiguous), bill its
        calls, count the failure in Postgres; what the lifecycle says comes next.
        Output or calls Postgres or Kafka refuse here are passed over (logged): the
        failure is what the run ends with."""
        fence = batcher.fence
        try:
            await batcher.flush()
        except OutputRefused as refused:  # the batch was dropped, its calls passed over
            log.error("event=output_refused run_id=%s: %s", ctx.run_id, refused)
        # The failed attempt's calls are billed: into the ledger before anything else
        # of the failure (whoever owns the run by now).
        try:
            batcher.futures += await self.billing.record_attempt(fence, ctx, tally, Outcome.FAILED)
        except Exception as billing_error:
            if (cause := refusal(billing_error)) is None:
                raise
            log.error("event=ledger_rows_refused run_id=%s: %s", ctx.run_id, cause)
        error = storable(str(exc))
        RETRIES.inc()
        failures = await self.store.record_failure(fence, ctx.run_id)
        if failures is None:
            raise FencedOut(f"run {ctx.run_id}: failure count fenced out") from exc
        log.warning(
            "attempt failed run_id=%s attempt=%d failures=%d error=%s",
            ctx.run_id,
            ctx.attempt,
            failures,
            error[:200],
        )
        return after_failure(
            ctx.attempt, failures, error, final=isinstance(exc, RunFailed), policy=self.policy
        )

    async def _end(
        self,
        status: RunStatus,
        batcher: ChunkBatcher,
        ctx: RunContext,
        *,
        billed: list[Usage],
        own: list[Usage],
        written: int = 0,
        event_attempt: int | None = None,
        reason: str | None = None,
        error: str = "",
        input_version: int | None = None,
        cut: CallTally | None = None,
        whole: bool = True,
    ) -> Finished | Superseded:
        """The one finish: the end event, then the trailing chunks, usage, ledger rows and
        the terminal transition in one write; only then the chunks, the transition event
        and the usage events on the topics, awaited with every earlier delivery, and the
        mark that the run is whole on the chunk topic.

        ``billed``: the calls of attempts a merge stopped (usage rows only); ``own``: this
        attempt's (usage rows; ledger rows from call ``written`` on, the earlier ones
        went with its chunk batches). A refused finish (:class:`Superseded`) writes
        and produces nothing; its end event is taken back. ``cut``: an attempt whose
        calls go to the ledger as cancelled if the finish is cut off or fenced out.

        A finish Postgres refuses for its data (:func:`refusal`) wrote nothing: its
        chunks are dropped (their seqs free again), the calls no batch wrote are passed
        over (``cut``), and :class:`OutputRefused` is raised. Records Kafka refuses
        after the commit are logged, and the run is then not marked whole (``whole``
        False too: earlier output was not sent again).
        """
        fence, run_id = batcher.fence, batcher.run_id
        attempts = ctx.attempt if event_attempt is None else event_attempt
        kind, content = end_event(status, reason=reason, error=error, attempts=attempts)
        batcher.add(kind, content)
        final = batcher.take()
        outcome = Outcome.OK if status is RunStatus.DONE else Outcome.CANCELLED
        write = FinishWrite(
            fence,
            run_id,
            status,
            final,
            [*billed, *own],
            storable(error[:ERROR_ROW_CHARS]) if status is RunStatus.FAILED else None,
            first_output=first_output(batcher.streaming, final),
            input_version=input_version,
            ledger=self.billing.calls(ctx, own, outcome, written),
            distil=status is RunStatus.DONE and self.distiller is not None,
        )
        try:
            with tracing.span("koda.finish"):
                finished = await self.writer.finish(write)
            if finished is None:
                raise FencedOut(f"run {run_id}: {_FINISH_VERB[status]} fenced out")
        except (FencedOut, asyncio.CancelledError):
            # Rows the finish committed stay as written (ok); the others are cancelled.
            if cut is not None:
                await self.billing.record_cut(fence, ctx, cut)
            raise
        except Exception as exc:
            if (cause := refusal(exc)) is None:
                raise
            batcher.seq.rewind(final[0].seq)
            if cut is not None:
                cut.written = len(cut.usage)
            raise OutputRefused(f"Postgres refused the run's finish: {cause}") from exc
        if isinstance(finished, Superseded):
            batcher.give_back(final)
            return finished
        if write.distil and self.distiller is not None:
            self.distiller.wake()
        try:
            sent = await self.emitter.chunks(fence.partition, final)
        except Exception as exc:
            if (cause := refusal(exc)) is None:
                raise
            log.error("event=output_refused run_id=%s after its finish: %s", run_id, cause)
            sent, whole = [], False
        sent.append(
            await self.emitter.event(
                fence.partition,
                run_id,
                "transition",
                to=status.value,
                attempt=attempts,
                **({"reason": reason} if reason else {}),
            )
        )
        sent += await self.billing.finish_events(fence, ctx, billed, own, outcome, finished)
        delivered = await asyncio.gather(*sent, *batcher.futures, return_exceptions=True)
        whole = _all_delivered(run_id, delivered) and whole and not batcher.holed
        self.repair.published(run_id, final[-1].seq, whole=whole)
        RUNS.labels(outcome=status.value).inc()
        return finished

    async def _cancel(
        self,
        batcher: ChunkBatcher,
        ctx: RunContext,
        reason: str | None,
        billed: list[Usage],
        own: list[Usage],
        written: int = 0,
        *,
        whole: bool = True,
    ) -> None:
        """End the run ``cancelled``: partial output stays, the calls so far are billed
        (``own``, this attempt's, go to the ledger as ``cancelled`` from call ``written``
        on, an estimated one for output no usage record covered; the earlier ones are
        in it already, ``ok``), a terminal ``cancelled`` event (with the reason) ends
        every viewer's stream."""
        try:
            finished = await self._end(
                RunStatus.CANCELLED,
                batcher,
                ctx,
                billed=billed,
                own=own,
                written=written,
                reason=reason,
                whole=whole,
            )
        except OutputRefused as refused:  # ended with its end event alone
            log.error("event=output_refused run_id=%s: %s", ctx.run_id, refused)
            finished = await self._end(
                RunStatus.CANCELLED, batcher, ctx, billed=[], own=[], reason=reason, whole=whole
            )
        if not isinstance(finished, Finished):
            raise FencedOut(f"run {ctx.run_id}: cancel fenced out")
        log.info("run cancelled run_id=%s attempt=%d", ctx.run_id, ctx.attempt)

    async def _give_up(
        self,
        trigger: Trigger,
        batcher: ChunkBatcher,
        ctx: RunContext,
        give_up: GiveUp,
        *,
        whole: bool = True,
    ) -> None:
        """Retries exhausted: DLQ record, ``failed``, an ``error`` event, then ack. A
        final failure (``RunFailed``) is not dead-lettered: its record is not poison."""
        if give_up.dead_letter:
            await self._dead_letter(
                trigger.letter() if isinstance(trigger, Predecessor) else trigger,
                give_up.attempts,
                "handler_failed",
                give_up.error,
            )
        finished = await self._end(
            RunStatus.FAILED,
            batcher,
            ctx,
            billed=[],
            own=[],
            event_attempt=give_up.attempts,
            error=give_up.error,
            whole=whole,
        )
        if isinstance(finished, Superseded):  # a cancel request wins over the failure
            await self._cancel(batcher, ctx, finished.cancel_reason, [], [], whole=whole)
            return
        log.warning("run failed run_id=%s attempts=%d", ctx.run_id, give_up.attempts)

    async def _merged_stop(
        self, batcher: ChunkBatcher, ctx: RunContext, tally: CallTally
    ) -> list[asyncio.Future[Any]]:
        """A merge stopped this attempt: keep what it said (seq stays contiguous) and bill
        its calls (``cancelled``: its answer was dropped); the next claim reads the merged
        input and starts with ``reset``. Returns the usage events' deliveries."""
        await batcher.flush()
        await asyncio.gather(*batcher.futures)
        futures = await self.billing.record_attempt(batcher.fence, ctx, tally, Outcome.CANCELLED)
        log.info("run merged run_id=%s attempt=%d: running again", ctx.run_id, ctx.attempt)
        return futures

    async def _dead_letter(self, record: Record, attempts: int, reason: str, error: str) -> None:
        await self.emitter.dead_letter(record, attempts=attempts, reason=reason, error=error)
