"""What a local Kafka cluster is: its nodes, ports, config files and on-disk layout.

Layout under ``<state_dir>/kafka``::

    cluster.json              cluster id, version and the ports of every node
    node-<id>/server.properties
    node-<id>/data/           log.dirs (meta.properties is written by the storage format)
    node-<id>/logs/server.log the broker's own log (deploy/local/log4j2.properties)
    node-<id>/console.log     JVM stdout/stderr (crashes before logging starts)
    node-<id>/kafka.pid

Ports are chosen once and remembered in ``cluster.json``, so a restart reuses them.
Pure apart from reading and writing files in the state dir; processes are in
:mod:`koda_runtime.localstack.kafka`.
"""

from __future__ import annotations

import base64
import json
import logging
import re
import secrets
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

from koda_runtime.errors import ConfigError, ServiceError
from koda_runtime.localstack import procs

log = logging.getLogger(__name__)

SUPPORTED_BROKERS = (1, 3)


SLOT_NAME = re.compile(r"^[a-z][a-z0-9]{0,15}$")
SCRAM_MECHANISMS = ("SCRAM-SHA-256", "SCRAM-SHA-512")
SASL_SSL_LISTENER = "SASL_SSL"


@dataclass(frozen=True)
class SaslSslListener:
    """A client listener that speaks SASL_SSL: TLS with the key and certificate chain in
    ``keystore`` (one PEM file: an unencrypted PKCS#8 key, then the chain), and SCRAM
    logins with ``mechanism``. Its users are created when the storage is formatted
    (:class:`ScramUser`); every node gets one such listener on a port of its own.
    The PLAINTEXT listener stays: the brokers and the readiness check use it."""

    keystore: str
    mechanism: str = "SCRAM-SHA-512"

    def __post_init__(self) -> None:
        if self.mechanism not in SCRAM_MECHANISMS:
            raise ConfigError(
                f"SASL_SSL listener mechanism {self.mechanism!r}: use one of "
                f"{', '.join(SCRAM_MECHANISMS)}"
            )


@dataclass(frozen=True)
class ScramUser:
    """A SCRAM login the storage format creates (``kafka-storage format --add-scram``)."""

    name: str
    password: str = field(repr=False)

    def add_scram(self, mechanism: str) -> str:
        """The ``--add-scram`` argument that creates this user for ``mechanism``."""
        bad = [c for c in '[]=,"\\' if c in self.name + self.password]
        if bad or not self.name or not self.password:
            raise ConfigError(
                f"SCRAM user {self.name!r}: name and password must be non-empty and "
                "free of [ ] = , \\ and quotes"
            )
        return f"{mechanism}=[name={self.name},password={self.password}]"


@dataclass(frozen=True)
class SlotListener:
    """A client slot's own listener on one node: the broker binds ``port`` and advertises
    ``advertised_port``, where a proxy in front of it listens.

    A client that bootstraps through its slot's proxies is told, in every metadata and
    coordinator answer, the addresses of that listener (a broker answers with the
    endpoints of the listener the request came in on), so every connection it makes to
    any broker goes through its slot's proxies: cutting them cuts that client alone.
    """

    slot: str
    port: int
    advertised_port: int

    @property
    def listener(self) -> str:
        return f"SLOT_{self.slot.upper()}"


@dataclass(frozen=True)
class NodeSpec:
    """One combined broker+controller node on 127.0.0.1."""

    node_id: int
    port: int
    controller_port: int
    slots: tuple[SlotListener, ...] = ()
    sasl_ssl_port: int | None = None

    def slot(self, name: str) -> SlotListener:
        for s in self.slots:
            if s.slot == name:
                return s
        raise ConfigError(f"Kafka node {self.node_id} has no listener for client slot {name!r}")


@dataclass(frozen=True)
class ClusterSpec:
    """What ``cluster.json`` remembers: enough to restart the same cluster on the same ports."""

    cluster_id: str
    version: str
    nodes: tuple[NodeSpec, ...]
    sasl_ssl: SaslSslListener | None = None

    @property
    def brokers(self) -> int:
        return len(self.nodes)

    @property
    def bootstrap(self) -> str:
        return ",".join(f"127.0.0.1:{node.port}" for node in self.nodes)

    @property
    def slots(self) -> tuple[str, ...]:
        return tuple(s.slot for s in self.nodes[0].slots) if self.nodes else ()

    @property
    def sasl_ssl_bootstrap(self) -> str:
        """The bootstrap of the SASL_SSL listener; ConfigError if the cluster has none."""
        if self.sasl_ssl is None:
            raise ConfigError("this Kafka cluster has no SASL_SSL listener")
        return ",".join(f"127.0.0.1:{node.sasl_ssl_port}" for node in self.nodes)

    def slot_bootstrap(self, slot: str) -> str:
        """The bootstrap of a client in ``slot``: the advertised (proxy) address on every node."""
        return ",".join(f"127.0.0.1:{node.slot(slot).advertised_port}" for node in self.nodes)

    def node(self, node_id: int) -> NodeSpec:
        for node in self.nodes:
            if node.node_id == node_id:
                return node
        ids = ", ".join(str(n.node_id) for n in self.nodes)
        raise ConfigError(f"Kafka node {node_id} does not exist: this cluster has nodes {ids}")

    def to_json(self) -> str:
        nodes = [asdict(node) for node in self.nodes]
        doc: dict[str, object] = {
            "cluster_id": self.cluster_id,
            "version": self.version,
            "nodes": nodes,
        }
        if self.sasl_ssl is not None:
            doc["sasl_ssl"] = asdict(self.sasl_ssl)
        return json.dumps(doc, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> ClusterSpec:
        doc = json.loads(text)
        nodes = tuple(
            NodeSpec(
                node_id=node["node_id"],
                port=node["port"],
                controller_port=node["controller_port"],
                slots=tuple(SlotListener(**s) for s in node.get("slots", ())),
                sasl_ssl_port=node.get("sasl_ssl_port"),
            )
            for node in doc["nodes"]
        )
        secure = doc.get("sasl_ssl")
        return cls(
            cluster_id=doc["cluster_id"],
            version=doc["version"],
            nodes=nodes,
            sasl_ssl=SaslSslListener(**secure) if secure else None,
        )


def new_cluster_id() -> str:
    """A random Kafka cluster id: url-safe base64 of 16 bytes, unpadded, not starting with '-'."""
    while True:
        cid = base64.urlsafe_b64encode(secrets.token_bytes(16)).decode().rstrip("=")
        if not cid.startswith("-"):
            return cid


def new_cluster(
    brokers: int,
    version: str,
    slots: tuple[str, ...] = (),
    sasl_ssl: SaslSslListener | None = None,
) -> ClusterSpec:
    """A cluster of ``brokers`` nodes with ids 1..n on fresh free ports; each node gets
    a listener (and a port for its proxy) per client slot of ``slots``, and a SASL_SSL
    listener when ``sasl_ssl`` is given."""
    check_brokers(brokers)
    check_slots(slots)
    per_node = 2 + 2 * len(slots) + (1 if sasl_ssl else 0)
    ports = iter(procs.free_ports(per_node * brokers))
    nodes = tuple(
        NodeSpec(
            node_id=i + 1,
            port=next(ports),
            controller_port=next(ports),
            slots=tuple(SlotListener(s, next(ports), next(ports)) for s in slots),
            sasl_ssl_port=next(ports) if sasl_ssl else None,
        )
        for i in range(brokers)
    )
    return ClusterSpec(cluster_id=new_cluster_id(), version=version, nodes=nodes, sasl_ssl=sasl_ssl)


def check_brokers(brokers: int) -> None:
    if brokers not in SUPPORTED_BROKERS:
        raise ConfigError(f"--brokers {brokers} is not supported: use 1 or 3")


def check_slots(slots: tuple[str, ...]) -> None:
    bad = [s for s in slots if not SLOT_NAME.match(s)]
    if bad:
        raise ConfigError(
            f"client slot names {bad} are not valid: lower-case letters and digits, "
            "starting with a letter, at most 16"
        )
    if len(set(slots)) != len(slots):
        raise ConfigError(f"client slot names repeat: {list(slots)}")


def render_server_properties(cluster: ClusterSpec, node: NodeSpec, data_dir: Path) -> str:
    """The ``server.properties`` of ``node``: KRaft, static quorum of every node, loopback only.

    With three nodes, internal topics and new topics default to replication 3 and
    ``min.insync.replicas=2``, so one node can be down without losing acks=all writes.
    """
    replication = min(cluster.brokers, 3)
    min_isr = 2 if cluster.brokers >= 3 else 1
    voters = ",".join(f"{n.node_id}@127.0.0.1:{n.controller_port}" for n in cluster.nodes)
    listeners = [f"PLAINTEXT://127.0.0.1:{node.port}"]
    advertised = list(listeners)
    protocols = ["PLAINTEXT:PLAINTEXT", "CONTROLLER:PLAINTEXT"]
    for s in node.slots:
        listeners.append(f"{s.listener}://127.0.0.1:{s.port}")
        advertised.append(f"{s.listener}://127.0.0.1:{s.advertised_port}")
        protocols.append(f"{s.listener}:PLAINTEXT")
    if cluster.sasl_ssl is not None:
        secure = f"{SASL_SSL_LISTENER}://127.0.0.1:{node.sasl_ssl_port}"
        listeners.append(secure)
        advertised.append(secure)
        protocols.append(f"{SASL_SSL_LISTENER}:SASL_SSL")
    listeners.append(f"CONTROLLER://127.0.0.1:{node.controller_port}")
    props: dict[str, object] = {
        "process.roles": "broker,controller",
        "node.id": node.node_id,
        "controller.quorum.voters": voters,
        "listeners": ",".join(listeners),
        "advertised.listeners": ",".join(advertised),
        "listener.security.protocol.map": ",".join(protocols),
        "controller.listener.names": "CONTROLLER",
        "inter.broker.listener.name": "PLAINTEXT",
        "log.dirs": data_dir,
        "auto.create.topics.enable": "false",
        "num.partitions": 1,
        "default.replication.factor": replication,
        "min.insync.replicas": min_isr,
        # The defaults of 50 partitions make the first group join and the first
        # transactional producer slow on a laptop.
        "offsets.topic.num.partitions": 4,
        "offsets.topic.replication.factor": replication,
        "transaction.state.log.num.partitions": 4,
        "transaction.state.log.replication.factor": replication,
        "transaction.state.log.min.isr": min_isr,
        "share.coordinator.state.topic.num.partitions": 4,
        "share.coordinator.state.topic.replication.factor": replication,
        "share.coordinator.state.topic.min.isr": min_isr,
        "group.initial.rebalance.delay.ms": 0,
        # The workers' group runs the consumer protocol (KIP-848), where the broker owns
        # the session timeout and heartbeat interval. The defaults (45 s, 5 s) and their
        # bounds (45-60 s, 5-15 s) would refuse KODA_SESSION_TIMEOUT's 10 s; each worker
        # sets its group's own values (processors/groupconfig.py) within these bounds.
        "group.consumer.session.timeout.ms": 10_000,
        "group.consumer.min.session.timeout.ms": 1_000,
        "group.consumer.max.session.timeout.ms": 300_000,
        "group.consumer.heartbeat.interval.ms": 1_000,
        "group.consumer.min.heartbeat.interval.ms": 100,
        "group.consumer.max.heartbeat.interval.ms": 60_000,
        # Fence a killed broker after 6 s instead of 9 s so fault tests fail over sooner.
        "broker.session.timeout.ms": 6000,
        "broker.heartbeat.interval.ms": 1000,
        "num.network.threads": 2,
        "num.io.threads": 2,
        "num.recovery.threads.per.data.dir": 1,
    }
    if cluster.sasl_ssl is not None:
        props |= _sasl_ssl_properties(cluster.sasl_ssl)
    lines = ["# Written by `koda services up` on every start; edits are overwritten."]
    lines += [f"{key}={value}" for key, value in props.items()]
    return "\n".join(lines) + "\n"


def _sasl_ssl_properties(secure: SaslSslListener) -> dict[str, object]:
    """The SASL_SSL listener's own settings: its PEM keystore and its SCRAM login module
    (users live in the cluster's metadata, written by the storage format)."""
    prefix = f"listener.name.{SASL_SSL_LISTENER.lower()}."
    return {
        f"{prefix}ssl.keystore.type": "PEM",
        f"{prefix}ssl.keystore.location": secure.keystore,
        f"{prefix}sasl.enabled.mechanisms": secure.mechanism,
        f"{prefix}{secure.mechanism.lower()}.sasl.jaas.config": (
            "org.apache.kafka.common.security.scram.ScramLoginModule required;"
        ),
    }


@dataclass(frozen=True)
class NodePaths:
    """Where one node keeps its config, data, logs and pid file."""

    root: Path

    @classmethod
    def of(cls, state_dir: Path, node_id: int) -> NodePaths:
        return cls(kafka_dir(state_dir) / f"node-{node_id}")

    @property
    def config(self) -> Path:
        return self.root / "server.properties"

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def console(self) -> Path:
        return self.root / "console.log"

    @property
    def pid_file(self) -> Path:
        return self.root / "kafka.pid"

    @property
    def formatted(self) -> bool:
        return (self.data / "meta.properties").is_file()

    def failure_tail(self) -> str:
        parts = [procs.tail(self.logs / "server.log"), procs.tail(self.console, 10)]
        return "\n".join(p for p in parts if p)


def kafka_dir(state_dir: Path) -> Path:
    return state_dir / "kafka"


def cluster_file(state_dir: Path) -> Path:
    return kafka_dir(state_dir) / "cluster.json"


def load_cluster(state_dir: Path) -> ClusterSpec | None:
    """The cluster remembered in ``state_dir``, or None if there is none."""
    path = cluster_file(state_dir)
    try:
        return ClusterSpec.from_json(path.read_text())
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError) as exc:
        raise ServiceError(
            f"{path} is unreadable ({exc}): run `koda services down` and delete "
            f"{kafka_dir(state_dir)} to start Kafka afresh"
        ) from exc


def _meta_cluster_id(paths: NodePaths) -> str | None:
    try:
        text = (paths.data / "meta.properties").read_text()
    except OSError:
        return None
    match = re.search(r"^cluster\.id=(\S+)", text, re.M)
    return match.group(1) if match else None


def prepare_cluster(
    state_dir: Path,
    brokers: int,
    version: str,
    slots: tuple[str, ...] = (),
    sasl_ssl: SaslSslListener | None = None,
) -> ClusterSpec:
    """Load the remembered cluster, or create ``cluster.json`` for a new one (with a
    listener per client slot of ``slots`` on every node, and a SASL_SSL listener when
    ``sasl_ssl`` is given).

    Raises ServiceError, naming what to delete, when the state dir holds a cluster of
    another size, other client slots, another SASL_SSL listener, or another cluster's data.
    """
    check_brokers(brokers)
    check_slots(slots)
    cluster = load_cluster(state_dir)
    kdir = kafka_dir(state_dir)
    if cluster is None:
        leftovers = [p for p in kdir.glob("node-*") if NodePaths(p).formatted]
        if leftovers:
            raise ServiceError(
                f"{leftovers[0]} holds Kafka data but {cluster_file(state_dir)} is missing: "
                f"delete {kdir} to start Kafka afresh"
            )
        if kdir.exists():
            shutil.rmtree(kdir)
        cluster = new_cluster(brokers, version, slots, sasl_ssl)
        procs.write_text(cluster_file(state_dir), cluster.to_json())
        return cluster
    if cluster.brokers != brokers:
        raise ServiceError(
            f"{state_dir} holds a {cluster.brokers}-broker Kafka cluster, not {brokers}: "
            f"run `koda services down`, delete {kdir}, then `koda services up --brokers {brokers}`"
        )
    if slots and cluster.slots != slots:
        raise ServiceError(
            f"{state_dir} holds a Kafka cluster with client slots {list(cluster.slots)}, "
            f"not {list(slots)}: run `koda services down` and delete {kdir}"
        )
    if sasl_ssl and cluster.sasl_ssl != sasl_ssl:
        raise ServiceError(
            f"{state_dir} holds a Kafka cluster with SASL_SSL listener {cluster.sasl_ssl}, "
            f"not {sasl_ssl}: run `koda services down` and delete {kdir}"
        )
    if cluster.version != version:
        raise ServiceError(
            f"{state_dir} holds Kafka {cluster.version} data but the lock pins {version}: "
            f"run `koda services down` and delete {kdir}"
        )
    for node in cluster.nodes:
        found = _meta_cluster_id(NodePaths.of(state_dir, node.node_id))
        if found is not None and found != cluster.cluster_id:
            raise ServiceError(
                f"{NodePaths.of(state_dir, node.node_id).data} belongs to cluster {found}, "
                f"not {cluster.cluster_id}: run `koda services down` and delete {kdir}"
            )
    return cluster
