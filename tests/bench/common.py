"""What every benchmark shares: the services, a fresh namespace per trial, bulk
loading, completion waits, and the median [min-max] table.

Each trial gets its own topics, consumer group and Postgres schema, so trials
never see each other's rows or offsets, and tables never grow across trials.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient
from sqlalchemy import text

from koda_runtime.kafka import producer_config
from koda_runtime.lifecycle.ids import uuid7
from koda_runtime.localstack import StackInfo, down, up
from koda_runtime.schemas.db import sync_engine
from koda_runtime.schemas.migrate import upgrade
from koda_runtime.settings import Settings
from koda_runtime.topics.admin import apply_topics
from koda_runtime.topics.catalogue import RUNS, partition_for_key
from koda_runtime.topics.records.codec import RUN_REQUESTED, RunRequested, headers_for
from tests.fixtures.namespaces import delete_topics, drop_schema, make_settings
from tests.fixtures.runs import group_settled

TERMINAL = ("done", "failed", "cancelled")


# ---------------------------------------------------------------- statistics


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..1); NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(round(q * len(ordered))) - 1))]


def mmm(values: Sequence[float]) -> tuple[float, float, float]:
    """(median, min, max)."""
    return statistics.median(values), min(values), max(values)


def fmt(values: Sequence[float], digits: int = 0) -> str:
    """``median [min-max]`` of repetitions."""
    if not values:
        return "n/a"
    med, lo, hi = mmm(values)
    return f"{med:.{digits}f} [{lo:.{digits}f}-{hi:.{digits}f}]"


@dataclass
class Table:
    """A plain-text table printed once a workload is over."""

    title: str
    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    footer: list[str] = field(default_factory=list)  # printed as is after the notes
    # Per-repetition figures the goals section reads (tests/bench/goals.py), by name.
    figures: dict[str, list[float]] = field(default_factory=dict)

    def add(self, *cells: str) -> None:
        self.rows.append(list(cells))

    def render(self) -> str:
        widths = [len(c) for c in self.columns]
        for row in self.rows:
            widths = [max(w, len(c)) for w, c in zip(widths, row, strict=False)]
        line = "  ".join("-" * w for w in widths)
        out = [
            self.title,
            "  ".join(c.ljust(w) for c, w in zip(self.columns, widths, strict=False)),
            line,
        ]
        for row in self.rows:
            out.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)))
        out += [f"  * {n}" for n in self.notes]
        out += self.footer
        return "\n".join(out)


# ---------------------------------------------------------------- services


@contextmanager
def services() -> Iterator[StackInfo]:
    """The Kafka and Postgres to measure on: exported ones, else a private stack."""
    if os.environ.get("KODA_KAFKA_BOOTSTRAP") and os.environ.get("KODA_DATABASE_URL"):
        yield StackInfo(os.environ["KODA_KAFKA_BOOTSTRAP"], os.environ["KODA_DATABASE_URL"], 1)
        return
    state = Path(tempfile.mkdtemp(prefix="koda-bench-", dir="/tmp"))
    try:
        yield up(state)
    finally:
        down(state)
        shutil.rmtree(state, ignore_errors=True)


@contextmanager
def namespace(stack: StackInfo, **overrides: Any) -> Iterator[Settings]:
    """Fresh topics and schema for one trial, removed afterwards."""
    settings = make_settings(stack, **overrides)
    upgrade(settings)
    apply_topics(settings)
    try:
        yield settings
    finally:
        delete_topics(settings)
        drop_schema(settings)


def wait_group(settings: Settings, group: str, members: int, timeout: float = 120.0) -> None:
    """Until ``group`` is Stable with ``members`` members that all hold partitions."""
    admin = AdminClient({"bootstrap.servers": settings.kafka_bootstrap})
    deadline = time.monotonic() + timeout
    last = "unknown"
    while time.monotonic() < deadline:
        try:
            settled, last = group_settled(admin, group, members)
            if settled:
                return
        except Exception as exc:  # noqa: BLE001 - the group may not exist yet
            last = repr(exc)
        time.sleep(0.5)
    raise AssertionError(f"group {group} not stable with {members} members: {last}")


# ---------------------------------------------------------------- load


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds the process has used so far (0 if it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _listeners(ports: set[int]) -> set[int]:
    """Pids listening on any of ``ports`` on this machine."""
    import psutil

    return {
        c.pid
        for c in psutil.net_connections("tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port in ports and c.pid
    }


class ServiceCpu:
    """CPU seconds of the stack's brokers and of its PostgreSQL (postmaster and every
    backend), found by the ports they listen on: what a workload cost the services."""

    def __init__(self, stack: StackInfo) -> None:
        import psutil
        from sqlalchemy.engine import make_url

        kafka_ports = {int(a.rpartition(":")[2]) for a in stack.kafka_bootstrap.split(",")}
        pg_port = make_url(stack.database_url).port or 5432
        self._psutil = psutil
        self.brokers = sorted(_listeners(kafka_ports))
        self.postmasters = sorted(_listeners({pg_port}))

    def snapshot(self) -> dict[int, tuple[str, float]]:
        """{pid: (service, CPU seconds so far)} of the processes running now."""
        pg = set(self.postmasters)
        for pid in self.postmasters:
            try:
                pg |= {c.pid for c in self._psutil.Process(pid).children(recursive=True)}
            except self._psutil.Error:
                continue
        out = {p: ("kafka", cpu_seconds(p)) for p in self.brokers}
        out.update({p: ("postgres", cpu_seconds(p)) for p in pg})
        return out

    def since(self, before: dict[int, tuple[str, float]]) -> dict[str, float]:
        """CPU seconds per service since ``before`` (a process that ended meanwhile
        counts what it used up to the earlier snapshot, i.e. nothing)."""
        used = {"kafka": 0.0, "postgres": 0.0}
        for pid, (kind, now) in self.snapshot().items():
            used[kind] += max(0.0, now - before.get(pid, (kind, 0.0))[1])
        return used


def demo_input(i: int, tokens: int, delay_ms: int = 0, **extra: Any) -> dict[str, Any]:
    return {
        "text": f"run {i}",
        "demo": {"tokens": tokens, "delay_ms": delay_ms, "token_bytes": 8, **extra},
    }


@dataclass
class Loaded:
    run_ids: list[str]
    users: list[str]


class Loader:
    """Writes runs straight into Postgres and the runs topic (what the gateway would)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.engine = sync_engine(settings)
        self.producer = Producer(producer_config(settings, "bench") | {"linger.ms": 5})
        self.topic = settings.names.topic(RUNS)

    def insert(
        self,
        n: int,
        users: int | list[str],
        make_input: Callable[[int], dict[str, Any]],
        prefix: str = "bench",
    ) -> Loaded:
        """Insert ``n`` pending runs, round-robin over ``users`` (a count or the ids)."""
        ids = [uuid7() for _ in range(n)]
        if isinstance(users, int):
            user_of = [f"{prefix}-{i % users}" for i in range(n)]
        else:
            user_of = [users[i % len(users)] for i in range(n)]
        parts = self.settings.partitions
        with self.engine.begin() as conn:
            uniq = sorted(set(user_of))
            conn.execute(
                text(
                    "INSERT INTO sessions (id, user_id) SELECT 's-' || u, u"
                    " FROM unnest(CAST(:u AS text[])) AS u ON CONFLICT DO NOTHING"
                ),
                {"u": uniq},
            )
            step = 5000
            for lo in range(0, n, step):
                chunk = range(lo, min(n, lo + step))
                conn.execute(
                    text(
                        "INSERT INTO runs (id, session_id, user_id, idempotency_key, input,"
                        " partition) SELECT i, 's-' || u, u, 'bench:' || i, CAST(inp AS jsonb), p"
                        " FROM unnest(CAST(:ids AS text[]), CAST(:us AS text[]),"
                        " CAST(:inps AS text[]), CAST(:ps AS int[])) AS t(i, u, inp, p)"
                    ),
                    {
                        "ids": [ids[i] for i in chunk],
                        "us": [user_of[i] for i in chunk],
                        "inps": [json.dumps(make_input(i)) for i in chunk],
                        "ps": [partition_for_key(user_of[i].encode(), parts) for i in chunk],
                    },
                )
        return Loaded(ids, user_of)

    def publish(self, loaded: Loaded) -> None:
        """Produce every run's trigger, in submission order, and wait for the broker."""
        headers = headers_for(RUN_REQUESTED)
        for run_id, user in zip(loaded.run_ids, loaded.users, strict=True):
            value = RunRequested(run_id, user, f"s-{user}", "").encode()
            while True:
                try:
                    self.producer.produce(
                        self.topic, key=user.encode(), value=value, headers=list(headers)
                    )
                    break
                except BufferError:
                    self.producer.poll(0.05)
            self.producer.poll(0)
        assert self.producer.flush(60) == 0

    def query(self, sql: str, **params: Any) -> list[Any]:
        with self.engine.connect() as conn:
            return list(conn.execute(text(sql), params).all())

    def terminal_count(self, run_ids: list[str]) -> int:
        return int(
            self.query(
                "SELECT count(*) AS n FROM runs WHERE id = ANY(:ids) AND status = ANY(:t)",
                ids=run_ids,
                t=list(TERMINAL),
            )[0].n
        )

    def wait_terminal(
        self,
        run_ids: list[str],
        timeout: float,
        what: str = "runs",
        alive: Callable[[], None] | None = None,
    ) -> None:
        """Poll until every run is terminal; ``alive`` raises if a process died."""
        deadline = time.monotonic() + timeout
        interval = 0.25
        while True:
            done = self.terminal_count(run_ids)
            if done == len(run_ids):
                return
            if alive is not None:
                alive()
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: {done}/{len(run_ids)} terminal after {timeout}s")
            time.sleep(interval)
            interval = min(1.0, interval * 1.5)

    def outcome(self, run_ids: list[str], t0_wall: float) -> dict[str, float]:
        """Throughput from Postgres timestamps: ``t0_wall`` (unix s) -> last finished_at."""
        row = self.query(
            "SELECT count(*) FILTER (WHERE status = 'done') AS done,"
            " extract(epoch FROM max(finished_at)) AS last FROM runs WHERE id = ANY(:ids)",
            ids=run_ids,
        )[0]
        chunks = self.query(
            "SELECT count(*) AS n FROM messages WHERE run_id = ANY(:ids) AND kind = 'chunk'",
            ids=run_ids,
        )[0].n
        wall = float(row.last) - t0_wall
        return {
            "wall": wall,
            "runs_s": len(run_ids) / wall,
            "chunks_s": chunks / wall,
            "done": int(row.done),
            "chunks": int(chunks),
        }

    def close(self) -> None:
        self.producer.flush(10)
        self.engine.dispose()


def users_on_distinct_partitions(partitions: int, count: int, prefix: str) -> list[str]:
    """``count`` user ids that hash to ``count`` different partitions."""
    assert count <= partitions
    found: dict[int, str] = {}
    i = 0
    while len(found) < count:
        u = f"{prefix}-{i}"
        found.setdefault(partition_for_key(u.encode(), partitions), u)
        i += 1
    return list(found.values())
