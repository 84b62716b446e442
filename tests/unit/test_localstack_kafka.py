"""Kafka launcher pure parts: config rendering, cluster state, crash leftovers."""

from __future__ import annotations

from pathlib import Path

import pytest

from koda_runtime.errors import ConfigError, PrerequisiteError, ServiceError
from koda_runtime.localstack import kafka, kafka_cluster
from koda_runtime.localstack.kafka_cluster import ClusterSpec, NodePaths, NodeSpec


def _props(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            out[key] = value
    return out


def _cluster(n: int) -> ClusterSpec:
    nodes = tuple(NodeSpec(i, 9000 + 10 * i, 9001 + 10 * i) for i in range(1, n + 1))
    return ClusterSpec(cluster_id="abc", version="4.1.1", nodes=nodes)


def test_single_node_config_is_combined_kraft_on_loopback() -> None:
    cluster = _cluster(1)
    props = _props(kafka_cluster.render_server_properties(cluster, cluster.nodes[0], Path("/d")))
    assert props["process.roles"] == "broker,controller"
    assert props["node.id"] == "1"
    assert props["controller.quorum.voters"] == "1@127.0.0.1:9011"
    assert props["listeners"] == "PLAINTEXT://127.0.0.1:9010,CONTROLLER://127.0.0.1:9011"
    assert props["advertised.listeners"] == "PLAINTEXT://127.0.0.1:9010"
    assert props["log.dirs"] == "/d"
    assert props["auto.create.topics.enable"] == "false"
    assert props["group.initial.rebalance.delay.ms"] == "0"
    assert int(props["offsets.topic.num.partitions"]) <= 8
    assert props["offsets.topic.replication.factor"] == "1"
    assert props["transaction.state.log.min.isr"] == "1"
    assert props["min.insync.replicas"] == "1"


def test_three_node_config_has_static_quorum_and_replication_three() -> None:
    cluster = _cluster(3)
    texts = [
        kafka_cluster.render_server_properties(cluster, n, Path(f"/d{n.node_id}"))
        for n in cluster.nodes
    ]
    voters = {_props(t)["controller.quorum.voters"] for t in texts}
    assert voters == {"1@127.0.0.1:9011,2@127.0.0.1:9021,3@127.0.0.1:9031"}
    props = _props(texts[1])
    assert props["node.id"] == "2"
    assert props["listeners"] == "PLAINTEXT://127.0.0.1:9020,CONTROLLER://127.0.0.1:9021"
    assert props["default.replication.factor"] == "3"
    assert props["min.insync.replicas"] == "2"
    assert props["offsets.topic.replication.factor"] == "3"
    assert props["transaction.state.log.replication.factor"] == "3"
    assert props["transaction.state.log.min.isr"] == "2"


def test_cluster_spec_roundtrips_through_json_and_names_its_bootstrap() -> None:
    cluster = _cluster(3)
    assert ClusterSpec.from_json(cluster.to_json()) == cluster
    assert cluster.bootstrap == "127.0.0.1:9010,127.0.0.1:9020,127.0.0.1:9030"
    assert cluster.node(2).port == 9020
    with pytest.raises(ConfigError, match="node 4 does not exist"):
        cluster.node(4)


def test_slot_listeners_advertise_each_slots_proxy_on_every_node() -> None:
    cluster = kafka_cluster.new_cluster(3, "4.1.1", ("w1", "gw"))
    for node in cluster.nodes:
        props = _props(kafka_cluster.render_server_properties(cluster, node, Path("/d")))
        w1, gw = node.slot("w1"), node.slot("gw")
        assert props["listeners"] == (
            f"PLAINTEXT://127.0.0.1:{node.port},SLOT_W1://127.0.0.1:{w1.port},"
            f"SLOT_GW://127.0.0.1:{gw.port},CONTROLLER://127.0.0.1:{node.controller_port}"
        )
        assert props["advertised.listeners"] == (
            f"PLAINTEXT://127.0.0.1:{node.port},SLOT_W1://127.0.0.1:{w1.advertised_port},"
            f"SLOT_GW://127.0.0.1:{gw.advertised_port}"
        )
        assert "SLOT_W1:PLAINTEXT" in props["listener.security.protocol.map"].split(",")
        assert props["inter.broker.listener.name"] == "PLAINTEXT"
    assert cluster.slot_bootstrap("w1") == ",".join(
        f"127.0.0.1:{n.slot('w1').advertised_port}" for n in cluster.nodes
    )
    ports = [p for n in cluster.nodes for s in n.slots for p in (s.port, s.advertised_port)]
    ports += [p for n in cluster.nodes for p in (n.port, n.controller_port)]
    assert len(set(ports)) == len(ports) == 3 * (2 + 2 * 2)
    assert ClusterSpec.from_json(cluster.to_json()) == cluster
    with pytest.raises(ConfigError, match="no listener for client slot 'w9'"):
        cluster.nodes[0].slot("w9")


@pytest.mark.parametrize("slots", [("W1",), ("w1", "w1"), ("1w",), ("w-1",)])
def test_bad_slot_names_are_refused_by_name(slots: tuple[str, ...]) -> None:
    with pytest.raises(ConfigError, match="client slot names"):
        kafka_cluster.new_cluster(1, "4.1.1", slots)


def test_prepare_cluster_refuses_other_slots_and_says_what_to_delete(tmp_path: Path) -> None:
    kafka_cluster.prepare_cluster(tmp_path, 1, "4.1.1", ("w1",))
    assert kafka_cluster.prepare_cluster(tmp_path, 1, "4.1.1").slots == ("w1",)
    with pytest.raises(ServiceError, match=r"client slots \['w1'\], not \['w2'\].*delete"):
        kafka_cluster.prepare_cluster(tmp_path, 1, "4.1.1", ("w2",))


def test_new_cluster_picks_distinct_ports_and_a_valid_id() -> None:
    cluster = kafka_cluster.new_cluster(3, "4.1.1")
    ports = [p for n in cluster.nodes for p in (n.port, n.controller_port)]
    assert len(set(ports)) == 6
    assert [n.node_id for n in cluster.nodes] == [1, 2, 3]
    assert len(cluster.cluster_id) == 22 and not cluster.cluster_id.startswith("-")


@pytest.mark.parametrize("brokers", [0, 2, 4])
def test_only_one_or_three_brokers_are_accepted(brokers: int) -> None:
    with pytest.raises(ConfigError, match="use 1 or 3"):
        kafka_cluster.check_brokers(brokers)


def test_prepare_cluster_remembers_ports_across_calls(tmp_path: Path) -> None:
    first = kafka_cluster.prepare_cluster(tmp_path, 1, "4.1.1")
    assert kafka_cluster.prepare_cluster(tmp_path, 1, "4.1.1") == first


def test_prepare_cluster_refuses_another_size_and_says_what_to_delete(tmp_path: Path) -> None:
    kafka_cluster.prepare_cluster(tmp_path, 1, "4.1.1")
    with pytest.raises(ServiceError, match=f"delete {tmp_path / 'kafka'}"):
        kafka_cluster.prepare_cluster(tmp_path, 3, "4.1.1")


def test_prepare_cluster_wipes_a_half_formatted_dir_without_state(tmp_path: Path) -> None:
    junk = NodePaths.of(tmp_path, 1).data / "junk"
    junk.parent.mkdir(parents=True)
    junk.write_text("x")
    kafka_cluster.prepare_cluster(tmp_path, 1, "4.1.1")
    assert not junk.exists()


def test_prepare_cluster_refuses_data_whose_state_file_is_gone(tmp_path: Path) -> None:
    meta = NodePaths.of(tmp_path, 1).data / "meta.properties"
    meta.parent.mkdir(parents=True)
    meta.write_text("cluster.id=xyz\n")
    with pytest.raises(ServiceError, match="cluster.json is missing"):
        kafka_cluster.prepare_cluster(tmp_path, 1, "4.1.1")


def test_prepare_cluster_refuses_data_of_another_cluster(tmp_path: Path) -> None:
    kafka_cluster.prepare_cluster(tmp_path, 1, "4.1.1")
    meta = NodePaths.of(tmp_path, 1).data / "meta.properties"
    meta.parent.mkdir(parents=True)
    meta.write_text("version=1\ncluster.id=someone-else\nnode.id=1\n")
    with pytest.raises(ServiceError, match="belongs to cluster someone-else"):
        kafka_cluster.prepare_cluster(tmp_path, 1, "4.1.1")


def test_missing_java_names_the_package_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("koda_runtime.localstack.kafka.shutil.which", lambda name: None)
    kafka.java_path.cache_clear()
    try:
        with pytest.raises(PrerequisiteError, match="apt-get install openjdk-17-jre-headless"):
            kafka.java_path()
    finally:
        kafka.java_path.cache_clear()
