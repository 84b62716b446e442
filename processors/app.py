"""The worker's parts around Faust: partition fences, the rebalance hooks, and the Faust
app consuming ``<env>.koda.runs`` with raw values, whose consumer drains and commits
*before* Faust forgets the revoked partitions' acks.

processors/bootstrap.py composes them (``build_worker``); every part gets its
collaborators when it is constructed.

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
from typing import Any, cast

import faust
from faust.transport.drivers import aiokafka as faust_aiokafka

from koda_runtime.kafka import aiokafka_security
from koda_runtime.lifecycle.handler import CancelToken
from koda_runtime.metrics import HANDOFF_SECONDS, REBALANCES
from koda_runtime.processors.chains import ChainSet
from koda_runtime.processors.control import ControlListener
from koda_runtime.processors.cursor import PartitionCursors
from koda_runtime.processors.groupcommit import GroupWriter
from koda_runtime.processors.ops import WorkerOps
from koda_runtime.processors.runner import FencedOut, Record, RunExecutor
from koda_runtime.processors.store import Fence, RunStore
from koda_runtime.settings import Settings
from koda_runtime.topics.kafka.offsets import GroupOffsetReader

log = logging.getLogger("koda.worker")


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
    """What a partition chain does with one event: fence it, then run the executor."""

    def __init__(self, fences: PartitionFences, executor: RunExecutor) -> None:
        self.fences = fences
        self.executor = executor

    async def process(self, event: Any, partition: int, cancel: CancelToken) -> None:
        msg = event.message
        record = Record(msg.topic, partition, msg.offset, msg.key, msg.value, msg.headers)
        fence = await self.fences.fence_for(partition)
        await self.executor.process(record, fence, cancel)


class WorkerRuntime:
    """What the agent and the rebalance hooks share: the fences, the partition chains
    and the read/commit cursors of the runs partitions."""

    def __init__(
        self,
        settings: Settings,
        fences: PartitionFences,
        chains: ChainSet,
        cursors: PartitionCursors,
    ) -> None:
        self.settings = settings
        self.fences = fences
        self.chains = chains
        self.cursors = cursors
        self.runs_topic = fences.runs_topic

    @property
    def assigned(self) -> set[int]:
        return self.fences.assigned

    def held(self) -> list[int]:
        """The runs partitions this worker holds: fenced (assigned) or with a chain
        (draining)."""
        return sorted(set(self.fences.fences) | set(self.chains.held()))

    def in_flight(self) -> int:
        return self.chains.in_flight

    def assign(self, partitions: set[int]) -> None:
        """The consumer's new assignment, before any of its records is taken."""
        self.fences.assigned = set(partitions)

    async def on_assigned(self, partitions: list[int]) -> None:
        REBALANCES.labels(event="assigned").inc()
        self.chains.accepting = True
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

    async def on_revoked(self, partitions: list[int]) -> dict[str, Any]:
        REBALANCES.labels(event="revoked").inc()
        self.fences.assigned.difference_update(partitions)
        loop = asyncio.get_running_loop()
        started = loop.time()
        result = await self.chains.drain(partitions, self.settings.handoff_ceiling_s)
        for p in partitions:
            self.fences.fences.pop(p, None)
        HANDOFF_SECONDS.observe(loop.time() - started)
        log.info("revoked partitions=%s drain=%s", partitions, result)
        return result


class DrainingConsumer(faust_aiokafka.Consumer):
    """Drain and commit on revoke *before* Faust drops the revoked partitions' acks.

    Faust builds it from the transport; the runtime is its app's (:class:`KodaApp`).
    """

    @property
    def runtime(self) -> WorkerRuntime:
        return cast(KodaApp, self.app).runtime

    async def on_partitions_revoked(self, revoked: set[Any]) -> None:
        rt = self.runtime
        if revoked:
            ours = sorted(tp.partition for tp in revoked if tp.topic == rt.runs_topic)
            if ours:
                await rt.on_revoked(ours)
                # commit() returns False if another commit was running: ask twice.
                await self.commit(revoked)
                await self.commit(revoked)
                rt.cursors.forget(ours)  # after the commits, which need them
        await super().on_partitions_revoked(revoked)

    async def on_partitions_assigned(self, assigned: set[Any], generation_id: int = 0) -> None:
        # Before Faust's own callbacks, which may resume the flow before the app's
        # on_partitions_assigned signal: records arriving then must not be taken for
        # records of partitions this worker does not hold.
        rt = self.runtime
        rt.assign({tp.partition for tp in assigned if tp.topic == rt.runs_topic})
        await super().on_partitions_assigned(assigned, generation_id)

    def _new_offset(self, tp: Any) -> int | None:
        # Faust's own computation commits the first run of consecutive acks even when
        # it does not start at the committed offset (always so when there is none):
        # koda's commit cursor demands that it does.
        rt = self.runtime
        if tp.topic != rt.runs_topic:
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
    """The Faust app with koda's transport, and the worker's services started and
    stopped around it.

    ``runtime``: the rebalance hooks' state. ``control``: the run-control tail.
    ``ops``: heartbeat, probes and lag. ``offsets``: the cursors' offsets reader.
    ``group_writer``: the executor's group commit, closed after the final commit.
    """

    def __init__(
        self,
        id: str,
        *,
        runtime: WorkerRuntime,
        control: ControlListener,
        ops: WorkerOps,
        offsets: GroupOffsetReader,
        group_writer: GroupWriter,
        **options: Any,
    ) -> None:
        super().__init__(id, **options)
        self.runtime = runtime
        self.control = control
        self.ops = ops
        self.offsets = offsets
        self.group_writer = group_writer

    def _new_transport(self) -> Any:
        return KodaTransport(self.conf.broker_consumer, self)

    def _new_producer(self) -> Any:
        return IdempotentProducer(self.transport, loop=self.loop, beacon=self.beacon)

    async def on_started(self) -> None:
        await super().on_started()
        await self.control.start()
        await self.ops.start()

    async def on_stop(self) -> None:
        # Heartbeat tombstone and health server go last: after the drain and the
        # final commit (in super().on_stop), while the producer still runs.
        try:
            await super().on_stop()
        finally:
            await self.ops.stop(crashed=self.crashed)
            await self.offsets.aclose()
            await self.group_writer.close()
            # Last: a cancel arriving while the drain waits for runs must still reach them.
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
