"""A second terminal: `koda` commands find the local stack by its `.koda/services.env`,
and an address that does not answer fails in one line, fast.

The commands run as a user runs them (``python -m koda_runtime.cli`` in a directory of its own),
with no KODA_KAFKA_BOOTSTRAP, KODA_DATABASE_URL or APP_ENV in their environment. Only
KODA_NAMESPACE is set, so that the test's topics and schema are its own even when the
suite runs against a developer's `make dev` stack.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka import Producer

from koda_runtime.kafka import producer_config
from koda_runtime.localstack import StackInfo, env_lines
from koda_runtime.localstack.procs import free_port
from koda_runtime.settings import Settings
from koda_runtime.topics.catalogue import RUNS, RUNS_DLQ
from koda_runtime.topics.records.codec import (
    DEAD_LETTER,
    RUN_REQUESTED,
    dead_letter_value,
    headers_for,
)

# Well below librdkafka's 30 s metadata timeout, the failure this guards against; far
# above the probe's 3 s deadline so a loaded machine does not fail it.
FAST_FAILURE_S = 20.0


def bare_env(**extra: str) -> dict[str, str]:
    """This process's environment without any koda setting or APP_ENV."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KODA_") and k != "APP_ENV"}
    env.update(extra)
    return env


def koda(
    args: list[str], cwd: Path, env: dict[str, str]
) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    done = subprocess.run(  # noqa: S603 - our own executable
        [sys.executable, "-m", "koda_runtime.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return done, time.monotonic() - started


def write_services_env(root: Path, info: StackInfo) -> Path:
    path = root / ".koda" / "services.env"
    path.parent.mkdir(parents=True)
    path.write_text("\n".join(env_lines(info)) + "\n")
    return path


def test_dlq_list_and_db_upgrade_find_the_stack_from_a_subdirectory(
    env: Settings, stack: StackInfo, tmp_path: Path
) -> None:
    settings = env
    write_services_env(tmp_path, stack)
    terminal = tmp_path / "src" / "deeper"
    terminal.mkdir(parents=True)
    letter = dead_letter_value(
        key=b"alice",
        value=b"{}",
        headers=headers_for(RUN_REQUESTED),
        topic=settings.names.topic(RUNS),
        partition=0,
        offset=3,
        attempts=0,
        reason="unknown_run",
        error="test",
    )
    producer = Producer(producer_config(settings, "test"))
    producer.produce(
        settings.names.topic(RUNS_DLQ),
        key=b"alice",
        value=letter,
        headers=list(headers_for(DEAD_LETTER)),
    )
    assert producer.flush(30) == 0
    user_env = bare_env(KODA_NAMESPACE=settings.namespace or "")

    listed, _ = koda(["dlq", "list"], terminal, user_env)
    assert listed.returncode == 0, listed.stderr
    assert "unknown_run" in listed.stdout
    assert "1 dead letters" in listed.stdout
    assert "%3|" not in listed.stderr  # no librdkafka chatter

    upgraded, _ = koda(["db", "upgrade"], terminal, user_env)
    assert upgraded.returncode == 0, upgraded.stderr
    assert f"database schema {settings.names.pg_schema()} at head" in upgraded.stdout


def one_line_failure(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


def test_a_dead_broker_from_services_env_fails_in_one_line(tmp_path: Path) -> None:
    dead = free_port()
    path = write_services_env(
        tmp_path, StackInfo(f"127.0.0.1:{dead}", f"postgresql://koda@127.0.0.1:{dead}/koda", 1)
    )
    done, took = koda(["dlq", "list"], tmp_path, bare_env())
    line = one_line_failure(done)
    assert f"cannot reach Kafka at 127.0.0.1:{dead} (from {path.resolve()})" in line
    assert "connection refused" in line
    assert took < FAST_FAILURE_S

    done, took = koda(["db", "upgrade"], tmp_path, bare_env())
    line = one_line_failure(done)
    assert f"cannot reach PostgreSQL at 127.0.0.1:{dead} (from {path.resolve()})" in line
    assert took < FAST_FAILURE_S


def test_an_explicit_address_wins_over_services_env_and_is_named(
    stack: StackInfo, tmp_path: Path
) -> None:
    write_services_env(tmp_path, stack)
    dead = free_port()
    done, took = koda(
        ["db", "upgrade"],
        tmp_path,
        bare_env(KODA_DATABASE_URL=f"postgresql://koda:secret@127.0.0.1:{dead}/koda"),
    )
    line = one_line_failure(done)
    assert f"127.0.0.1:{dead} (from KODA_DATABASE_URL in the environment)" in line
    assert "secret" not in line
    assert took < FAST_FAILURE_S


@pytest.fixture
def not_kafka() -> Iterator[int]:
    """A port that accepts connections and answers like an HTTP server, not a broker."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            with conn:
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    thread.join()
    server.close()


def test_a_port_that_is_not_kafka_fails_in_one_line(not_kafka: int, tmp_path: Path) -> None:
    done, took = koda(
        ["topics", "check"],
        tmp_path,
        bare_env(APP_ENV="dev", KODA_KAFKA_BOOTSTRAP=f"127.0.0.1:{not_kafka}"),
    )
    line = one_line_failure(done)
    assert f"cannot reach Kafka at 127.0.0.1:{not_kafka}" in line
    assert "no Kafka broker answered" in line
    assert "%3|" not in done.stderr
    assert took < FAST_FAILURE_S


def test_without_services_env_app_env_is_still_required(tmp_path: Path) -> None:
    done, _ = koda(["dlq", "list"], tmp_path, bare_env())
    assert "APP_ENV is not set" in one_line_failure(done)
