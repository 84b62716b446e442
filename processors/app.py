"""The worker's parts around its two clients: partition fences, the rebalance hooks, the
dispatcher and the offset commits on the runs topic's consumer (topics/kafka/intake.py),
and the Faust app that hosts them with its producer and timers.

processors/bootstrap.py composes them (``build_worker``); every part gets its
collaborators when it is constructed.

The runs topic is not consumed through Faust: aiokafka speaks only Kafka's eager
rebalance protocol, under which every join or leave revokes every partition from every
member (see ARCHITECTURE.md, "Rebalances"). Faust starts no consumer here
(:class:`ProducerBoot`); it runs the producer (chunks, events, heartbeats), the timers
and the worker's lifecycle, and koda's group member joins through librdkafka on an
incremental protocol. A partition that stays with its worker is never revoked, so its
runs go on; one that moves is drained up to the handoff ceiling and committed in the
revoke hook, before librdkafka lets the next owner have it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import faust
from faust.app.base import BootStrategy
from faust.transport.drivers import aiokafka as faust_aiokafka

from koda_runtime.background import BackgroundTask
from koda_runtime.kafka import aiokafka_security
from koda_runtime.lifecycle.handler import CancelToken
from koda_runtime.metrics import HANDOFF_SECONDS, PARTITIONS_MOVED, REBALANCES
from koda_runtime.processors.chains import ChainSet
from koda_runtime.processors.control import ControlListener
from koda_runtime.processors.cursor import PartitionCursors, encode_done
from koda_runtime.processors.groupcommit import GroupWriter
from koda_runtime.processors.health import GroupMembership
from koda_runtime.processors.memory.distiller import MemoryDistiller
from koda_runtime.processors.ops import WorkerOps
from koda_runtime.processors.runner import FencedOut, Record, RunExecutor
from koda_runtime.processors.store import Fence, RunStore
from koda_runtime.settings import Settings
from koda_runtime.topics.kafka.intake import Fetched, RunsIntake
from koda_runtime.topics.kafka.offsets import GroupOffsetReader

log = logging.getLogger("koda.worker")

COMMIT_INTERVAL_S = 1.0
# How often the per-partition queue ages are measured for /metrics.
GAUGES_INTERVAL_S = 2.0
# How long a stopping worker waits for its runs consumer to leave the group after the
# drain and the final commit. Past it the process ends anyway: its partitions move when
# the broker expires the member (one session timeout), and their next owner reads from
# the final commit.
LEAVE_CLOSE_S = 5.0
# How long a stopping worker waits for the records it produced to be delivered.
PRODUCER_FLUSH_S = 3.0
# Everything a stopping worker does after its drain (final commit, leaving the group,
# flushing, the heartbeat tombstone, closing its clients) fits in this, or the process
# ends anyway (see :func:`end_after`).
STOP_AFTER_DRAIN_S = 15.0


class PartitionFences:
    """The fencing tokens (partition epochs) of the runs partitions this worker holds."""

    def __init__(self, store: RunStore, runs_topic: str, worker_id: str) -> None:
        self.store = store
        self.runs_topic = runs_topic
        self.worker_id = worker_id
        self.fences: dict[int, Fence] = {}
        # The runs partitions of the current assignment. Faust stamps records fetched just
        # before a rebalance with the *new* generation, so the generation alone does not
        # tell a record of a partition this worker just lost.
        self.assigned: set[int] = set()
        # Epoch bumps in progress. A record can arrive while on_assigned is still taking
        # the epochs (or before it starts); bumping a second time would fence out the run
        # that the first bump let start, and its chain would close for good.
        self.taking: dict[int, asyncio.Future[Fence]] = {}

    async def fence_for(self, partition: int) -> Fence:
        fence = self.fences.get(partition)
        if fence is not None:
            return fence
        if partition not in self.assigned:
            # Taking the epoch of a partition we do not hold would fence out its owner.
            raise FencedOut(f"partition {partition} is not assigned to this worker")
        pending = self.taking.get(partition)
        if pending is not None:
            return await asyncio.shield(pending)
        return (await self.take([partition]))[partition]

    async def take(self, partitions: list[int]) -> dict[int, Fence]:
        """Bump the epochs of ``partitions`` once; concurrent askers share the result."""
        loop = asyncio.get_running_loop()
        mine = {p: loop.create_future() for p in partitions}
        self.taking.update(mine)
        try:
            epochs = await self.store.bump_epochs(self.runs_topic, partitions, self.worker_id)
            fences = {p: Fence(self.runs_topic, p, e) for p, e in epochs.items()}
            self.fences.update(fences)
        except BaseException as exc:
            for fut in mine.values():
                fut.set_exception(exc)
                fut.exception()  # retrieved: nobody may be waiting
            raise
        finally:
            for p, fut in mine.items():
                if self.taking.get(p) is fut:
                    del self.taking[p]
        for p, fut in mine.items():
            fut.set_result(fences[p])
        return fences

    def untaken(self, partitions: list[int]) -> list[int]:
        """Those of ``partitions`` with no fence taken, or being taken, yet."""
        return [p for p in partitions if p not in self.fences and p not in self.taking]


class RecordProcessor:
    """What a partition chain does with one record: fence it, then run the executor."""

    def __init__(self, fences: PartitionFences, executor: RunExecutor) -> None:
        self.fences = fences
        self.executor = executor

    async def process(self, item: Fetched, partition: int, cancel: CancelToken) -> None:
        record = Record(item.topic, partition, item.offset, item.key, item.value, item.headers)
        fence = await self.fences.fence_for(partition)
        delay = 0.2
        while True:
            try:
                await self.executor.process(record, fence, cancel)
                return
            except FencedOut as exc:
                # A write found the run no longer owned by this fence. If another worker
                # has taken the partition, the chain closes (its records are that
                # worker's now). If the partition is still this worker's, only the run's
                # row moved on under it (a cancel or an end decided on another path, a
                # finish whose commit was acknowledged too late to be seen): closing
                # would stall the partition for good, so the record is processed again
                # and the executor finds the run as it now is (ended: acked).
                if partition not in self.fences.assigned or not await self.fences.store.holds(
                    fence
                ):
                    raise
                log.warning(
                    "run fenced out on a partition still held partition=%d offset=%d: %s;"
                    " processing the record again",
                    partition,
                    item.offset,
                    exc,
                )
                await asyncio.sleep(delay)
                delay = min(5.0, delay * 2)


class OffsetCommits:
    """Acks in, commits out: the partition cursors decide what may be committed (from
    the first unacked offset, never over a hole), ``commit`` sends it.

    Commits are serialised: a periodic commit finishing after a revoke's would move the
    group's offset back.

    A commit the broker refused (a coordinator moving, a broker restarting) is sent
    again by the next flush, for the partitions still held: the commit cursor has
    already moved past those offsets, so without it a partition that receives no
    further record would keep its old committed offset until it is revoked, and its
    next owner would read those records again (a chaos run's last check caught one).
    """

    def __init__(
        self,
        cursors: PartitionCursors,
        commit: Callable[[dict[int, int], dict[int, str]], Awaitable[bool]],
        *,
        interval_s: float = COMMIT_INTERVAL_S,
    ) -> None:
        self.cursors = cursors
        self._commit = commit
        self.interval_s = interval_s
        self.acked: dict[int, list[int]] = {}
        self.unconfirmed: dict[int, int] = {}  # offsets whose commit failed, to send again
        self.sent_done: dict[int, str] = {}  # the metadata last sent per partition
        self._lock = asyncio.Lock()
        self.task = BackgroundTask("offset-commits", self._every_interval)

    def ack(self, item: Fetched) -> None:
        self.acked.setdefault(item.partition, []).append(item.offset)

    async def flush(self, partitions: list[int] | None = None) -> None:
        """Commit what the acks of ``partitions`` (default: all) allow, and wait."""
        async with self._lock:
            wanted = set(self.acked) | set(self.unconfirmed)
            due: dict[int, int] = {}
            for p in sorted(wanted) if partitions is None else partitions:
                retry = self.unconfirmed.pop(p, None)
                if retry is not None and self.cursors.holds(p):
                    due[p] = retry
                acked = self.acked.get(p)
                if not acked:
                    continue
                acked.sort()
                offset = self.cursors.take_commit(p, acked)
                if offset is not None:
                    due[p] = offset  # past any retried offset: the cursor only moves on
                elif acked and self.sent_done.get(p, "") != self._done(p, acked):
                    # Records above the low-water mark ended since the last commit: the
                    # same offset again, with the metadata that names them.
                    current = self.cursors.commit_offset(p)
                    if current is not None:
                        due[p] = current
            if not due:
                return
            metadata = {p: self._done(p, self.acked.get(p, [])) for p in due}
            ok = False
            try:
                ok = await self._commit(due, metadata)
            finally:
                if ok:
                    self.sent_done.update(metadata)
                else:
                    self.unconfirmed.update(due)  # each p's earlier entry was taken above

    def _done(self, partition: int, acked: list[int]) -> str:
        """The commit metadata naming ``acked`` (what ended above the low-water mark)."""
        commit = self.cursors.commit_offset(partition)
        if commit is None:
            return ""
        return encode_done(commit, sorted(o for o in acked if o >= commit))

    def forget(self, partitions: list[int]) -> None:
        for p in partitions:
            self.acked.pop(p, None)
            self.unconfirmed.pop(p, None)
            self.sent_done.pop(p, None)

    async def _every_interval(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.flush()
            except Exception:  # noqa: BLE001 - retried at the next interval
                log.exception("event=commit_failed")


class WorkerRuntime:
    """What the dispatcher and the rebalance hooks share: the fences, the partition
    chains, the read/commit cursors and the offset commits of the runs partitions.

    It is the intake's :class:`~koda_runtime.topics.kafka.intake.RebalanceHooks`: each hook
    runs while librdkafka waits for it, so a revoked partition is handed on only after
    its drain and its final commit.
    """

    def __init__(
        self,
        settings: Settings,
        fences: PartitionFences,
        chains: ChainSet,
        cursors: PartitionCursors,
        commits: OffsetCommits,
        membership: GroupMembership,
    ) -> None:
        self.settings = settings
        self.fences = fences
        self.chains = chains
        self.cursors = cursors
        self.commits = commits
        self.membership = membership
        self.runs_topic = fences.runs_topic
        self.gauges = BackgroundTask("queue-gauges", self._gauges_every)

    async def _gauges_every(self) -> None:
        while True:
            self.chains.refresh_metrics()
            await asyncio.sleep(GAUGES_INTERVAL_S)

    @property
    def assigned(self) -> set[int]:
        return self.fences.assigned

    def held(self) -> list[int]:
        """The runs partitions this worker holds: fenced (assigned) or with chains
        (draining)."""
        return sorted(set(self.fences.fences) | set(self.chains.held()))

    def in_flight(self) -> int:
        return self.chains.in_flight

    async def assigned_hook(self, partitions: list[int]) -> None:
        """Partitions added to this worker's assignment (incremental: only the new ones)."""
        self.membership.on_rebalance_end(None, None)
        if not partitions:
            return
        REBALANCES.labels(event="assigned").inc()
        PARTITIONS_MOVED.labels(direction="in").inc(len(partitions))
        self.fences.assigned.update(partitions)
        log.info(
            "event=rebalance assigned=%s holding=%s worker_id=%s",
            partitions,
            sorted(self.fences.assigned),
            self.settings.worker_id,
        )
        # A partition whose first record already took (or is taking) its epoch in this
        # assignment keeps it; revoke dropped the fences of the previous one.
        todo = self.fences.untaken(partitions)
        if not todo:
            return
        try:
            await self.fences.take(todo)
        except Exception:  # noqa: BLE001 - fences are taken lazily on first record instead
            log.exception("could not take partition epochs; will retry on first record")
            return
        log.info("assigned partitions=%s worker_id=%s", partitions, self.settings.worker_id)

    async def revoked_hook(self, partitions: list[int]) -> None:
        """Partitions taken from this worker: drain them up to the ceiling, commit."""
        if not partitions:
            return
        self.membership.on_rebalance_start(None)
        PARTITIONS_MOVED.labels(direction="out").inc(len(partitions))
        await self.on_revoked(partitions)
        try:
            await self.commits.flush(partitions)
        finally:
            self._forget(partitions)

    async def lost_hook(self, partitions: list[int]) -> None:
        """Partitions this worker lost without a revoke (its membership expired): the
        next owner may be running them already, so nothing waits and nothing commits."""
        if not partitions:
            return
        PARTITIONS_MOVED.labels(direction="out").inc(len(partitions))
        log.warning(
            "event=partitions_lost partition lost partitions=%s: the group expired this"
            " member (paused or cut off past the session timeout)",
            partitions,
        )
        await self.on_revoked(partitions, ceiling_s=0.0)
        self._forget(partitions)

    def _forget(self, partitions: list[int]) -> None:
        self.cursors.forget(partitions)
        self.commits.forget(partitions)

    async def on_revoked(
        self, partitions: list[int], *, ceiling_s: float | None = None
    ) -> dict[str, Any]:
        REBALANCES.labels(event="revoked").inc()
        self.fences.assigned.difference_update(partitions)
        loop = asyncio.get_running_loop()
        started = loop.time()
        ceiling = self.settings.handoff_ceiling_s if ceiling_s is None else ceiling_s
        result = await self.chains.drain(partitions, ceiling)
        for p in partitions:
            self.fences.fences.pop(p, None)
        HANDOFF_SECONDS.observe(loop.time() - started)
        log.info("revoked partitions=%s drain=%s", partitions, result)
        return result


class RuntimeHooks:
    """The runtime's hooks under the names the intake calls."""

    def __init__(self, runtime: WorkerRuntime) -> None:
        self.runtime = runtime

    async def assigned(self, partitions: list[int]) -> None:
        await self.runtime.assigned_hook(partitions)

    async def revoked(self, partitions: list[int]) -> None:
        await self.runtime.revoked_hook(partitions)

    async def lost(self, partitions: list[int]) -> None:
        await self.runtime.lost_hook(partitions)


class Dispatcher:
    """Takes the intake's batches in fetch order and queues each record on its
    partition's chain, exactly once and without a hole (the partition cursors)."""

    def __init__(self, runtime: WorkerRuntime, generation: Callable[[int], int | None]) -> None:
        self.runtime = runtime
        self.generation = generation
        self.queue: asyncio.Queue[list[Fetched]] = asyncio.Queue()
        self.task = BackgroundTask("runs-dispatcher", self._run)

    def deliver(self, batch: list[Fetched]) -> None:
        self.queue.put_nowait(batch)

    def current(self, item: Fetched) -> bool:
        """A record of the partition's current assignment here. One fetched before the
        partition was revoked (or revoked and assigned again) belongs to its owner."""
        return (
            item.partition in self.runtime.assigned
            and self.generation(item.partition) == item.generation
        )

    async def _run(self) -> None:
        while True:
            batch = await self.queue.get()
            for item in batch:
                await self.dispatch(item)

    async def dispatch(self, item: Fetched) -> None:
        rt = self.runtime
        if not self.current(item) or not await self._admit(item):
            return
        if not self.current(item):
            return  # the assignment changed while the cursor looked its base up
        if rt.cursors.ended_before(item.partition, item.offset):
            # Ended under an earlier owner (the commit's metadata says so): acked as is.
            rt.cursors.advance(item.partition, item.offset)
            rt.commits.ack(item)
            return
        created = item.created or None  # no timestamp: the queue age counts from now
        if rt.chains.dispatch(item, item.partition, item.offset, item.key, created):
            rt.cursors.advance(item.partition, item.offset)

    async def _admit(self, item: Fetched) -> bool:
        try:
            return await self.runtime.cursors.admit(item.partition, item.offset, item.generation)
        except Exception as exc:  # noqa: BLE001 - the broker may be restarting
            # Never wait here: every partition's records queue behind this one. The
            # record is dropped; the tail check finds the partition behind its consumer
            # position once the broker answers again and seeks back for it.
            log.warning("cannot place partition=%d offset=%d: %s", item.partition, item.offset, exc)
            return False


class IdempotentProducer(faust_aiokafka.Producer):
    def _settings_extra(self) -> dict[str, Any]:
        return {**super()._settings_extra(), "acks": "all", "enable_idempotence": True}

    async def flush(self) -> None:
        """Faust's flush on stop, bounded: with the broker away it would wait for good.
        What it gives up is safe to lose: a run's records are acked only after their
        deliveries, so the next owner meets an undelivered run again; heartbeats and
        probes are rewritten by the next process."""
        try:
            await asyncio.wait_for(super().flush(), PRODUCER_FLUSH_S)
        except TimeoutError:
            log.warning("event=producer_flush_timeout waited_s=%.0f", PRODUCER_FLUSH_S)


class KodaTransport(faust_aiokafka.Transport):
    Producer = IdempotentProducer


class ProducerBoot(BootStrategy):
    """Faust without its consumer (and so without its conductor and tables): the runs
    topic has koda's own group member."""

    enable_kafka_consumer = False


class KodaApp(faust.App):
    """The Faust app with koda's producer, and the worker's services started and
    stopped around it.

    ``runtime``: the rebalance hooks' state. ``intake``: the runs topic's group member.
    ``dispatcher``: its records onto the chains. ``control``: the run-control tail.
    ``ops``: heartbeat, probes and lag. ``offsets``: the cursors' offsets reader.
    ``group_writer``: the executor's group commit, closed after the final commit.
    ``prepare_group``: sets the group's own configuration before this member joins.
    ``distiller``: distils done runs' memories off their path (None: the handler does
    not remember); started with the worker, so an idle worker still finishes the
    distillations a killed one left.
    """

    BootStrategy = ProducerBoot

    def __init__(
        self,
        id: str,
        *,
        runtime: WorkerRuntime,
        intake: RunsIntake,
        dispatcher: Dispatcher,
        control: ControlListener,
        ops: WorkerOps,
        offsets: GroupOffsetReader,
        group_writer: GroupWriter,
        prepare_group: Callable[[], Awaitable[object]],
        distiller: MemoryDistiller | None = None,
        **options: Any,
    ) -> None:
        super().__init__(id, **options)
        self.prepare_group = prepare_group
        self.runtime = runtime
        self.intake = intake
        self.dispatcher = dispatcher
        self.control = control
        self.ops = ops
        self.offsets = offsets
        self.group_writer = group_writer
        self.distiller = distiller

    def _new_transport(self) -> Any:
        return KodaTransport(self.conf.broker_consumer, self)

    def _new_producer(self) -> Any:
        return IdempotentProducer(self.transport, loop=self.loop, beacon=self.beacon)

    async def on_started(self) -> None:
        await super().on_started()
        await self.control.start()
        await self.ops.start()
        # Last: records need the producer, the control tail and the fences' store.
        await self.prepare_group()
        self.dispatcher.task.start()
        self.runtime.commits.task.start()
        self.runtime.gauges.start()
        self.intake.start()
        if self.distiller is not None:
            self.distiller.start()

    async def leave(self) -> None:
        """The graceful end of the runs: stop taking records, drain every held partition
        up to the ceiling, commit, then leave the group (nothing is left to revoke)."""
        rt = self.runtime
        rt.chains.accepting = False
        try:
            await rt.on_revoked(rt.chains.held())
            end_after(STOP_AFTER_DRAIN_S)
            # A periodic commit still waiting for the broker gives way to the final one.
            await rt.commits.task.stop()
            await rt.commits.flush()
        finally:
            await rt.commits.task.stop()
            await rt.gauges.stop()
            await self.intake.stop(LEAVE_CLOSE_S)
            await self.dispatcher.task.stop()

    async def on_stop(self) -> None:
        # Heartbeat tombstone and health server go last: after the drain and the
        # final commit (in leave(), on the app's shutdown signal), while the producer
        # still runs.
        try:
            if self.distiller is not None:
                await self.distiller.stop()
            await super().on_stop()
        finally:
            await self.ops.stop(crashed=self.crashed)
            await self.offsets.aclose()
            await self.group_writer.close()
            # Last: a cancel arriving while the drain waits for runs must still reach them.
            await self.control.stop()


def end_after(seconds: float) -> threading.Timer:
    """End this process (exit status 0) if it is still running ``seconds`` from now.

    Called once a stopping worker has drained: everything it owes is durable by then
    (the runs' rows and, acked only after their deliveries, their records; the offsets
    it could not commit are read again by the next owner, which skips what is done).
    What is left is courtesy (leaving the group, a heartbeat tombstone) and each step
    has its own bound, but with the broker or the database away those bounds add up
    past an orchestrator's grace period, and a client's close can wait for its request
    timeout: the deadline makes SIGTERM's end a promise."""

    def end() -> None:
        log.warning("event=stop_overdue waited_s=%.0f: ending the process", seconds)
        for stream in (sys.stderr, sys.stdout):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001, S110 - ending regardless
                pass
        os._exit(0)

    timer = threading.Timer(seconds, end)
    timer.daemon = True
    timer.start()
    return timer


def faust_settings(settings: Settings, datadir: str) -> dict[str, Any]:
    """The Faust configuration derived from koda's settings."""
    hosts = ";".join(f"kafka://{h}" for h in settings.kafka_bootstrap.split(","))
    broker_credentials: faust.SASLCredentials | faust.SSLCredentials | None = None
    sec = aiokafka_security(settings)
    # Faust picks the protocol from the credentials: SASL without an ssl_context is
    # SASL_PLAINTEXT and no credentials is PLAINTEXT, whatever the protocol setting says.
    if sec.get("sasl_mechanism"):
        broker_credentials = faust.SASLCredentials(
            username=sec.get("sasl_plain_username"),
            password=sec.get("sasl_plain_password"),
            mechanism=sec["sasl_mechanism"],
            ssl_context=sec.get("ssl_context"),
        )
    elif sec.get("ssl_context") is not None:
        broker_credentials = faust.SSLCredentials(sec["ssl_context"])
    return {
        "broker": hosts,
        "broker_credentials": broker_credentials,
        "key_serializer": "raw",
        "value_serializer": "raw",
        "topic_allow_declare": False,
        "topic_disable_leader": True,
        "web_enabled": False,
        "datadir": datadir,
        "broker_request_timeout": max(settings.rebalance_timeout_s, settings.session_timeout_s)
        + 10,
        "producer_acks": -1,
        "producer_linger_ms": 2,
    }
