"""The processes under test (one gateway, a pool of workers) and probes into the stack.

Everything here is started the way a user starts it (``python -m koda_runtime.cli worker|gateway``)
against a real Kafka and PostgreSQL; the probes read Postgres and the broker directly.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, KafkaException, TopicPartition
from sqlalchemy import text

from koda_runtime.kafka import consumer_config
from koda_runtime.localstack import StackInfo, down, up
from koda_runtime.localstack.kafka_cluster import load_cluster
from koda_runtime.schemas.db import sync_engine
from koda_runtime.settings import Settings
from koda_runtime.topics.catalogue import RUNS, WORKER_GROUP
from tests.chaos.toxiproxy import GATEWAY_SLOT, SLOTS, WORKER_SLOTS, Network, ToxiproxyServer
from tests.fixtures.processes import GatewayProcess, SchedulerProcess, WorkerProcess, free_port

# The harness's own clients stay quiet while a broker is down on purpose.
QUIET = {"log_level": 0}


@dataclass
class Stack:
    """A local stack the chaos run may stop and start: its state dir and addresses, and
    (when the stack was started with client slots) the Toxiproxy network in front of it."""

    state_dir: Path
    info: StackInfo
    network: Network | None = None


@contextmanager
def proxied_stack(state_dir: Path, brokers: int) -> Iterator[Stack]:
    """Kafka (a listener per client slot on every node) and PostgreSQL under
    ``state_dir``, and a Toxiproxy server with every slot's proxies; all stopped after."""
    server = ToxiproxyServer(state_dir / "toxiproxy.log")
    try:
        info = up(state_dir, brokers=brokers, slots=SLOTS)
        cluster = load_cluster(state_dir)
        assert cluster is not None
        network = Network.build(server.start(), cluster, info.database_url)
        yield Stack(state_dir, info, network)
    finally:
        try:
            server.stop()
        finally:
            down(state_dir)


def process_env(settings: Settings) -> dict[str, str]:
    """Settings the gateway and the workers need beyond ``settings_env``."""
    return {
        "KODA_REPLICATION_FACTOR": str(settings.replication_factor),
        "KODA_MIN_INSYNC_REPLICAS": str(settings.min_insync_replicas),
        "KODA_SWEEP_AFTER": str(settings.sweep_after_s),
        "KODA_SWEEP_INTERVAL": str(settings.sweep_interval_s),
        "KODA_PUBLISH_TIMEOUT": str(settings.publish_timeout_s),
        "KODA_RATE_PER_S": str(settings.rate_per_s),
        "KODA_RATE_BURST": str(settings.rate_burst),
        "KODA_SSE_KEEPALIVE": str(settings.sse_keepalive_s),
        "KODA_SSE_RETRY_MS": str(settings.sse_retry_ms),
        "KODA_MAX_ATTEMPTS": str(settings.max_attempts),
        "KODA_BEAT_INTERVAL": "2",
        "KODA_BEAT_STALE_AFTER": "8",
    }


@dataclass
class Pool:
    """The gateway and the workers; knows which exits were asked for."""

    settings: Settings
    size: int
    extra_env: dict[str, str] = field(default_factory=dict)
    network: Network | None = None
    workers: list[WorkerProcess] = field(default_factory=list)
    retired: list[WorkerProcess] = field(default_factory=list)
    gateway: GatewayProcess | None = None
    gateway_port: int = 0
    old_gateways: list[GatewayProcess] = field(default_factory=list)
    _next: int = 1
    unexpected_exits: list[str] = field(default_factory=list)
    sigterm_exit_codes: list[int] = field(default_factory=list)
    slot_of: dict[str, str | None] = field(default_factory=dict)
    schedulers: list[SchedulerProcess] = field(default_factory=list)
    old_schedulers: list[SchedulerProcess] = field(default_factory=list)

    def env(self, slot: str | None = None) -> dict[str, str]:
        """A process's environment; with a network, its connections go through ``slot``."""
        through = self.network.env(slot) if self.network is not None and slot else {}
        return {**process_env(self.settings), **self.extra_env, **through}

    def start_gateway(self) -> GatewayProcess:
        self.gateway_port = self.gateway_port or free_port()
        env = self.env(GATEWAY_SLOT)
        gw = GatewayProcess(self.settings, env, port=self.gateway_port).start()
        self.gateway = gw
        return gw

    def start_worker(self) -> WorkerProcess:
        worker_id = f"w{self._next}"
        self._next += 1
        slot = self._free_slot()
        w = WorkerProcess(self.settings, worker_id, self.env(slot)).start()
        self.slot_of[w.name] = slot
        self.workers.append(w)
        return w

    def start_scheduler(self) -> SchedulerProcess:
        # A pass every second and at each minute boundary, as in the scheduler tests.
        env = {**self.env(), "KODA_SCHEDULER_POLL": "1"}
        name = f"s{len(self.schedulers) + len(self.old_schedulers) + 1}"
        proc = SchedulerProcess(self.settings, name, env).start()
        self.schedulers.append(proc)
        return proc

    def kill_scheduler(self, proc: SchedulerProcess) -> None:
        if proc in self.schedulers:
            self.schedulers.remove(proc)
        self.old_schedulers.append(proc)
        if proc.proc is not None and proc.proc.poll() is None:
            proc.proc.send_signal(signal.SIGKILL)
            proc.proc.wait()

    def wait_started(self, w: WorkerProcess, timeout_s: float = 60.0) -> None:
        """Until ``w`` has subscribed to the runs topic (its clients bootstrapped), or
        exited: a worker that cannot reach a broker at start-up exits, so the next
        fault (a broker restart, say) must not begin before it is up."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and w.alive():
            if "event=intake_subscribed" in w.log():
                return
            time.sleep(0.2)

    def _free_slot(self) -> str | None:
        """A worker slot no running worker uses (None without a network)."""
        if self.network is None:
            return None
        taken = {self.slot_of.get(w.name) for w in self.workers + self.retired if w.alive()}
        for slot in WORKER_SLOTS:
            if slot not in taken:
                return slot
        raise RuntimeError(f"every worker slot {WORKER_SLOTS} is taken by a running worker")

    def start(self) -> None:
        self.start_gateway()
        for _ in range(self.size):
            self.start_worker()

    def alive(self) -> list[WorkerProcess]:
        return [w for w in self.workers if w.alive()]

    def retire(self, w: WorkerProcess) -> None:
        """``w`` is being stopped on purpose: its exit is not a finding."""
        if w in self.workers:
            self.workers.remove(w)
        self.retired.append(w)

    def check_exits(self) -> None:
        """Record workers and gateways that exited without being asked to."""
        for w in list(self.workers):
            if not w.alive():
                assert w.proc is not None
                self.unexpected_exits.append(
                    f"worker {w.worker_id} exited by itself (code {w.proc.returncode}); "
                    f"log {w.log_path}"
                )
                self.workers.remove(w)
                self.retired.append(w)
        for sch in list(self.schedulers):
            if sch.proc is not None and sch.proc.poll() is not None:
                self.unexpected_exits.append(
                    f"scheduler {sch.name} exited by itself (code {sch.proc.returncode}); "
                    f"log {sch.log_path}"
                )
                self.schedulers.remove(sch)
                self.old_schedulers.append(sch)
        gw = self.gateway
        if gw is not None and gw.proc is not None and gw.proc.poll() is not None:
            self.unexpected_exits.append(
                f"gateway exited by itself (code {gw.proc.returncode}); log {gw.log_path}"
            )
            self.old_gateways.append(gw)
            self.gateway = None

    def kill_gateway(self) -> None:
        gw = self.gateway
        if gw is not None and gw.proc is not None:
            gw.proc.send_signal(signal.SIGKILL)
            gw.proc.wait()
            self.old_gateways.append(gw)
            self.gateway = None

    def stop_all(self) -> None:
        for sch in list(self.schedulers):
            if sch.proc is not None and sch.proc.poll() is None:
                sch.proc.send_signal(signal.SIGTERM)
                sch.proc.wait(30)
            self.schedulers.remove(sch)
            self.old_schedulers.append(sch)
        for w in list(self.workers):
            if w.alive():
                w.signal(signal.SIGCONT)
                code = w.stop()
                self.sigterm_exit_codes.append(code)
            self.retire(w)
        if self.gateway is not None:
            self.gateway.stop()
            self.old_gateways.append(self.gateway)
            self.gateway = None

    def kill_all(self) -> None:
        """Last resort on an aborted run: nothing may keep running."""
        for sch in self.schedulers + self.old_schedulers:
            if sch.proc is not None and sch.proc.poll() is None:
                sch.proc.kill()
                sch.proc.wait()
        for w in self.workers + self.retired:
            w.kill()
        for gw in [self.gateway, *self.old_gateways]:
            if gw is not None and gw.proc is not None and gw.proc.poll() is None:
                gw.proc.kill()
                gw.proc.wait()

    def logs(self) -> dict[str, str]:
        out = {w.name: w.log() for w in self.workers + self.retired}
        for i, gw in enumerate([*self.old_gateways, self.gateway]):
            if gw is not None:
                out[f"gateway-{i}"] = gw.log()
        return out


class Postgres:
    """Short-lived reads of the namespace's tables; each call survives a restart."""

    def __init__(self, settings: Settings) -> None:
        self.engine = sync_engine(settings, pool_size=2)

    def query(self, sql: str, commit: bool = False, **params: Any) -> list[Any]:
        """Rows of ``sql``; with ``commit``, in a transaction that commits (a write)."""
        if commit:
            with self.engine.begin() as conn:
                return list(conn.execute(text(sql), params).all())
        with self.engine.connect() as conn:
            return list(conn.execute(text(sql), params).all())

    def epochs(self) -> dict[int, tuple[int, str]]:
        rows = self.query("SELECT partition, epoch, worker_id FROM partition_epochs")
        return {r.partition: (r.epoch, r.worker_id) for r in rows}

    def close(self) -> None:
        self.engine.dispose()


class CommitMonitor:
    """Samples the worker group's committed offsets (summed) in a thread, every 0.5 s.

    ``recovery_after(t)`` is how long after ``t`` the sum first grew: the whole loop
    (consume, run, Postgres, produce, commit) was working again.
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.topic = settings.names.topic(RUNS)
        self.group = settings.names.group(WORKER_GROUP)
        self.samples: list[tuple[float, int]] = []
        self.latest: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="commit-monitor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _loop(self) -> None:
        conf = consumer_config(self.settings, "chaos-monitor", self.group)
        consumer = Consumer(conf | QUIET | {"socket.timeout.ms": 3000})
        tps = [TopicPartition(self.topic, p) for p in range(self.settings.partitions)]
        try:
            while not self._stop.is_set():
                try:
                    got = consumer.committed(tps, timeout=3)
                except KafkaException:
                    self._stop.wait(0.5)
                    continue
                offsets = {tp.partition: tp.offset for tp in got}
                self.latest = offsets
                self.samples.append((time.time(), sum(max(0, o) for o in offsets.values())))
                self._stop.wait(0.5)
        finally:
            consumer.close()

    def recovery_after(self, t: float) -> float | None:
        """Seconds from ``t`` to the first growth of the committed sum; None if none."""
        before = [v for ts, v in self.samples if ts <= t]
        base = before[-1] if before else 0
        for ts, v in self.samples:
            if ts > t and v > base:
                return ts - t
        return None
