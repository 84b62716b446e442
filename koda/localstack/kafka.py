"""Local Apache Kafka processes in KRaft mode: format, start, wait, stop, kill.

One combined broker+controller node, or three with a static quorum (see
:mod:`koda_runtime.localstack.kafka_cluster` for the config and the on-disk layout). A node
is identified by its config path on its command line, so a recycled pid is never
mistaken for a broker.
"""

from __future__ import annotations

import functools
import logging
import re
import shutil
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient

from koda_runtime.errors import PrerequisiteError, ServiceError
from koda_runtime.localstack import jars, procs
from koda_runtime.localstack.kafka_cluster import (
    ClusterSpec,
    NodePaths,
    NodeSpec,
    SaslSslListener,
    ScramUser,
    load_cluster,
    prepare_cluster,
    render_server_properties,
)

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0
SERVER_JVM_OPTS = (
    "-Xms256m",
    "-Xmx512m",
    "-XX:+UseG1GC",
    "-XX:MaxGCPauseMillis=20",
    "-XX:+ExitOnOutOfMemoryError",
    "-Djava.awt.headless=true",
)
# The storage format is a short-lived JVM: C1 only and the serial GC halve its run time.
FORMAT_JVM_OPTS = ("-Xmx256m", "-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC")
_JAVA_INSTALL = "install Java 17+: apt-get install openjdk-17-jre-headless"


@functools.cache
def java_path() -> str:
    """The ``java`` on PATH, checked to be version 17 or later."""
    java = shutil.which("java")
    if java is None:
        raise PrerequisiteError(f"`java` is not on PATH: {_JAVA_INSTALL}")
    done = subprocess.run([java, "-version"], capture_output=True, text=True)  # noqa: S603
    match = re.search(r'version "(\d+)(?:\.(\d+))?', done.stderr + done.stdout)
    if match is None:
        raise PrerequisiteError(f"`{java} -version` printed no version: {_JAVA_INSTALL}")
    major = int(match.group(1))
    if major == 1 and match.group(2):
        major = int(match.group(2))
    if major < 17:
        raise PrerequisiteError(f"{java} is Java {major}; Kafka 4 needs 17+: {_JAVA_INSTALL}")
    return java


def _java_argv(classpath: Sequence[Path], paths: NodePaths, opts: Sequence[str]) -> list[str]:
    return [
        java_path(),
        *opts,
        f"-Dlog4j2.configurationFile={jars.deploy_dir() / 'log4j2.properties'}",
        f"-Dkafka.logs.dir={paths.logs}",
        "-cp",
        ":".join(str(p) for p in classpath),
    ]


def _write_config(state_dir: Path, cluster: ClusterSpec, node: NodeSpec) -> NodePaths:
    paths = NodePaths.of(state_dir, node.node_id)
    procs.write_text(paths.config, render_server_properties(cluster, node, paths.data))
    return paths


def format_storage(
    state_dir: Path,
    cluster: ClusterSpec,
    classpath: Sequence[Path],
    scram_users: Sequence[ScramUser] = (),
) -> None:
    """Format the log dirs of nodes that lack ``meta.properties`` (in parallel).

    A log dir without ``meta.properties`` is a half-finished format: it is wiped first.
    ``scram_users`` are created (for the SASL_SSL listener's mechanism) in the cluster's
    first metadata; they need a cluster with that listener.
    """
    scram: list[str] = []
    for user in scram_users:
        if cluster.sasl_ssl is None:
            raise ServiceError("SCRAM users need a cluster with a SASL_SSL listener")
        scram += ["--add-scram", user.add_scram(cluster.sasl_ssl.mechanism)]
    pending: list[tuple[NodePaths, subprocess.Popen[str]]] = []
    for node in cluster.nodes:
        paths = _write_config(state_dir, cluster, node)
        if paths.formatted:
            continue
        if paths.data.exists():
            log.warning("wiping half-initialised kafka log dir path=%s", paths.data)
            shutil.rmtree(paths.data)
        paths.logs.mkdir(parents=True, exist_ok=True)
        argv = _java_argv(classpath, paths, FORMAT_JVM_OPTS) + [
            "kafka.tools.StorageTool", "format",
            "-t", cluster.cluster_id, "-c", str(paths.config), *scram,
        ]  # fmt: skip
        proc = subprocess.Popen(  # noqa: S603
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        pending.append((paths, proc))
    for paths, proc in pending:
        try:
            output, _ = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired as exc:
            proc.kill()
            proc.communicate()
            raise ServiceError(
                f"formatting Kafka storage {paths.data} took over 120s; delete it and retry"
            ) from exc
        if proc.returncode != 0 or not paths.formatted:
            raise ServiceError(
                f"formatting Kafka storage {paths.data} failed (exit {proc.returncode}); "
                f"delete {paths.data} and retry:\n{output.strip()[-2000:]}"
            )


def _marker(paths: NodePaths) -> str:
    # The broker's main class followed by its config: unique per node and state dir,
    # and absent from the storage tool's command line.
    return f"kafka.Kafka {paths.config}"


def node_pid(state_dir: Path, node_id: int) -> int | None:
    """The pid of the running Kafka node ``node_id``, or None.

    A stale pid file is removed; a running node whose pid file is missing is found
    by its command line and its pid file rewritten.
    """
    paths = NodePaths.of(state_dir, node_id)
    pid = procs.running_pid(paths.pid_file, _marker(paths))
    if pid is None and paths.config.exists():
        pid = procs.find_pid(_marker(paths))
        if pid is not None:
            log.info("found kafka node without pid file node_id=%d pid=%d", node_id, pid)
            procs.write_text(paths.pid_file, f"{pid}\n")
    return pid


def spawn_node(
    state_dir: Path, cluster: ClusterSpec, node: NodeSpec, classpath: Sequence[Path]
) -> int:
    """Start ``node`` detached unless it already runs; return its pid. Does not wait."""
    pid = node_pid(state_dir, node.node_id)
    if pid is not None:
        return pid
    what = f"Kafka node {node.node_id}"
    procs.require_free_port(node.port, what, state_dir)
    procs.require_free_port(node.controller_port, f"{what} (controller)", state_dir)
    for s in node.slots:
        procs.require_free_port(s.port, f"{what} (slot {s.slot})", state_dir)
    paths = _write_config(state_dir, cluster, node)
    paths.logs.mkdir(parents=True, exist_ok=True)
    argv = _java_argv(classpath, paths, SERVER_JVM_OPTS) + ["kafka.Kafka", str(paths.config)]
    pid = procs.spawn_detached(argv, output=paths.console, cwd=paths.root)
    procs.write_text(paths.pid_file, f"{pid}\n")
    log.info("kafka node started node_id=%d pid=%d port=%d", node.node_id, pid, node.port)
    return pid


class _ClientLog:
    """Sink for librdkafka's own log lines: "connection refused" while a broker boots is normal."""

    def log(self, level: int, msg: str, *args: Any) -> None:
        log.debug("rdkafka " + msg, *args)


def _visible_brokers(admin: AdminClient, timeout_s: float) -> set[int]:
    try:
        metadata = admin.list_topics(timeout=timeout_s)
    except KafkaException:
        return set()
    return set(metadata.brokers)


def wait_ready(
    state_dir: Path,
    cluster: ClusterSpec,
    node_ids: Sequence[int] | None = None,
    *,
    timeout_s: float = READY_TIMEOUT_S,
) -> None:
    """Wait until a metadata request lists every node of ``node_ids`` (default: all) as a broker.

    Fails early if a node's process exits, and after ``timeout_s`` seconds with the
    tail of the node's log.
    """
    wanted = set(node_ids or [n.node_id for n in cluster.nodes])
    conf: dict[str, Any] = {
        "bootstrap.servers": cluster.bootstrap,
        "logger": _ClientLog(),
        "socket.timeout.ms": 3000,
    }
    admin = AdminClient(conf)
    deadline = time.monotonic() + timeout_s
    seen: set[int] = set()
    while True:
        for node_id in sorted(wanted):
            if node_pid(state_dir, node_id) is None:
                paths = NodePaths.of(state_dir, node_id)
                tail = paths.failure_tail()
                reason = procs.last_failure(tail) or "no error logged"
                raise ServiceError(
                    f"Kafka node {node_id} exited during startup: {reason} "
                    f"(log: {paths.logs}/server.log)\n{tail}"
                )
        if any(procs.port_accepts(cluster.node(i).port) for i in wanted):
            seen = _visible_brokers(admin, timeout_s=3.0)
            if wanted <= seen:
                return
        if time.monotonic() >= deadline:
            break
        time.sleep(0.25)
    late = min(wanted - seen)
    paths = NodePaths.of(state_dir, late)
    tail = paths.failure_tail()
    last = procs.last_failure(tail)
    raise ServiceError(
        f"Kafka node {late} was not ready after {timeout_s:.0f}s (brokers seen: "
        f"{sorted(seen) or 'none'}; log: {paths.logs}/server.log){': ' + last if last else ''}"
        f"\n{tail}"
    )


def start_cluster(
    state_dir: Path,
    brokers: int,
    slots: tuple[str, ...] = (),
    *,
    sasl_ssl: SaslSslListener | None = None,
    scram_users: Sequence[ScramUser] = (),
) -> ClusterSpec:
    """Prepare, format and spawn every node that is not running; does not wait for readiness.

    ``slots`` (a new cluster only) gives every node a listener per client slot;
    ``sasl_ssl`` (a new cluster only) a SASL_SSL listener as well, whose SCRAM users
    ``scram_users`` are created when the storage is first formatted.
    """
    classpath = jars.ensure_jars()
    version = jars.kafka_version(jars.load_lock())
    java_path()
    cluster = prepare_cluster(state_dir, brokers, version, slots, sasl_ssl)
    format_storage(state_dir, cluster, classpath, scram_users)
    for node in cluster.nodes:
        spawn_node(state_dir, cluster, node, classpath)
    return cluster


def stop_cluster(state_dir: Path, *, timeout_s: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM every running node at once, then wait for each (SIGKILL after ``timeout_s``)."""
    cluster = load_cluster(state_dir)
    if cluster is None:
        return
    running = {}
    for node in cluster.nodes:
        pid = node_pid(state_dir, node.node_id)
        if pid is not None:
            procs.send_term(pid)
            running[node.node_id] = pid
    deadline = time.monotonic() + timeout_s
    for node_id, pid in running.items():
        left = max(1.0, deadline - time.monotonic())
        log_file = NodePaths.of(state_dir, node_id).logs / "server.log"
        procs.terminate(pid, name=f"Kafka node {node_id}", timeout_s=left, log_file=log_file)
        NodePaths.of(state_dir, node_id).pid_file.unlink(missing_ok=True)


def _require_cluster(state_dir: Path) -> ClusterSpec:
    cluster = load_cluster(state_dir)
    if cluster is None:
        raise ServiceError(f"no Kafka cluster in {state_dir}: run `koda services up` first")
    return cluster


def kafka_node_stop(state_dir: Path, node_id: int, *, timeout_s: float = STOP_TIMEOUT_S) -> None:
    """Stop Kafka node ``node_id`` gracefully (SIGTERM; SIGKILL after ``timeout_s`` seconds).

    A node that is not running is left alone.
    """
    state_dir = state_dir.resolve()
    _require_cluster(state_dir).node(node_id)
    pid = node_pid(state_dir, node_id)
    if pid is not None:
        log_file = NodePaths.of(state_dir, node_id).logs / "server.log"
        procs.terminate(pid, name=f"Kafka node {node_id}", timeout_s=timeout_s, log_file=log_file)
    NodePaths.of(state_dir, node_id).pid_file.unlink(missing_ok=True)


def kafka_node_kill(state_dir: Path, node_id: int) -> None:
    """Kill Kafka node ``node_id`` with SIGKILL, like a crash; its pid file is left behind."""
    state_dir = state_dir.resolve()
    _require_cluster(state_dir).node(node_id)
    pid = node_pid(state_dir, node_id)
    if pid is not None:
        procs.kill(pid, name=f"Kafka node {node_id}")


def kafka_node_start(
    state_dir: Path, node_id: int, *, wait: bool = True, timeout_s: float = READY_TIMEOUT_S
) -> None:
    """Start Kafka node ``node_id`` again (no-op if it runs).

    With ``wait`` (default), return once the cluster's metadata lists it as a broker;
    ``timeout_s`` is in seconds.
    """
    state_dir = state_dir.resolve()
    cluster = _require_cluster(state_dir)
    node = cluster.node(node_id)
    classpath = jars.ensure_jars()
    spawn_node(state_dir, cluster, node, classpath)
    if wait:
        wait_ready(state_dir, cluster, [node_id], timeout_s=timeout_s)


def kafka_node_pid(state_dir: Path, node_id: int) -> int | None:
    """The pid of Kafka node ``node_id`` if it runs, else None."""
    return node_pid(state_dir.resolve(), node_id)
