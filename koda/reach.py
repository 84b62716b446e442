"""Checking, before a CLI command starts, that its broker or database answers at all.

Without it, a command pointed at a dead address says so only after librdkafka's
metadata timeout (30 s, with a connect-failure line every 50 ms on stderr) or
libpq's. Here a TCP connect with a deadline of a few seconds says why an address is
dead (refused, no answer, unknown host), and for Kafka a metadata request through a
silenced librdkafka client then proves a broker speaks there (a port that answers in
another protocol fails it); the error is one line naming the address tried and where
it came from (see ``Settings.origin``).

Long-running services (gateway, workers) do not call this: they ride out an outage.
"""

from __future__ import annotations

import socket
import time
from urllib.parse import parse_qs, urlsplit

from koda_runtime.errors import ServiceError
from koda_runtime.settings import Settings

PROBE_TIMEOUT_S = 3.0
_FIX = "start the local stack (`make dev` or `koda services up`) or point {key} at a running one"


def require_kafka(settings: Settings, *, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Raise ServiceError unless one of the bootstrap servers accepts a TCP connection."""
    key = "KODA_KAFKA_BOOTSTRAP"
    addresses = kafka_addresses(settings.kafka_bootstrap)
    if not addresses:
        raise ServiceError(f"{key} is empty ({settings.origin(key)}): set it to host:port")
    started = time.monotonic()
    error = _first_reachable(addresses, timeout_s)
    if error is None:
        error = _kafka_metadata(settings, max(1.0, timeout_s - (time.monotonic() - started)))
    if error is not None:
        raise ServiceError(
            f"cannot reach Kafka at {settings.kafka_bootstrap} (from {settings.origin(key)}): "
            f"{error}; {_FIX.format(key=key)}"
        )


def _kafka_metadata(settings: Settings, timeout_s: float) -> str | None:
    """None once a broker answers a metadata request, else why not. A broker that
    refuses the TLS handshake or the SASL login raises ConfigError saying so
    (:func:`koda_runtime.kafka.check_login`)."""
    from koda_runtime.kafka import check_login

    if check_login(settings, timeout_s):
        return None
    return f"no Kafka broker answered within {timeout_s:.0f}s (something else listens there?)"


def require_database(settings: Settings, *, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Raise ServiceError unless the database's host:port accepts a TCP connection.

    A Unix-socket or multi-host URL is left to libpq, which fails fast on those.
    """
    key = "KODA_DATABASE_URL"
    address = database_address(settings.database_url)
    if address is None:
        return
    error = _first_reachable([address], timeout_s)
    if error is not None:
        host, port = address
        raise ServiceError(
            f"cannot reach PostgreSQL at {_join(host, port)} (from {settings.origin(key)}): "
            f"{error}; {_FIX.format(key=key)}"
        )


def kafka_addresses(bootstrap: str) -> list[tuple[str, int]]:
    """``host:port`` pairs of a bootstrap list (``PROTOCOL://`` prefixes and IPv6 brackets
    allowed); ServiceError names an entry that is not one."""
    addresses = []
    for entry in filter(None, (e.strip() for e in bootstrap.split(","))):
        hostport = entry.split("://", 1)[-1]
        host, sep, port = hostport.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ServiceError(f"KODA_KAFKA_BOOTSTRAP entry {entry!r} is not host:port")
        addresses.append((host.strip("[]"), int(port)))
    return addresses


def database_address(url: str) -> tuple[str, int] | None:
    """The TCP host and port of a PostgreSQL URL, or None for a socket or multi-host URL."""
    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port or 5432
    except ValueError:  # "h1:5432,h2:5432" is not a port
        return None
    if not host or "host" in parse_qs(parts.query):
        return None
    return host, port


def _first_reachable(addresses: list[tuple[str, int]], timeout_s: float) -> str | None:
    """None once one address accepts a connection, else why the last one did not."""
    deadline = time.monotonic() + timeout_s
    error = "no address"
    for host, port in addresses:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return f"no answer within {timeout_s:g}s"
        try:
            with socket.create_connection((host, port), timeout=remaining):
                return None
        except TimeoutError:
            error = f"no answer within {timeout_s:g}s"
        except socket.gaierror as exc:
            error = f"cannot resolve {host} ({exc.strerror})"
        except OSError as exc:
            error = (exc.strerror or str(exc)).lower()
    return error


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
