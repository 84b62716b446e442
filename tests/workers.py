"""Start real worker processes and submit runs the way the gateway does."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from confluent_kafka import Producer
from sqlalchemy import text

from koda.db import sync_engine
from koda.kafka import producer_config
from koda.lifecycle.ids import uuid7
from koda.settings import Settings
from schemas.records import RUN_REQUESTED, RunRequested, headers_for
from topics.catalogue import RUNS, partition_for_key

ROOT = Path(__file__).resolve().parents[1]


def settings_env(settings: Settings, **extra: str) -> dict[str, str]:
    """The environment a child process needs to rebuild ``settings``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KODA_")}
    env.update(
        APP_ENV=settings.app_env.value,
        KODA_KAFKA_BOOTSTRAP=settings.kafka_bootstrap,
        KODA_DATABASE_URL=settings.database_url,
        KODA_NAMESPACE=settings.namespace or "",
        KODA_PARTITIONS=str(settings.partitions),
        KODA_SESSION_TIMEOUT=str(settings.session_timeout_s),
        KODA_KAFKA_HEARTBEAT=str(settings.heartbeat_interval_s),
        KODA_REBALANCE_TIMEOUT=str(settings.rebalance_timeout_s),
        KODA_HANDOFF_CEILING=str(settings.handoff_ceiling_s),
        KODA_RETRY_BASE=str(settings.retry_base_s),
        KODA_CHUNK_BATCH_MS=str(settings.chunk_batch_ms),
        KODA_MAX_INFLIGHT=str(settings.max_inflight),
        KODA_CHAIN_HIGH_WATER=str(settings.chain_high_water),
        KODA_HANDLER=settings.handler,
    )
    env.update(extra)
    return env


@dataclass
class WorkerProcess:
    """One ``koda worker`` child process with its log in a temp file.

    ``worker_id`` None leaves ``KODA_WORKER_ID`` unset: the worker makes up its own id.
    """

    settings: Settings
    worker_id: str | None
    extra_env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None

    def start(self) -> WorkerProcess:
        fd, name = tempfile.mkstemp(prefix=f"koda-{self.worker_id or 'worker'}-", suffix=".log")
        self.log_path = Path(name)
        identity = {"KODA_WORKER_ID": self.worker_id} if self.worker_id is not None else {}
        env = settings_env(self.settings, **identity, **self.extra_env)
        self.proc = subprocess.Popen(  # noqa: S603
            [sys.executable, "-m", "koda", "worker"],
            env=env,
            cwd=ROOT,
            stdout=fd,
            stderr=fd,
            start_new_session=True,
        )
        os.close(fd)
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path else ""

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, sig)

    def stop(self, timeout: float = 40.0) -> int:
        """SIGTERM and wait; returns the exit status."""
        if not self.alive():
            assert self.proc is not None
            return self.proc.returncode
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        assert self.proc is not None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(
                f"worker {self.worker_id} ignored SIGTERM:\n{self.log()[-3000:]}"
            ) from None

    def kill(self) -> None:
        if self.alive():
            self.signal(signal.SIGKILL)
            assert self.proc is not None
            self.proc.wait()


class Submitter:
    """Insert runs and publish their trigger records, as the gateway does."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.engine = sync_engine(settings)
        self.producer = Producer(producer_config(settings, "test") | {"message.max.bytes": 3 << 20})
        self.topic = settings.names.topic(RUNS)

    def submit(self, user: str, inp: dict[str, Any], *, publish: bool = True) -> str:
        run_id = uuid7()
        session = f"s-{user}"
        with self.engine.begin() as conn:
            conn.execute(
                text("INSERT INTO sessions (id, user_id) VALUES (:s, :u) ON CONFLICT DO NOTHING"),
                {"s": session, "u": user},
            )
            conn.execute(
                text(
                    "INSERT INTO runs (id, session_id, user_id, idempotency_key, input, partition)"
                    " VALUES (:id, :s, :u, :k, CAST(:inp AS jsonb), :p)"
                ),
                {
                    "id": run_id,
                    "s": session,
                    "u": user,
                    "k": f"test:{run_id}",
                    "inp": json.dumps(inp),
                    "p": partition_for_key(user.encode(), self.settings.partitions),
                },
            )
        if publish:
            self.publish(run_id, user)
        return run_id

    def publish(self, run_id: str, user: str) -> None:
        self.producer.produce(
            self.topic,
            key=user.encode(),
            value=RunRequested(run_id, user, f"s-{user}", "").encode(),
            headers=headers_for(RUN_REQUESTED),
        )
        assert self.producer.flush(30) == 0

    def produce_raw(self, key: bytes | None, value: bytes | None, headers: Any = None) -> None:
        self.producer.produce(self.topic, key=key, value=value, headers=headers)
        assert self.producer.flush(30) == 0

    def query(self, sql: str, **params: Any) -> list[Any]:
        with self.engine.connect() as conn:
            return list(conn.execute(text(sql), params).all())

    def statuses(self, run_ids: list[str]) -> dict[str, str]:
        rows = self.query("SELECT id, status FROM runs WHERE id = ANY(:ids)", ids=run_ids)
        return {r.id: r.status for r in rows}

    def all_terminal(self, run_ids: list[str]) -> bool:
        st = self.statuses(run_ids)
        return len(st) == len(run_ids) and all(
            s in ("done", "failed", "cancelled") for s in st.values()
        )

    def messages(self, run_id: str) -> list[Any]:
        return self.query(
            "SELECT seq, kind, content, attempt FROM messages WHERE run_id = :r ORDER BY seq",
            r=run_id,
        )

    def close(self) -> None:
        self.engine.dispose()


def read_topic(settings: Settings, topic: str, timeout: float = 20.0) -> list[Any]:
    """Every record currently in ``topic`` (all partitions, from the beginning)."""
    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

    from koda.kafka import consumer_config

    consumer = Consumer(consumer_config(settings, "test-reader", None) | {"group.id": "unused"})
    md = consumer.list_topics(topic, timeout=10).topics[topic]
    tps = [TopicPartition(topic, p, OFFSET_BEGINNING) for p in md.partitions]
    ends = {}
    for tp in tps:
        low, high = consumer.get_watermark_offsets(TopicPartition(topic, tp.partition), timeout=10)
        if high > low:
            ends[tp.partition] = high
    consumer.assign(tps)
    out: list[Any] = []
    import time

    deadline = time.monotonic() + timeout
    positions = {p: -1 for p in ends}
    while any(positions[p] + 1 < ends[p] for p in ends) and time.monotonic() < deadline:
        msg = consumer.poll(0.5)
        if msg is None or msg.error():
            continue
        positions[msg.partition()] = msg.offset()
        out.append(msg)
    consumer.close()
    return out


def committed_offsets(settings: Settings, group: str, topic: str) -> dict[int, int]:
    """The group's committed offset per partition (-1001 when none)."""
    from confluent_kafka import Consumer, TopicPartition

    from koda.kafka import consumer_config

    consumer = Consumer(consumer_config(settings, "test-offsets", group))
    md = consumer.list_topics(topic, timeout=10).topics[topic]
    got = consumer.committed([TopicPartition(topic, p) for p in md.partitions], timeout=10)
    consumer.close()
    return {tp.partition: tp.offset for tp in got}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class GatewayProcess:
    """One ``koda gateway`` child process."""

    settings: Settings
    extra_env: dict[str, str] = field(default_factory=dict)
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None

    def start(self) -> GatewayProcess:
        import httpx

        from tests.support import wait_until

        self.port = self.port or free_port()
        fd, name = tempfile.mkstemp(prefix="koda-gateway-", suffix=".log")
        self.log_path = Path(name)
        env = settings_env(self.settings, KODA_GATEWAY_PORT=str(self.port), **self.extra_env)
        self.proc = subprocess.Popen(  # noqa: S603
            [sys.executable, "-m", "koda", "gateway"],
            env=env,
            cwd=ROOT,
            stdout=fd,
            stderr=fd,
            start_new_session=True,
        )
        os.close(fd)

        def live() -> bool:
            assert self.proc is not None and self.proc.poll() is None, self.log()
            try:
                return httpx.get(f"{self.url}/livez", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(live, timeout=30, what="gateway /livez")
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path else ""

    def stop(self) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()
