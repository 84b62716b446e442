"""Kafka through SASL_SSL, against a real broker of the test's own.

The test makes a CA and a broker certificate (openssl), starts a one-node cluster with
the local stack's starter and a SASL_SSL listener (SCRAM-SHA-512, its user created when
the storage is formatted), and points koda at that listener alone. Then the CLI, a
worker and the gateway log in through it and a run reaches ``done``; a wrong password
or a CA that does not know the broker stops each of them in seconds with one line.
Postgres is the shared test stack's.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from koda_runtime.kafka import check_login
from koda_runtime.localstack import StackInfo, kafka
from koda_runtime.localstack.kafka_cluster import SaslSslListener, ScramUser
from koda_runtime.schemas.migrate import upgrade
from koda_runtime.settings import KafkaSecurity, Settings
from tests.fixtures.namespaces import drop_schema, make_settings
from tests.fixtures.processes import GatewayProcess, WorkerProcess, koda_argv, settings_env
from tests.support import wait_until

USER = "koda-app"
# Long enough that a command hanging on the broker shows as a failure, far above the
# few seconds a refused login takes.
REFUSAL_BOUND_S = 30


@dataclass(frozen=True)
class SecureBroker:
    bootstrap: str  # the SASL_SSL listener only
    ca_file: Path
    password: str


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)  # noqa: S603, S607


def make_certificates(directory: Path) -> tuple[Path, Path]:
    """A CA, and a keystore for the broker on 127.0.0.1 that it signed: (CA file, keystore)."""
    _openssl(
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
        "-keyout", "ca.key", "-out", "ca.pem", "-subj", "/CN=koda test CA",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        cwd=directory,
    )  # fmt: skip
    _openssl(
        "req", "-newkey", "rsa:2048", "-nodes", "-keyout", "broker.key",
        "-out", "broker.csr", "-subj", "/CN=127.0.0.1",
        cwd=directory,
    )  # fmt: skip
    (directory / "broker.ext").write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n"
    )
    _openssl(
        "x509", "-req", "-in", "broker.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
        "-CAcreateserial", "-days", "2", "-extfile", "broker.ext", "-out", "broker.pem",
        cwd=directory,
    )  # fmt: skip
    # Kafka's PEM keystore: the PKCS#8 key (openssl's default), then the chain.
    keystore = directory / "broker-keystore.pem"
    keystore.write_text(
        "".join((directory / name).read_text() for name in ("broker.key", "broker.pem", "ca.pem"))
    )
    return directory / "ca.pem", keystore


@pytest.fixture(scope="module")
def secure_broker() -> Iterator[SecureBroker]:
    root = Path(tempfile.mkdtemp(prefix="koda-sasl-ssl-", dir="/tmp"))
    state_dir = root / "state"
    try:
        ca_file, keystore = make_certificates(root)
        password = uuid.uuid4().hex
        cluster = kafka.start_cluster(
            state_dir,
            1,
            sasl_ssl=SaslSslListener(str(keystore), "SCRAM-SHA-512"),
            scram_users=[ScramUser(USER, password)],
        )
        kafka.wait_ready(state_dir, cluster)
        yield SecureBroker(cluster.sasl_ssl_bootstrap, ca_file, password)
    finally:
        try:
            kafka.stop_cluster(state_dir)
        finally:
            shutil.rmtree(root, ignore_errors=True)


def secure_settings(
    stack: StackInfo, broker: SecureBroker, *, password: str | None = None, ca: Path | None = None
) -> Settings:
    security = KafkaSecurity(
        protocol="SASL_SSL",
        sasl_mechanism="SCRAM-SHA-512",
        sasl_username=USER,
        sasl_password=password or broker.password,
        ssl_cafile=str(ca or broker.ca_file),
    )
    return make_settings(
        stack,
        kafka_bootstrap=broker.bootstrap,
        kafka_security=security,
        kafka_allow_plaintext=False,
    )


def koda(settings: Settings, *argv: str) -> subprocess.CompletedProcess[str]:
    """``koda <argv>`` as a child process on ``settings``; fails the test if it hangs."""
    command = koda_argv(argv[0]) + list(argv[1:])
    return subprocess.run(  # noqa: S603
        command,
        env=settings_env(settings),
        capture_output=True,
        text=True,
        timeout=REFUSAL_BOUND_S,
    )


def test_the_cli_a_worker_and_the_gateway_run_a_run_through_sasl_ssl(
    stack: StackInfo, secure_broker: SecureBroker
) -> None:
    settings = secure_settings(stack, secure_broker)
    assert check_login(settings, timeout_s=10)
    upgrade(settings)
    worker: WorkerProcess | None = None
    gateway: GatewayProcess | None = None
    try:
        applied = koda(settings, "topics", "apply")
        assert applied.returncode == 0, applied.stderr
        checked = koda(settings, "topics", "check")
        assert checked.returncode == 0, checked.stderr
        worker = WorkerProcess(settings, "sasl-worker").start()
        gateway = GatewayProcess(settings).start()
        auth = {"Authorization": "Bearer dev:sasl-user"}
        body = {"input": {"text": "through TLS", "demo": {"tokens": 3, "delay_ms": 1}}}
        accepted = httpx.post(f"{gateway.url}/v1/runs", json=body, headers=auth, timeout=10)
        assert accepted.status_code == 202, accepted.text
        run_id = accepted.json()["run_id"]

        def finished() -> dict[str, object] | None:
            worker.check()
            detail = httpx.get(f"{gateway.url}/v1/runs/{run_id}", headers=auth, timeout=5).json()
            return detail if detail["status"] in ("done", "failed", "cancelled") else None

        detail = wait_until(finished, timeout=60, interval=0.2, what="the run finished")
        assert detail["status"] == "done" and detail["output"], detail
        for proc in (worker, gateway):
            assert secure_broker.password not in proc.log()
    finally:
        for child in (gateway, worker):
            if child is not None and child.alive():
                child.stop()
        drop_schema(settings)


def refusal_line(result: subprocess.CompletedProcess[str]) -> str:
    """The one line a refused command printed (it exits 2 and says nothing else on stderr)."""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, result.stderr[-3000:]
    assert len(lines) == 1, result.stderr[-3000:]
    return lines[0]


@pytest.mark.parametrize(
    "command", [["topics", "check"], ["worker"], ["gateway"]], ids=["cli", "worker", "gateway"]
)
def test_a_wrong_password_stops_each_process_in_seconds_with_one_line(
    stack: StackInfo, secure_broker: SecureBroker, command: list[str]
) -> None:
    wrong = "not-" + secure_broker.password
    line = refusal_line(koda(secure_settings(stack, secure_broker, password=wrong), *command))
    assert line.startswith(f"koda: Kafka at {secure_broker.bootstrap} (SASL_SSL) refused"), line
    assert f"SCRAM-SHA-512 login of KODA_KAFKA_SASL_USERNAME='{USER}'" in line
    assert "invalid credentials" in line and "KODA_KAFKA_SASL_PASSWORD" in line
    assert wrong not in line and secure_broker.password not in line


def test_a_ca_that_does_not_know_the_broker_stops_the_cli_with_one_line(
    stack: StackInfo, secure_broker: SecureBroker, tmp_path: Path
) -> None:
    other_ca, _ = make_certificates(tmp_path)
    line = refusal_line(koda(secure_settings(stack, secure_broker, ca=other_ca), "topics", "check"))
    assert "failed the TLS handshake" in line and "certificate verify failed" in line, line
    assert "KODA_KAFKA_SSL_CAFILE" in line
