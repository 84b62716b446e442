"""Client configurations for librdkafka (every koda client) and aiokafka (Faust), in
one place, from :class:`~koda_runtime.settings.Settings`.

The clients themselves live in topics/kafka/ (the tail, the bounded reader, the offsets
reader); this module stays in the core because the reach probe (koda/reach.py) builds
a consumer too. No client creates topics: ``koda topics apply`` owns them, and a record
for a missing topic must fail instead of creating a one-partition topic that breaks
per-user order.

Every koda client produces with librdkafka except the workers' Faust producer
(aiokafka); both must put a key into the same partition. librdkafka's default
partitioner (consistent_random, CRC32) disagrees with Java and aiokafka (murmur2), so
the producer here is pinned to ``murmur2_random``.

Security (TLS, SASL) comes from ``Settings.kafka_security`` alone: :func:`common_config`
gives it to every librdkafka client, :func:`aiokafka_security` to aiokafka (Faust).
:func:`check_login` tells a refused TLS handshake or SASL login (a configuration error:
one line, at start) from a broker that does not answer (an outage, ridden out).
"""

from __future__ import annotations

import logging
import os
import re
import ssl
import time
from typing import Any

from koda_runtime.errors import ConfigError
from koda_runtime.settings import Settings

log = logging.getLogger(__name__)

PARTITIONER = "murmur2_random"
# A client that has reached no broker of its last known metadata for this long goes back
# to bootstrap.servers (KIP-899/1102; librdkafka's default is 300 s). After a restart of
# the only broker, a client can be left knowing no broker it will use: in a chaos run two
# workers' runs consumers went silent for minutes while new clients connected at once.
REBOOTSTRAP_AFTER_MS = 10_000


def common_config(settings: Settings) -> dict[str, Any]:
    """What every librdkafka client of koda's is given: the brokers, TLS/SASL, and the
    rebootstrap bound (:data:`REBOOTSTRAP_AFTER_MS`)."""
    return {
        "bootstrap.servers": settings.kafka_bootstrap,
        "metadata.recovery.strategy": "rebootstrap",
        "metadata.recovery.rebootstrap.trigger.ms": REBOOTSTRAP_AFTER_MS,
        **settings.kafka_security.librdkafka(),
    }


def producer_config(settings: Settings, role: str) -> dict[str, Any]:
    """An idempotent librdkafka producer (acks=all) that partitions like Java."""
    return {
        **common_config(settings),
        "client.id": settings.names.client_id(role, _instance(settings)),
        "enable.idempotence": True,
        "acks": "all",
        "partitioner": PARTITIONER,
        "linger.ms": 2,
        "compression.type": "lz4",
        "message.timeout.ms": int(settings.publish_timeout_s * 1000),
        "socket.keepalive.enable": True,
        "allow.auto.create.topics": False,
    }


def consumer_config(settings: Settings, role: str, group: str | None) -> dict[str, Any]:
    """A librdkafka consumer; manual commits only (``enable.auto.commit`` off)."""
    conf: dict[str, Any] = {
        **common_config(settings),
        "client.id": settings.names.client_id(role, _instance(settings)),
        "enable.auto.commit": False,
        "auto.offset.reset": "earliest",
        "allow.auto.create.topics": False,
    }
    if group is not None:
        conf["group.id"] = group
    return conf


def runs_consumer_config(settings: Settings, group: str) -> dict[str, Any]:
    """The worker's member of ``group`` on the runs topic (topics/kafka/intake.py).

    Offsets are stored and committed by koda only (after the work). With the ``consumer``
    protocol (KIP-848) the session timeout and heartbeat interval are the group's, set
    on the broker (:func:`group_config`), and ``max.poll.interval.ms`` bounds how long a
    revoke may take; with ``classic`` they are the member's own and the assignor is
    ``cooperative-sticky``.
    """
    conf = consumer_config(settings, "worker", group) | {
        "group.protocol": settings.group_protocol,
        "enable.auto.offset.store": False,
        "enable.partition.eof": False,
        "fetch.wait.max.ms": 100,
        "queued.max.messages.kbytes": 16 * 1024,
        "max.poll.interval.ms": int(settings.rebalance_timeout_s * 1000),
        "topic.metadata.refresh.interval.ms": 30_000,
    }
    if settings.group_protocol == "classic":
        conf |= {
            "partition.assignment.strategy": "cooperative-sticky",
            "session.timeout.ms": int(settings.session_timeout_s * 1000),
            "heartbeat.interval.ms": int(settings.heartbeat_interval_s * 1000),
        }
    instance_id = settings.group_instance_id()
    if instance_id is not None:
        conf["group.instance.id"] = instance_id
    return conf


def group_config(settings: Settings) -> dict[str, str]:
    """The workers' group's own configuration under the ``consumer`` protocol (KIP-848),
    where the broker, not the member, owns the session timeout and heartbeat interval."""
    return {
        "consumer.session.timeout.ms": str(int(settings.session_timeout_s * 1000)),
        "consumer.heartbeat.interval.ms": str(int(settings.heartbeat_interval_s * 1000)),
    }


def ssl_context(settings: Settings) -> ssl.SSLContext | None:
    """A verifying TLS context (``KODA_KAFKA_SSL_CAFILE`` or the system's CAs, and the
    client certificate of ``KODA_KAFKA_SSL_CERTFILE``/``KEYFILE`` if set) when the
    protocol is SSL or SASL_SSL; None otherwise. aiokafka needs it to speak TLS at all."""
    sec = settings.kafka_security
    if sec.protocol not in ("SSL", "SASL_SSL"):
        return None
    require_files(settings)
    context = ssl.create_default_context(cafile=sec.ssl_cafile)
    if sec.ssl_certfile:
        context.load_cert_chain(sec.ssl_certfile, sec.ssl_keyfile)
    return context


def aiokafka_security(settings: Settings) -> dict[str, Any]:
    """The same security settings in aiokafka's keyword form."""
    sec = settings.kafka_security
    kw: dict[str, Any] = {"security_protocol": sec.protocol}
    context = ssl_context(settings)
    if context is not None:
        kw["ssl_context"] = context
    if sec.sasl_mechanism:
        kw["sasl_mechanism"] = sec.sasl_mechanism
    if sec.sasl_username is not None:
        kw["sasl_plain_username"] = sec.sasl_username
    if sec.sasl_password is not None:
        kw["sasl_plain_password"] = sec.sasl_password
    return kw


# How long a starting service waits for a broker's answer to its TLS handshake and login.
LOGIN_CHECK_S = 10.0
_REFUSALS = {-169: "login", -181: "TLS"}  # librdkafka's _AUTHENTICATION and _SSL
_NOISE = re.compile(r"^\S+://\S+/(?:bootstrap|\d+): |\s*\(after \d+ms in state \w+\)$")


class _Quiet(logging.Logger):
    """Swallows librdkafka's own log lines (a failure every few hundred ms) during a check."""

    def __init__(self) -> None:
        super().__init__("koda_runtime.kafka.librdkafka", logging.CRITICAL + 1)


def check_login(settings: Settings, timeout_s: float = LOGIN_CHECK_S) -> bool:
    """True once a broker answers a metadata request through koda's security settings;
    False if none answered within ``timeout_s`` (an outage: the caller decides).

    Raises ConfigError, in one line, as soon as a broker refuses the TLS handshake (the
    CA, the certificate, or a TLS client against a plaintext port) or the SASL login
    (user, password or mechanism): librdkafka would retry those for ever, a line every
    few hundred milliseconds, and a service would look alive but never work. The
    password is never in the message.
    """
    from confluent_kafka import KafkaError, KafkaException
    from confluent_kafka.admin import AdminClient

    require_files(settings)
    refusals: list[KafkaError] = []

    def on_error(err: KafkaError) -> None:
        if err.code() in _REFUSALS:
            refusals.append(err)

    conf = common_config(settings) | {
        "client.id": settings.names.client_id("login-check", _instance(settings)),
        "error_cb": on_error,
        "logger": _Quiet(),
    }
    admin = AdminClient(conf)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            admin.list_topics(timeout=min(0.5, max(0.05, deadline - time.monotonic())))
        except KafkaException:
            admin.poll(0)  # serves error_cb
        else:
            return True
        if refusals:
            raise ConfigError(_refusal_line(settings, refusals[0]))
        if time.monotonic() >= deadline:
            return False


def require_login(settings: Settings, timeout_s: float = LOGIN_CHECK_S) -> None:
    """At a service's start: ConfigError if the brokers refuse koda's TLS handshake or
    SASL login (:func:`check_login`); a broker that does not answer is logged and
    ridden out, as every service rides out an outage. Nothing to check with PLAINTEXT."""
    if settings.kafka_security.protocol == "PLAINTEXT":
        return
    if not check_login(settings, timeout_s):
        log.warning(
            "event=kafka_login_unchecked bootstrap=%s waited_s=%.0f: no broker answered; going on",
            settings.kafka_bootstrap,
            timeout_s,
        )


def require_files(settings: Settings) -> None:
    """ConfigError naming the first TLS file setting whose file cannot be read."""
    sec = settings.kafka_security
    for key, path in (
        ("KODA_KAFKA_SSL_CAFILE", sec.ssl_cafile),
        ("KODA_KAFKA_SSL_CERTFILE", sec.ssl_certfile),
        ("KODA_KAFKA_SSL_KEYFILE", sec.ssl_keyfile),
    ):
        if path and not (os.path.isfile(path) and os.access(path, os.R_OK)):
            raise ConfigError(f"{key}={path}: no such readable file")


def _refusal_line(settings: Settings, err: Any) -> str:
    sec = settings.kafka_security
    reason = _NOISE.sub("", err.str()).strip()
    where = f"Kafka at {settings.kafka_bootstrap} ({sec.protocol})"
    if _REFUSALS[err.code()] == "login":
        return (
            f"{where} refused the {sec.sasl_mechanism} login of KODA_KAFKA_SASL_USERNAME="
            f"{sec.sasl_username!r}: {reason}; check KODA_KAFKA_SASL_USERNAME, "
            "KODA_KAFKA_SASL_PASSWORD and KODA_KAFKA_SASL_MECHANISM"
        )
    return (
        f"{where} failed the TLS handshake: {reason}; check KODA_KAFKA_SSL_CAFILE, "
        "KODA_KAFKA_SECURITY_PROTOCOL and the broker's listener"
    )


def _instance(settings: Settings) -> str:
    cleaned = "".join(c if c.isalnum() or c in "-_" else "-" for c in settings.worker_id.lower())
    return cleaned.strip("-_")[:40] or "local"
