"""Kafka security settings: prod's refusal of anything but SASL_SSL, incomplete SASL or
TLS settings refused by name, the client certificate reaching librdkafka, a refused
login said in one line without the password, and the local broker's SASL_SSL listener.
(The same against a real broker: tests/integration/test_kafka_sasl_ssl.py.)"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from koda_runtime.errors import ConfigError
from koda_runtime.kafka import _refusal_line, common_config, require_files
from koda_runtime.localstack import kafka_cluster
from koda_runtime.localstack.kafka_cluster import ClusterSpec, SaslSslListener, ScramUser
from koda_runtime.naming import AppEnv
from koda_runtime.settings import KafkaSecurity, Settings

SASL = {
    "KODA_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
    "KODA_KAFKA_SASL_USERNAME": "koda-gateway",
    "KODA_KAFKA_SASL_PASSWORD": "pw-9f8e7d",
}
PROD = {"APP_ENV": "prod", "KODA_HANDLER": "openai"}


@pytest.mark.parametrize("protocol", ["PLAINTEXT", "SSL", "SASL_PLAINTEXT"])
def test_prod_refuses_anything_but_sasl_ssl_in_one_line_unless_allowed(protocol: str) -> None:
    env = PROD | {"KODA_KAFKA_SECURITY_PROTOCOL": protocol}
    if protocol.startswith("SASL_"):
        env |= SASL
    with pytest.raises(ConfigError) as refused:
        Settings.from_env(env)
    message = str(refused.value)
    assert message.startswith(f"KODA_KAFKA_SECURITY_PROTOCOL={protocol} is refused in prod")
    assert "KODA_KAFKA_ALLOW_PLAINTEXT=true" in message and "\n" not in message
    allowed = Settings.from_env(env | {"KODA_KAFKA_ALLOW_PLAINTEXT": "true"})
    assert allowed.kafka_security.protocol == protocol


def test_prod_takes_sasl_ssl_and_dev_takes_anything() -> None:
    secure = Settings.from_env(PROD | SASL | {"KODA_KAFKA_SECURITY_PROTOCOL": "SASL_SSL"})
    assert secure.app_env is AppEnv.PROD and not secure.kafka_allow_plaintext
    assert Settings.from_env({"APP_ENV": "dev"}).kafka_security.protocol == "PLAINTEXT"


@pytest.mark.parametrize("protocol", ["SASL_SSL", "SASL_PLAINTEXT"])
def test_sasl_without_its_user_password_or_mechanism_is_refused_by_name(protocol: str) -> None:
    for left_out in SASL:
        env = {"APP_ENV": "dev", "KODA_KAFKA_SECURITY_PROTOCOL": protocol} | SASL
        del env[left_out]
        with pytest.raises(ConfigError, match=f"={protocol} needs {left_out}$"):
            Settings.from_env(env)


def test_sasl_settings_without_a_sasl_protocol_are_refused() -> None:
    # Credentials set but the protocol forgotten would log in to nothing, in the clear.
    with pytest.raises(ConfigError, match="PROTOCOL=PLAINTEXT does not log in: use SASL_SSL"):
        Settings.from_env({"APP_ENV": "dev"} | SASL)


def test_an_unknown_mechanism_is_refused_with_the_choices() -> None:
    env = {"APP_ENV": "dev", "KODA_KAFKA_SECURITY_PROTOCOL": "SASL_SSL"} | SASL
    with pytest.raises(ConfigError, match="MECHANISM='GSSAPI': use one of SCRAM-SHA-512"):
        Settings.from_env(env | {"KODA_KAFKA_SASL_MECHANISM": "GSSAPI"})


def test_the_password_stays_out_of_repr_and_errors() -> None:
    env = {"APP_ENV": "dev", "KODA_KAFKA_SECURITY_PROTOCOL": "SASL_SSL"} | SASL
    settings = Settings.from_env(env)
    assert SASL["KODA_KAFKA_SASL_PASSWORD"] not in repr(settings)
    with pytest.raises(ConfigError) as refused:
        Settings.from_env(env | PROD | {"KODA_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT"})
    assert SASL["KODA_KAFKA_SASL_PASSWORD"] not in str(refused.value)


def test_a_client_certificate_reaches_librdkafka_and_needs_its_key(tmp_path: Path) -> None:
    cert, key = tmp_path / "client.pem", tmp_path / "client.key"
    with pytest.raises(ConfigError, match="CERTFILE and KODA_KAFKA_SSL_KEYFILE go together"):
        KafkaSecurity(protocol="SSL", ssl_certfile=str(cert))
    settings = Settings(
        app_env=AppEnv.DEV,
        kafka_security=KafkaSecurity(protocol="SSL", ssl_certfile=str(cert), ssl_keyfile=str(key)),
    )
    conf = common_config(settings)
    assert conf["ssl.certificate.location"] == str(cert)
    assert conf["ssl.key.location"] == str(key)
    # A file that is not there is named before any client tries it.
    with pytest.raises(ConfigError, match=f"KODA_KAFKA_SSL_CERTFILE={re.escape(str(cert))}: no"):
        require_files(settings)
    cert.write_text("x")
    key.write_text("x")
    require_files(settings)


class _Refusal:
    def __init__(self, code: int, text: str) -> None:
        self._code, self._text = code, text

    def code(self) -> int:
        return self._code

    def str(self) -> str:
        return self._text


def test_a_refused_login_or_handshake_is_one_line_naming_what_to_check() -> None:
    env = {"APP_ENV": "dev", "KODA_KAFKA_SECURITY_PROTOCOL": "SASL_SSL"} | SASL
    settings = Settings.from_env(env | {"KODA_KAFKA_BOOTSTRAP": "k1:9093"})
    login: Any = _Refusal(
        -169,
        "sasl_ssl://k1:9093/bootstrap: SASL authentication error: Authentication failed "
        "due to invalid credentials (after 310ms in state AUTH_REQ)",
    )
    line = _refusal_line(settings, login)
    assert line == (
        "Kafka at k1:9093 (SASL_SSL) refused the SCRAM-SHA-512 login of "
        "KODA_KAFKA_SASL_USERNAME='koda-gateway': SASL authentication error: Authentication "
        "failed due to invalid credentials; check KODA_KAFKA_SASL_USERNAME, "
        "KODA_KAFKA_SASL_PASSWORD and KODA_KAFKA_SASL_MECHANISM"
    )
    tls: Any = _Refusal(-181, "sasl_ssl://k1:9093/1: SSL handshake failed: verify failed")
    assert _refusal_line(settings, tls) == (
        "Kafka at k1:9093 (SASL_SSL) failed the TLS handshake: SSL handshake failed: verify "
        "failed; check KODA_KAFKA_SSL_CAFILE, KODA_KAFKA_SECURITY_PROTOCOL and the broker's "
        "listener"
    )


def _props(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if not line.startswith("#"))


def test_the_local_broker_gets_a_sasl_ssl_listener_beside_plaintext(tmp_path: Path) -> None:
    secure = SaslSslListener("/certs/broker.pem", "SCRAM-SHA-256")
    cluster = kafka_cluster.prepare_cluster(tmp_path, 1, "4.1.1", sasl_ssl=secure)
    (node,) = cluster.nodes
    assert node.sasl_ssl_port not in (None, node.port, node.controller_port)
    assert cluster.sasl_ssl_bootstrap == f"127.0.0.1:{node.sasl_ssl_port}"
    props = _props(kafka_cluster.render_server_properties(cluster, node, Path("/d")))
    assert f"SASL_SSL://127.0.0.1:{node.sasl_ssl_port}" in props["listeners"].split(",")
    assert f"SASL_SSL://127.0.0.1:{node.sasl_ssl_port}" in props["advertised.listeners"]
    assert "SASL_SSL:SASL_SSL" in props["listener.security.protocol.map"].split(",")
    assert props["inter.broker.listener.name"] == "PLAINTEXT"
    assert props["listener.name.sasl_ssl.ssl.keystore.location"] == "/certs/broker.pem"
    assert props["listener.name.sasl_ssl.sasl.enabled.mechanisms"] == "SCRAM-SHA-256"
    assert "ScramLoginModule" in props["listener.name.sasl_ssl.scram-sha-256.sasl.jaas.config"]
    # Remembered: a restart renders the same listener; another one is refused by name.
    assert kafka_cluster.prepare_cluster(tmp_path, 1, "4.1.1") == cluster
    with pytest.raises(Exception, match="SASL_SSL listener"):
        kafka_cluster.prepare_cluster(tmp_path, 1, "4.1.1", sasl_ssl=SaslSslListener("/x"))
    assert ClusterSpec.from_json(cluster.to_json()) == cluster


def test_a_cluster_without_the_listener_renders_as_before() -> None:
    cluster = kafka_cluster.new_cluster(1, "4.1.1")
    props = _props(kafka_cluster.render_server_properties(cluster, cluster.nodes[0], Path("/d")))
    assert "SASL_SSL" not in props["listeners"] and not any("sasl" in k for k in props)
    with pytest.raises(ConfigError, match="no SASL_SSL listener"):
        _ = cluster.sasl_ssl_bootstrap


def test_scram_users_and_mechanisms_are_checked() -> None:
    user = ScramUser("koda", "pw-1")
    assert user.add_scram("SCRAM-SHA-512") == "SCRAM-SHA-512=[name=koda,password=pw-1]"
    assert "pw-1" not in repr(user)
    with pytest.raises(ConfigError, match="free of"):
        ScramUser("koda", "a,b").add_scram("SCRAM-SHA-512")
    with pytest.raises(ConfigError, match="use one of SCRAM-SHA-256, SCRAM-SHA-512"):
        SaslSslListener("/k.pem", "PLAIN")
