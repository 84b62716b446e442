"""The worker: a Faust app consuming ``<env>.koda.runs`` with raw values.

Composition (``build_worker``) wires settings → engine, store, emitter, handler,
executor and the partition chains into a Faust app whose consumer drains and
commits *before* Faust forgets the revoked partitions' acks.

Faust settings that make the handoff hold (see ARCHITECTURE.md):

* ``stream_wait_empty=False``: Faust's own revoke wait has no ceiling; koda's
  drain (in ``DrainingConsumer.on_partitions_revoked``) has one.
* ``table_standby_replicas=0``: plain round-robin assignment, no Faust assignor.
* ``topic_allow_declare=False``, ``topic_disable_leader=True``: Faust creates no
  topics; ``koda topics apply`` owns them.
* ``broker_max_poll_records`` small, and the dispatcher never blocks: fetching
  continues while runs execute, so ``max.poll.interval`` is never exceeded.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
from dataclasses import dataclass, field
from typing import Any

import faust
from faust.transport.drivers import aiokafka as faust_aiokafka
from faust.types import TP

from koda.db import async_engine
from koda.kafka import aiokafka_security
from koda.lifecycle.handler import CancelToken, Handler
from koda.metrics import HANDOFF_SECONDS, REBALANCES
from koda.settings import Settings
from processors.chains import ChainSet
from processors.control import ControlListener
from processors.cursor import PartitionCursors
from processors.emitter import Emitter
from processors.groupcommit import GroupWriter
from processors.handlers import build_handler
from processors.offsets import GroupOffsetReader
from processors.ops import WorkerOps
from processors.runner import FencedOut, Record, RunExecutor
from processors.store import Fence, RunStore
from topics.catalogue import RUNS

log = logging.getLogger("koda.worker")


@dataclass
class WorkerRuntime:
    """Everything the agent and the rebalance hooks share."""

    settings: Settings
    store: RunStore
    executor: RunExecutor
    handler: Handler
    runs_topic: str
    chains: ChainSet | None = None
    cursors: PartitionCursors | None = None
    fences: dict[int, Fence] = field(default_factory=dict)
    # The runs partitions of the current assignment. Faust stamps records fetched just
    # before a rebalance with the *new* generation, so the generation alone does not
    # tell a record of a partition this worker just lost.
    assigned: set[int] = field(default_factory=set)
    app: faust.App | None = None
    # Epoch bumps in progress. A record can arrive while on_assigned is still taking
    # the epochs (or before it starts); bumping a second time would fence out the run
    # that the first bump let start, and its chain would close for good.
    taking: dict[int, asyncio.Future[Fence]] = field(default_factory=dict)

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
        return (await self._take([partition]))[partition]

    async def _take(self, partitions: list[int]) -> dict[int, Fence]:
        """Bump the epochs of ``partitions`` once; concurrent askers share the result."""
        loop = asyncio.get_running_loop()
        mine = {p: loop.create_future() for p in partitions}
        self.taking.update(mine)
        try:
            epochs = await self.store.bump_epochs(
                self.runs_topic, partitions, self.settings.worker_id
            )
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

    async def process(self, event: Any, partition: int, cancel: CancelToken) -> None:
        msg = event.message
        record = Record(msg.topic, partition, msg.offset, msg.key, msg.value, msg.headers)
        fence = await self.fence_for(partition)
        await self.executor.process(record, fence, cancel)

    async def on_assigned(self, partitions: list[int]) -> None:
        REBALANCES.labels(event="assigned").inc()
        if self.chains is not None:
            self.chains.accepting = True
        # A partition whose first record already took (or is taking) its epoch in this
        # assignment keeps it; revoke dropped the fences of the previous one.
        todo = [p for p in partitions if p not in self.fences and p not in self.taking]
        if not todo:
            return
        try:
            await self._take(todo)
        except Exception:  # noqa: BLE001 - fences are taken lazily on first record instead
            log.exception("could not take partition epochs; will retry on first record")
            return
        log.info("assigned partitions=%s worker_id=%s", partitions, self.settings.worker_id)

    async def on_revoked(self, partitions: list[int]) -> dict[str, Any]:
        REBALANCES.labels(event="revoked").inc()
        self.assigned.difference_update(partitions)
        loop = asyncio.get_running_loop()
        started = loop.time()
        result: dict[str, Any] = {}
        if self.chains is not None:
            result = await self.chains.drain(partitions, self.settings.handoff_ceiling_s)
        for p in partitions:
            self.fences.pop(p, None)
        HANDOFF_SECONDS.observe(loop.time() - started)
        log.info("revoked partitions=%s drain=%s", partitions, result)
        return result


class DrainingConsumer(faust_aiokafka.Consumer):
    """Drain and commit on revoke *before* Faust drops the revoked partitions' acks."""

    runtime: WorkerRuntime | None = None

    async def on_partitions_revoked(self, revoked: set[Any]) -> None:
        rt = self.runtime
        if rt is not None and revoked:
            ours = sorted(tp.partition for tp in revoked if tp.topic == rt.runs_topic)
            if ours:
                await rt.on_revoked(ours)
                # commit() returns False if another commit was running: ask twice.
                await self.commit(revoked)
                await self.commit(revoked)
                if rt.cursors is not None:
                    rt.cursors.forget(ours)  # after the commits, which need them
        await super().on_partitions_revoked(revoked)

    async def on_partitions_assigned(self, assigned: set[Any], generation_id: int = 0) -> None:
        # Before Faust's own callbacks, which may resume the flow before the app's
        # on_partitions_assigned signal: records arriving then must not be taken for
        # records of partitions this worker does not hold.
        rt = self.runtime
        if rt is not None:
            rt.assigned = {tp.partition for tp in assigned if tp.topic == rt.runs_topic}
        await super().on_partitions_assigned(assigned, generation_id)

    def _new_offset(self, tp: Any) -> int | None:
        # Faust's own computation commits the first run of consecutive acks even when
        # it does not start at the committed offset (always so when there is none):
        # koda's commit cursor demands that it does.
        rt = self.runtime
        if rt is None or rt.cursors is None or tp.topic != rt.runs_topic:
            return super()._new_offset(tp)
        acked = self._acked[tp]
        if not acked:
            return None
        acked.sort()
        before = set(acked)
        offset = rt.cursors.take_commit(tp.partition, acked)
        self._acked_index[tp].difference_update(before.difference(acked))
        return offset


class IdempotentProducer(faust_aiokafka.Producer):
    def _settings_extra(self) -> dict[str, Any]:
        return {**super()._settings_extra(), "acks": "all", "enable_idempotence": True}


class KodaTransport(faust_aiokafka.Transport):
    Consumer = DrainingConsumer
    Producer = IdempotentProducer


class KodaApp(faust.App):
    ops: WorkerOps | None = None
    offsets: GroupOffsetReader | None = None
    group_writer: GroupWriter | None = None
    control: ControlListener | None = None

    def _new_transport(self) -> Any:
        return KodaTransport(self.conf.broker_consumer, self)

    def _new_producer(self) -> Any:
        return IdempotentProducer(self.transport, loop=self.loop, beacon=self.beacon)

    async def on_started(self) -> None:
        await super().on_started()
        if self.control is not None:
            await self.control.start()
        if self.ops is not None:
            await self.ops.start()

    async def on_stop(self) -> None:
        # Heartbeat tombstone and health server go last: after the drain and the
        # final commit (in super().on_stop), while the producer still runs.
        try:
            await super().on_stop()
        finally:
            if self.ops is not None:
                await self.ops.stop(crashed=self.crashed)
            if self.offsets is not None:
                await self.offsets.aclose()
            if self.group_writer is not None:
                await self.group_writer.close()
            # Last: a cancel arriving while the drain waits for runs must still reach them.
            if self.control is not None:
                await self.control.stop()


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
    # Static membership (KIP-345): a worker restarting within the session timeout gets its
    # partitions back without a rebalance; the price is that a clean exit does not leave
    # the group, so its successor waits out the session timeout. Off by default. The
    # instance id must survive restarts and be this worker's alone, so a generated
    # worker id is refused here, before anything connects (Settings.group_instance_id).
    instance_id = settings.group_instance_id()
    return {
        "broker": hosts,
        "consumer_group_instance_id": instance_id,
        "broker_credentials": broker_credentials,
        "key_serializer": "raw",
        "value_serializer": "raw",
        "stream_wait_empty": False,
        "topic_allow_declare": False,
        "topic_disable_leader": True,
        "table_standby_replicas": 0,
        "web_enabled": False,
        "datadir": datadir,
        "consumer_auto_offset_reset": "earliest",
        "broker_session_timeout": settings.session_timeout_s,
        "broker_heartbeat_interval": settings.heartbeat_interval_s,
        "broker_rebalance_timeout": settings.rebalance_timeout_s,
        "broker_request_timeout": max(settings.rebalance_timeout_s, settings.session_timeout_s)
        + 10,
        "broker_max_poll_interval": 300.0,
        "broker_max_poll_records": 100,
        "broker_commit_interval": 1.0,
        "stream_buffer_maxsize": 1024,
        "producer_acks": -1,
        "producer_linger_ms": 2,
    }


def build_worker(settings: Settings, datadir: str) -> tuple[faust.App, WorkerRuntime]:
    """Compose the worker: nothing connects until the Faust worker starts.

    ``datadir`` is Faust's scratch directory (koda keeps no tables in it).
    """
    # No pre-ping: it is a round trip on every checkout, i.e. every transaction. A connection
    # that died in the pool fails its statement, SQLAlchemy discards it, and the
    # chain retries the record in place, as after any database error.
    engine = async_engine(settings, pool_size=settings.max_inflight + 2, pre_ping=False)
    store = RunStore(engine)
    handler = build_handler(settings, engine)
    app = KodaApp(settings.names.group(settings.worker_group), **faust_settings(settings, datadir))
    emitter = Emitter(settings, app.producer.send)
    executor = RunExecutor(settings, store, emitter, handler)
    app.group_writer = executor.writer
    app.control = ControlListener(settings, executor.board)
    runs_topic = settings.names.topic(RUNS)
    rt = WorkerRuntime(settings, store, executor, handler, runs_topic, app=app)
    DrainingConsumer.runtime = rt

    def ack(event: Any) -> None:
        event.ack()

    def tp(partition: int) -> Any:
        return TP(runs_topic, partition)

    chains = ChainSet(
        max_inflight=settings.max_inflight,
        process=rt.process,
        ack=ack,
        # Not pause_partitions(): Faust then silently drops records of that partition
        # already fetched, and the consumer position has moved past them. The
        # buffer-full path stops new fetches but still delivers what is in memory.
        pause=lambda p: app.consumer.on_buffer_full(tp(p)),
        resume=lambda p: app.consumer.on_buffer_drop(tp(p)),
        is_fenced=lambda exc: isinstance(exc, FencedOut),
        high_water=settings.chain_high_water,
        low_water=max(1, settings.chain_high_water // 4),
    )
    rt.chains = chains

    offsets = GroupOffsetReader(
        settings, "cursor", runs_topic, settings.names.group(settings.worker_group)
    )
    app.offsets = offsets

    async def base_offset(partition: int) -> int:
        return await offsets.run(offsets.start_offset, partition)

    async def seek(partition: int, offset: int) -> None:
        await app.consumer.seek(tp(partition), offset)

    cursors = PartitionCursors(base_offset, seek)
    rt.cursors = cursors
    app.ops = WorkerOps(settings, app, rt)
    source = app.topic(
        runs_topic,
        key_type=bytes,
        value_type=bytes,
        key_serializer="raw",
        value_serializer="raw",
    )

    def current(msg: Any) -> bool:
        # A record fetched before the last rebalance, or of a partition this worker no
        # longer holds: its owner reads it (again).
        return bool(
            msg.generation_id == app.consumer_generation_id and msg.tp.partition in rt.assigned
        )

    @app.agent(source)
    async def dispatch(stream: Any) -> None:
        async for event in stream.noack().events():
            msg = event.message
            partition = msg.tp.partition
            if not current(msg) or not await admit(partition, msg.offset, msg.generation_id):
                continue
            if not current(msg):
                continue  # the group changed while the cursor looked its base up
            if chains.dispatch(event, partition, msg.offset):
                cursors.advance(partition, msg.offset)

    async def admit(partition: int, offset: int, generation: int) -> bool:
        try:
            return await cursors.admit(partition, offset, generation)
        except Exception as exc:  # noqa: BLE001 - the broker may be restarting
            # Never wait here: every partition's records queue behind this one. The
            # record is dropped; the tail check finds the partition behind its consumer
            # position once the broker answers again and seeks back for it.
            log.warning("cannot place partition=%d offset=%d: %s", partition, offset, exc)
            return False

    async def position(partition: int) -> int | None:
        try:
            pos = await app.consumer.position(tp(partition))
        except Exception:  # noqa: BLE001 - not assigned any more, or the broker is away
            return None
        return None if pos is None else int(pos)

    @app.timer(interval=2.0)  # type: ignore[untyped-decorator]
    async def watch_tails() -> None:
        generation = app.consumer_generation_id
        try:
            await cursors.watch(sorted(rt.assigned), generation, position)
        except Exception as exc:  # noqa: BLE001 - retried at the next pass
            log.warning("tail check failed: %s", exc)

    @app.on_partitions_assigned.connect  # type: ignore[arg-type]
    async def _assigned(sender: Any, assigned: set[Any], **_: Any) -> None:
        await rt.on_assigned(sorted(t.partition for t in assigned if t.topic == runs_topic))

    @app.on_before_shutdown.connect  # type: ignore[arg-type]
    async def _shutdown(sender: Any, **_: Any) -> None:
        chains.accepting = False
        await rt.on_revoked(chains.held())

    return app, rt


def run_worker(settings: Settings) -> None:
    """Run a worker in the foreground until SIGTERM/SIGINT (drains, commits, exits 0)."""
    with tempfile.TemporaryDirectory(prefix="koda-faust-") as datadir:
        app, _ = build_worker(settings, datadir)
        worker = faust.Worker(
            app, loglevel="INFO", override_logging=False, redirect_stdouts=False, quiet=True
        )
        try:
            worker.execute_from_commandline()
        except SystemExit as exc:
            if exc.code not in (0, None):
                raise
