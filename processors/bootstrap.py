"""The worker's composition root: settings in, a Faust app with every part wired out.

:func:`build_worker` builds each part once, handing it its collaborators when it is
constructed, in the order they depend on each other:

    engine → store, handler → emitter → executor (its group writer, control board)
    store → partition fences → record processor → partition chains
    offsets reader → partition cursors
    fences + chains + cursors → worker runtime (the rebalance hooks' state)
    heartbeat, twin watch, lag monitor, loop probe, membership, health server → ops
    all of the above → the Faust app, then the agent, the tail check and the signals

Faust's consumer and producer exist only inside the app, and only once it runs: the
parts that use them (the emitter and heartbeat produce, the chains pause and resume a
partition, the cursors seek) are given functions that reach the app's consumer or
producer when called. Nothing connects until the Faust worker starts.
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass
from typing import Any

import faust
from faust.types import TP

from koda_runtime.db import async_engine
from koda_runtime.processors.app import (
    KodaApp,
    PartitionFences,
    RecordProcessor,
    WorkerRuntime,
    faust_settings,
)
from koda_runtime.processors.chains import ChainSet
from koda_runtime.processors.control import ControlListener
from koda_runtime.processors.cursor import PartitionCursors
from koda_runtime.processors.emitter import Emitter
from koda_runtime.processors.handlers import build_handler
from koda_runtime.processors.health import GroupMembership, HealthServer, LoopProbe
from koda_runtime.processors.heartbeat import Heartbeat
from koda_runtime.processors.identity import TwinWatch
from koda_runtime.processors.lag import LagMonitor
from koda_runtime.processors.ops import WorkerOps
from koda_runtime.processors.runner import FencedOut, RunExecutor
from koda_runtime.processors.store import RunStore
from koda_runtime.settings import Settings
from koda_runtime.topics.catalogue import RUNS
from koda_runtime.topics.kafka.offsets import GroupOffsetReader

log = logging.getLogger("koda.worker")


@dataclass(frozen=True)
class Worker:
    """A composed worker: the Faust app and the parts tests and probes look at."""

    app: KodaApp
    runtime: WorkerRuntime
    store: RunStore
    executor: RunExecutor
    ops: WorkerOps


def build_worker(settings: Settings, datadir: str) -> Worker:
    """Compose the worker: nothing connects until the Faust worker starts.

    ``datadir`` is Faust's scratch directory (koda keeps no tables in it).
    """
    runs_topic = settings.names.topic(RUNS)
    group = settings.names.group(settings.worker_group)
    # No pre-ping: it is a round trip on every checkout, i.e. every transaction. A connection
    # that died in the pool fails its statement, SQLAlchemy discards it, and the
    # chain retries the record in place, as after any database error.
    engine = async_engine(settings, pool_size=settings.max_inflight + 2, pre_ping=False)
    store = RunStore(engine)
    handler = build_handler(settings, engine)

    # The Faust app is built last, with everything it starts and stops; these reach its
    # consumer and producer, which it creates when it runs.
    def send(**record: Any) -> Any:
        return app.producer.send(**record)

    def tp(partition: int) -> TP:
        return TP(runs_topic, partition)

    emitter = Emitter(settings, send)
    executor = RunExecutor(settings, store, emitter, handler)
    fences = PartitionFences(store, runs_topic, settings.worker_id)
    chains = ChainSet(
        max_inflight=settings.max_inflight,
        process=RecordProcessor(fences, executor).process,
        ack=lambda event: event.ack(),
        # Not pause_partitions(): Faust then silently drops records of that partition
        # already fetched, and the consumer position has moved past them. The
        # buffer-full path stops new fetches but still delivers what is in memory.
        pause=lambda p: app.consumer.on_buffer_full(tp(p)),
        resume=lambda p: app.consumer.on_buffer_drop(tp(p)),
        is_fenced=lambda exc: isinstance(exc, FencedOut),
        high_water=settings.chain_high_water,
        low_water=max(1, settings.chain_high_water // 4),
    )
    offsets = GroupOffsetReader(settings, "cursor", runs_topic, group)

    async def base_offset(partition: int) -> int:
        return await offsets.run(offsets.start_offset, partition)

    async def seek(partition: int, offset: int) -> None:
        await app.consumer.seek(tp(partition), offset)

    cursors = PartitionCursors(base_offset, seek)
    runtime = WorkerRuntime(settings, fences, chains, cursors)
    ops = build_ops(settings, send, runtime)
    app = KodaApp(
        group,
        runtime=runtime,
        control=ControlListener(settings, executor.board),
        ops=ops,
        offsets=offsets,
        group_writer=executor.writer,
        **faust_settings(settings, datadir),
    )
    app.sensors.add(ops.membership)
    app.on_partitions_assigned.connect(ops.membership.on_assigned)  # type: ignore[arg-type]
    _install_agent(app, runtime, runs_topic)
    return Worker(app, runtime, store, executor, ops)


def build_ops(settings: Settings, send: Any, runtime: WorkerRuntime) -> WorkerOps:
    """Heartbeat (through ``send``, the worker's producer), twin watch, lag monitor
    (its own offsets reader), loop probe, membership and the health server."""
    heartbeat = Heartbeat(settings, send, in_flight=runtime.in_flight, partitions=runtime.held)
    membership = GroupMembership(stuck_after_s=settings.rebalance_timeout_s)
    loop_probe = LoopProbe(settings.loop_stall_s)
    lag_reader = GroupOffsetReader(
        settings, "lag", runtime.runs_topic, settings.names.group(settings.worker_group)
    )
    server = None
    if settings.worker_port:
        server = HealthServer(
            settings.worker_host,
            settings.worker_port,
            live=loop_probe.check,
            ready=membership.check,
        )
    return WorkerOps(
        heartbeat=heartbeat,
        twins=TwinWatch(settings, heartbeat),
        lag=LagMonitor(lag_reader, runtime.held, interval_s=settings.lag_interval_s),
        loop_probe=loop_probe,
        membership=membership,
        server=server,
    )


def _install_agent(app: KodaApp, rt: WorkerRuntime, runs_topic: str) -> None:
    """The agent that dispatches records to the chains, the tail check, the signals."""
    chains, cursors = rt.chains, rt.cursors
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
            pos = await app.consumer.position(TP(runs_topic, partition))
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


def run_worker(settings: Settings) -> None:
    """Run a worker in the foreground until SIGTERM/SIGINT (drains, commits, exits 0)."""
    with tempfile.TemporaryDirectory(prefix="koda-faust-") as datadir:
        worker = build_worker(settings, datadir)
        runner = faust.Worker(
            worker.app, loglevel="INFO", override_logging=False, redirect_stdouts=False, quiet=True
        )
        try:
            runner.execute_from_commandline()
        except SystemExit as exc:
            if exc.code not in (0, None):
                raise
