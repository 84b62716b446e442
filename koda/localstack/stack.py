"""The local stack: Kafka (1 or 3 nodes) and PostgreSQL under one state dir.

``up`` is idempotent and recovers from crashes (stale pid files, half-initialised
data dirs); ``down`` stops every process it finds and leaves the data for the next
``up``. A file lock on ``<state_dir>/.lock`` serialises concurrent ``up``/``down``.
"""

from __future__ import annotations

import fcntl
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from koda_runtime import stackenv
from koda_runtime.errors import ServiceError
from koda_runtime.localstack import jaeger, kafka, kafka_cluster, postgres, procs, prometheus

log = logging.getLogger(__name__)

ENV_FILE = stackenv.ENV_FILE


@dataclass(frozen=True)
class StackInfo:
    """Where the local services listen."""

    kafka_bootstrap: str
    database_url: str
    brokers: int


def env_lines(info: StackInfo) -> list[str]:
    """``KEY=VALUE`` lines for ``services.env`` and ``koda services env``."""
    return [
        f"KODA_KAFKA_BOOTSTRAP={info.kafka_bootstrap}",
        f"KODA_DATABASE_URL={info.database_url}",
    ]


@contextmanager
def _locked(state_dir: Path) -> Iterator[None]:
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
        fh = (state_dir / ".lock").open("a")
    except OSError as exc:
        raise procs.disk_error(exc, state_dir / ".lock") from exc
    with fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def up(state_dir: Path, *, brokers: int = 1, slots: tuple[str, ...] = ()) -> StackInfo:
    """Start Kafka (``brokers`` = 1 or 3 nodes) and PostgreSQL; return where they listen.

    ``slots`` names client slots (the fault tests' per-process proxies): a new cluster
    gets, on every node, one more listener per slot that advertises that slot's proxy
    port (``kafka_cluster.SlotListener``); ``load_cluster`` gives the ports.

    Idempotent: running healthy services are reused. Writes ``<state_dir>/services.env``.
    Waits up to 60 s for Kafka and 30 s for PostgreSQL. Raises PrerequisiteError when
    java, the jars or the Postgres programs are missing and ServiceError when a service
    cannot start (the message carries the tail of its log).
    """
    state_dir = state_dir.resolve()
    kafka_cluster.check_brokers(brokers)
    with _locked(state_dir):
        cluster = kafka.start_cluster(state_dir, brokers, slots)
        # Postgres initialises and starts while the JVMs boot.
        database_url = postgres.start(state_dir)
        kafka.wait_ready(state_dir, cluster)
        info = StackInfo(cluster.bootstrap, database_url, cluster.brokers)
        # With the state dir's Jaeger running (--with-tracing), koda's processes trace.
        lines = env_lines(info) + jaeger.env_lines(state_dir)
        procs.write_text(state_dir / ENV_FILE, "\n".join(lines) + "\n")
    log.info("services up state_dir=%s bootstrap=%s", state_dir, info.kafka_bootstrap)
    return info


def down(state_dir: Path) -> None:
    """Stop every Kafka node, PostgreSQL and (if started) Prometheus of ``state_dir``
    and remove their pid files.

    Each process gets SIGTERM (Postgres: ``pg_ctl stop -m fast``) and 30 s to exit before
    SIGKILL. Data is kept. Removes ``services.env``.
    """
    state_dir = state_dir.resolve()
    if not state_dir.is_dir():
        return
    with _locked(state_dir):
        prometheus.stop(state_dir)
        jaeger.stop(state_dir)
        kafka.stop_cluster(state_dir)
        postgres.stop(state_dir)
        (state_dir / ENV_FILE).unlink(missing_ok=True)


def read_info(state_dir: Path) -> StackInfo:
    """The addresses remembered in ``state_dir`` (whether or not the services run).

    Raises ServiceError if ``up`` never ran there.
    """
    state_dir = state_dir.resolve()
    cluster = kafka_cluster.load_cluster(state_dir)
    port = postgres.load_port(state_dir)
    if cluster is None or port is None:
        raise ServiceError(f"no local services in {state_dir}: run `koda services up`")
    return StackInfo(cluster.bootstrap, postgres.database_url(port), cluster.brokers)


def status(state_dir: Path) -> dict[str, Any]:
    """A JSON-ready report: for each Kafka node and Postgres, its port, pid and liveness.

    ``running`` at the top level is True only when every process runs and listens.
    """
    state_dir = state_dir.resolve()
    report: dict[str, Any] = {"state_dir": str(state_dir), "kafka": None, "postgres": None}
    cluster = kafka_cluster.load_cluster(state_dir)
    if cluster is not None:
        nodes = []
        for node in cluster.nodes:
            pid = kafka.node_pid(state_dir, node.node_id)
            nodes.append({
                "node_id": node.node_id,
                "port": node.port,
                "controller_port": node.controller_port,
                "pid": pid,
                "running": pid is not None and procs.port_accepts(node.port),
            })  # fmt: skip
        report["kafka"] = {
            "version": cluster.version,
            "cluster_id": cluster.cluster_id,
            "bootstrap": cluster.bootstrap,
            "brokers": cluster.brokers,
            "nodes": nodes,
        }
    port = postgres.load_port(state_dir)
    if port is not None:
        pid = postgres.postmaster_pid(state_dir)
        report["postgres"] = {
            "port": port,
            "url": postgres.database_url(port),
            "pid": pid,
            "running": pid is not None and procs.port_accepts(port),
        }
    report["prometheus"] = prometheus.status(state_dir)  # optional: not part of "running"
    report["jaeger"] = jaeger.status(state_dir)  # optional too
    kafka_ok = report["kafka"] is not None and all(n["running"] for n in report["kafka"]["nodes"])
    pg_ok = report["postgres"] is not None and report["postgres"]["running"]
    report["running"] = bool(kafka_ok and pg_ok)
    return report


def pg_start(state_dir: Path) -> str:
    """Start PostgreSQL of an existing stack (no-op if it runs); return its URL when ready."""
    state_dir = state_dir.resolve()
    return postgres.start(state_dir)


def pg_stop(state_dir: Path) -> None:
    """Stop PostgreSQL gracefully (``pg_ctl stop -m fast``, SIGKILL after 30 s)."""
    postgres.stop(state_dir.resolve())


def pg_kill(state_dir: Path) -> None:
    """SIGKILL PostgreSQL and its backends, like a crash (postmaster.pid stays behind)."""
    postgres.kill(state_dir.resolve())


def pg_pid(state_dir: Path) -> int | None:
    """The postmaster pid if PostgreSQL runs, else None."""
    return postgres.postmaster_pid(state_dir.resolve())
