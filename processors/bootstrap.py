"""The worker's composition root: settings in, a Faust app with every part wired out.

:func:`build_worker` builds each part once, handing it its collaborators when it is
constructed, in the order they depend on each other:

    settings → the Faust app (configuration only)
    engine → store, handler; app.produce → emitter; store → group writer
    store, emitter, handler, group writer → executor (its control board)
    store → partition fences; fences + executor → record processor
    batch queue + rebalance hooks (empty) → the runs topic's group member (intake)
    offsets reader + intake → partition cursors → offset commits
    record processor + commits + intake → partition chains
    fences + chains + cursors + commits + membership → worker runtime → the hooks
    worker runtime + intake + batch queue → dispatcher
    heartbeat, twin watch, lag monitor, loop probe, membership, health server → ops
    all of the above → the app's worker services, then the tail check and the
    shutdown signal

Two links run backwards, each once and explicit, because the parts need each other:
the app starts and stops the services that produce through it (``app.host``), and the
intake calls the hooks of the runtime that pauses, seeks and commits through it
(``hooks.attach``). Faust's producer exists only once the app runs: the parts that
produce (the emitter, the heartbeat) are given ``app.produce``, which reaches it when
called. Nothing connects until the Faust worker starts.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
from dataclasses import dataclass
from typing import Any

import faust

from koda_runtime.processors.chains import ChainSet
from koda_runtime.processors.commits import OffsetCommits
from koda_runtime.processors.control import ControlListener
from koda_runtime.processors.cursor import PartitionCursors, Start
from koda_runtime.processors.dispatch import Dispatcher
from koda_runtime.processors.emitter import Emitter
from koda_runtime.processors.faust_app import KodaApp, WorkerServices, faust_settings
from koda_runtime.processors.fences import FencedOut, PartitionFences, RecordProcessor
from koda_runtime.processors.groupcommit import GroupWriter
from koda_runtime.processors.groupconfig import apply_group_config
from koda_runtime.processors.handlers import build_handler
from koda_runtime.processors.health import GroupMembership, HealthServer, LoopProbe
from koda_runtime.processors.heartbeat import Heartbeat
from koda_runtime.processors.lag import LagMonitor
from koda_runtime.processors.ops import WorkerOps
from koda_runtime.processors.rebalance import RuntimeHooks, WorkerRuntime
from koda_runtime.processors.runner import RunExecutor
from koda_runtime.processors.twins import TwinWatch
from koda_runtime.schemas.db import async_engine
from koda_runtime.schemas.runs.worker import RunStore
from koda_runtime.settings import Settings
from koda_runtime.topics.catalogue import RUNS
from koda_runtime.topics.kafka.intake import Fetched, RunsIntake
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
    # Runs hold no connection while they stream: the pool serves the group writes (one
    # group at a time), the coalesced run reads, fences, failure counts and the handler's
    # own reads, so it is sized for those, not for runs in flight.
    engine = async_engine(settings, pool_size=settings.db_pool, pre_ping=False, pipelines=True)
    store = RunStore(engine)
    handler = build_handler(settings, engine)

    # The Faust app holds configuration only until it runs; its producer is created then,
    # and the parts that produce send through app.produce.
    app = KodaApp(group, **faust_settings(settings, datadir))
    emitter = Emitter(settings, app.produce)
    writer = GroupWriter(store, fault=settings.test_fault)
    executor = RunExecutor(settings, store, emitter, handler, writer)
    fences = PartitionFences(store, runs_topic, settings.worker_id)
    offsets = GroupOffsetReader(settings, "cursor", runs_topic, group)
    membership = GroupMembership(stuck_after_s=settings.rebalance_timeout_s)
    # The runs topic's group member: it puts the batches it fetches on the dispatcher's
    # queue and calls the runtime's hooks, which are attached once the runtime exists.
    batches: asyncio.Queue[list[Fetched]] = asyncio.Queue()
    hooks = RuntimeHooks()
    intake = RunsIntake(
        settings,
        runs_topic,
        group,
        deliver=batches.put_nowait,
        hooks=hooks,
        on_joined=lambda: membership.on_rebalance_end(None, None),
    )

    async def base_offset(partition: int) -> Start:
        return await offsets.run(offsets.start, partition)

    cursors = PartitionCursors(base_offset, intake.seek)
    commits = OffsetCommits(cursors, intake.commit)
    chains = ChainSet(
        max_inflight=settings.max_inflight,
        process=RecordProcessor(fences, executor).process,
        ack=commits.ack,
        # librdkafka drops what it fetched of a paused partition and fetches it again
        # from the consumer's position on resume; the cursors place it either way.
        pause=intake.pause,
        resume=intake.resume,
        is_fenced=lambda exc: isinstance(exc, FencedOut),
        high_water=settings.chain_high_water,
        low_water=max(1, settings.chain_high_water // 4),
        max_backlog=settings.max_backlog or 4 * settings.max_inflight,
    )
    runtime = WorkerRuntime(settings, fences, chains, cursors, commits, membership)
    hooks.attach(runtime)
    dispatcher = Dispatcher(runtime, intake.generation, batches)
    ops = build_ops(settings, app.produce, runtime, membership)
    app.host(
        WorkerServices(
            runtime=runtime,
            intake=intake,
            dispatcher=dispatcher,
            control=ControlListener(settings, executor.board),
            ops=ops,
            offsets=offsets,
            group_writer=writer,
            distiller=executor.distiller,
            prepare_group=lambda: apply_group_config(settings, group),
        )
    )
    _install_signals(app, runtime, intake)
    return Worker(app, runtime, store, executor, ops)


def build_ops(
    settings: Settings, send: Any, runtime: WorkerRuntime, membership: GroupMembership
) -> WorkerOps:
    """Heartbeat (through ``send``, the worker's producer), twin watch, lag monitor
    (its own offsets reader), loop probe, membership and the health server."""
    heartbeat = Heartbeat(settings, send, in_flight=runtime.in_flight, partitions=runtime.held)
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


def _install_signals(app: KodaApp, rt: WorkerRuntime, intake: RunsIntake) -> None:
    """The tail check and the graceful leave."""
    cursors = rt.cursors

    @app.timer(interval=2.0)  # type: ignore[untyped-decorator]
    async def watch_tails() -> None:
        held = {p: intake.generation(p) for p in sorted(rt.assigned)}
        try:
            positions = await intake.positions(sorted(held))
        except Exception as exc:  # noqa: BLE001 - the consumer is restarting or closing
            log.warning("tail check failed: %s", exc)
            return

        async def position(partition: int) -> int | None:
            return positions.get(partition)

        for partition, generation in held.items():
            if generation is None:
                continue
            try:
                await cursors.watch([partition], generation, position)
            except Exception as exc:  # noqa: BLE001 - retried at the next pass
                log.warning("tail check failed: %s", exc)

    @app.on_before_shutdown.connect  # type: ignore[arg-type]
    async def _shutdown(sender: Any, **_: Any) -> None:
        await app.leave()


def use_event_loop(name: str) -> str:
    """Make ``name`` (``KODA_EVENT_LOOP``: uvloop or asyncio) the loop this process's
    asyncio creates from now on; return the loop class's module, as the log shows it.

    uvloop runs the selector, the transports and the ready queue in C (libuv): the
    worker's hot path is many small awaits on Postgres and Kafka sockets, and it takes
    about 12 % less CPU per run there (docs/decisions/0016-composition-roots.md).
    """
    if name == "uvloop":
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    else:
        asyncio.set_event_loop_policy(asyncio.DefaultEventLoopPolicy())
    loop = asyncio.new_event_loop()
    try:
        return type(loop).__module__.split(".")[0]
    finally:
        loop.close()


def run_worker(settings: Settings) -> None:
    """Run a worker in the foreground until SIGTERM/SIGINT (drains, commits, exits 0)."""
    # Before Faust or anything else creates the loop.
    loop_kind = use_event_loop(settings.event_loop)
    log.info("event=worker_event_loop loop=%s", loop_kind)
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
