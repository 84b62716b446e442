"""Bad input from outside: each case ends in a clear error or a dead letter, nothing is
lost and no process dies.

* Gateway: schemathesis generates requests for every operation in ``/openapi.json``
  (a bounded number each) and no answer may be a 5xx; then raw-socket requests HTTP
  clients would not send (non-ASCII header bytes, an over-long header line, a body
  shorter than its Content-Length, broken chunked framing). The gateway stays healthy
  and writes nothing for them. (Refusals of bodies, content types, tokens and
  Idempotency-Key values are in test_gateway.py.)
* Topics: records written by outside clients, Debian's ``kcat`` and raw
  confluent-kafka, that are garbage, of an unknown schema or version, without key or
  value, oversized, for an unknown run or the wrong user. Each becomes one dead letter
  with its reason; real runs before and after them are done; the worker never restarts.
  (test_worker.py has the first raw confluent-kafka set; these are the rest.)
"""

from __future__ import annotations

import base64
import json
import shutil
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from confluent_kafka import Producer
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from schemathesis.checks import not_a_server_error
from schemathesis.core.result import Ok

from koda_runtime.kafka import producer_config
from koda_runtime.schemas.migrate import upgrade
from koda_runtime.settings import Settings
from koda_runtime.topics.admin import apply_topics
from koda_runtime.topics.catalogue import RUNS, RUNS_DLQ
from koda_runtime.topics.records.codec import RUN_REQUESTED, RunRequested, headers_for
from tests.fixtures.namespaces import delete_topics, drop_schema, make_settings
from tests.fixtures.processes import GatewayProcess, WorkerProcess
from tests.fixtures.runs import Submitter, read_topic
from tests.support import wait_until

FUZZ_USER = "fuzz-" + uuid.uuid4().hex[:6]


@pytest.fixture(scope="module")
def gateway(stack) -> Iterator[tuple[Settings, GatewayProcess]]:
    settings = make_settings(stack)
    upgrade(settings)
    apply_topics(settings)
    gw = GatewayProcess(settings, {"KODA_RATE_PER_S": "100000", "KODA_RATE_BURST": "100000"})
    gw.start()
    yield settings, gw
    gw.stop()
    delete_topics(settings)
    drop_schema(settings)


def test_generated_requests_never_get_a_5xx(gateway: tuple[Settings, GatewayProcess]) -> None:
    """Every operation of /openapi.json, 40 generated requests each (positive and
    negative data), authenticated so bodies reach validation and the database."""
    _, gw = gateway
    schema = schemathesis.openapi.from_url(f"{gw.url}/openapi.json")
    labels: list[str] = []
    failures: list[str] = []
    for result in schema.get_all_operations():
        assert isinstance(result, Ok), f"the schema has an operation it cannot load: {result}"
        operation = result.ok()
        labels.append(operation.label)

        @given(case=operation.as_strategy())
        @hypothesis_settings(
            max_examples=40,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            database=None,
            derandomize=True,
        )
        def one(case: Any) -> None:
            case.call_and_validate(
                base_url=gw.url,
                headers={"Authorization": f"Bearer dev:{FUZZ_USER}"},
                checks=[not_a_server_error],
                timeout=15,
            )

        try:
            one()
        except Exception as exc:  # noqa: BLE001 - collect every operation's failure
            failures.append(f"{operation.label}: {exc}")
    assert "POST /v1/runs" in labels and "GET /v1/runs/{run_id}/events" in labels, labels
    assert not failures, "\n\n".join(failures)


def raw_exchange(url: str, request: bytes, *, half_close: bool = False) -> bytes:
    """Send ``request`` bytes as they are; return what the server answered (maybe b"")."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=15) as s:
        s.sendall(request)
        if half_close:
            s.shutdown(socket.SHUT_WR)
        response = b""
        try:
            while chunk := s.recv(65536):
                response += chunk
        except (TimeoutError, ConnectionResetError):
            pass
    return response


def post(headers: bytes, body: bytes, extra: bytes = b"") -> bytes:
    return (
        b"POST /v1/runs HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
        + headers
        + extra
        + b"Connection: close\r\n\r\n"
        + body
    )


AUTH = b"Authorization: Bearer dev:raw-user\r\n"
BODY = b'{"input": "raw"}'
LENGTH = b"Content-Length: %d\r\n" % len(BODY)

RAW: list[tuple[str, bytes, bool]] = [
    (
        "latin-1 byte in the token",
        post(b"Authorization: Bearer dev:caf\xe9\r\n" + LENGTH, BODY),
        False,
    ),
    (
        "utf-8 in Idempotency-Key",
        post(AUTH + LENGTH + "Idempotency-Key: clé\r\n".encode(), BODY),
        False,
    ),
    ("NUL in Idempotency-Key", post(AUTH + LENGTH + b"Idempotency-Key: a\x00b\r\n", BODY), False),
    ("body shorter than Content-Length", post(AUTH + b"Content-Length: 500\r\n", BODY), True),
    (
        "broken chunked framing",
        post(AUTH + b"Transfer-Encoding: chunked\r\n", b"zz\r\n" + BODY + b"\r\n0\r\n\r\n"),
        True,
    ),
    (
        "both Content-Length and chunked",
        post(
            AUTH + LENGTH + b"Transfer-Encoding: chunked\r\n", b"10\r\n" + BODY + b"\r\n0\r\n\r\n"
        ),
        True,
    ),
    (
        "10,000-character run id",
        b"GET /v1/runs/"
        + b"r" * 10_000
        + b" HTTP/1.1\r\nHost: gw\r\n"
        + AUTH
        + b"Connection: close\r\n\r\n",
        False,
    ),
    (
        "NUL in the run id",
        b"GET /v1/runs/a%00b HTTP/1.1\r\nHost: gw\r\n" + AUTH + b"Connection: close\r\n\r\n",
        False,
    ),
    (
        "NUL in the run id of the event stream",
        b"GET /v1/runs/a%00b/events HTTP/1.1\r\nHost: gw\r\n" + AUTH + b"Connection: close\r\n\r\n",
        False,
    ),
    (
        "garbage request line",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03 not http\r\n\r\n",
        True,
    ),
]


@pytest.mark.parametrize(
    ("request_bytes", "half_close"), [pytest.param(r, h, id=name) for name, r, h in RAW]
)
def test_raw_requests_get_a_clear_4xx_or_a_closed_connection(
    gateway: tuple[Settings, GatewayProcess], request_bytes: bytes, half_close: bool
) -> None:
    settings, gw = gateway
    sub = Submitter(settings)
    try:
        before = sub.query("SELECT count(*) AS n FROM runs WHERE user_id = 'raw-user'")[0].n
        response = raw_exchange(gw.url, request_bytes, half_close=half_close)
        if response:
            status = int(response.split(b" ", 2)[1])
            assert 400 <= status < 500, response[:300]
        after = sub.query("SELECT count(*) AS n FROM runs WHERE user_id = 'raw-user'")[0].n
        assert after == before
    finally:
        sub.close()


def test_an_irrelevant_100_kib_header_is_not_a_crash(
    gateway: tuple[Settings, GatewayProcess],
) -> None:
    """The server may refuse it (431) or ignore it (202): anything but a 5xx."""
    _, gw = gateway
    big = post(AUTH + LENGTH + b"X-Big: " + b"a" * 100_000 + b"\r\n", BODY)
    response = raw_exchange(gw.url, big)
    assert int(response.split(b" ", 2)[1]) in (202, 400, 431), response[:300]


def test_the_gateway_is_healthy_after_the_corpus(gateway: tuple[Settings, GatewayProcess]) -> None:
    settings, gw = gateway
    assert gw.proc is not None and gw.proc.poll() is None
    assert httpx.get(f"{gw.url}/livez").status_code == 200
    assert httpx.get(f"{gw.url}/readyz", timeout=10).status_code == 200
    ok = httpx.post(
        f"{gw.url}/v1/runs",
        headers={"Authorization": "Bearer dev:after-fuzz"},
        json={"input": "still works"},
    )
    assert ok.status_code == 202, ok.text
    assert "Traceback" not in gw.log(), gw.log()[-4000:]
    metrics = httpx.get(f"{gw.url}/metrics").text
    assert 'status="500"' not in metrics and 'status="503"' not in metrics


# --- records from outside clients ---------------------------------------------------


def kcat(env: Settings, *args: str, value: bytes | None, key: str | None = None) -> None:
    """Produce one record with Debian's kcat; ``value`` None sends a tombstone."""
    exe = shutil.which("kcat")
    assert exe, "kcat is missing: run deploy/local/system-deps.sh (make test installs it)"
    argv = [exe, "-P", "-b", env.kafka_bootstrap, "-t", env.names.topic(RUNS), *args]
    if value is None:
        # "<key>:" with an empty value, which -Z sends as NULL (a tombstone).
        assert key is not None
        done = subprocess.run(  # noqa: S603
            [*argv, "-K", ":", "-Z"],
            input=f"{key}:\n".encode(),
            capture_output=True,
            timeout=60,
            check=False,
        )
    else:
        with tempfile.NamedTemporaryFile(suffix=".bin") as f:
            f.write(value)
            f.flush()
            key_args = ["-k", key] if key is not None else []
            done = subprocess.run(  # noqa: S603
                [*argv, *key_args, f.name], capture_output=True, timeout=60, check=False
            )
    assert done.returncode == 0, done.stderr.decode()


def test_records_from_kcat_and_raw_clients_become_dead_letters(env: Settings) -> None:
    sub = Submitter(env)
    worker = WorkerProcess(env, "corpus").start()
    user = "corpus-user"
    try:
        before = sub.submit(user, {"text": "before", "demo": {"tokens": 2, "delay_ms": 1}})
        real = sub.submit(
            user, {"text": "zstd trigger", "demo": {"tokens": 3, "delay_ms": 1}}, publish=False
        )
        valid = json.dumps({"run_id": "nope", "user_id": user, "session_id": "s"}).encode()
        # Debian's kcat: garbage, unknown schema version, no key, a tombstone, oversized.
        garbage = b"\x00\xff\xfe not a record \x01" + bytes(range(256))
        kcat(env, key=user, value=garbage)
        kcat(env, "-H", "schema=run.requested/9", key=user, value=valid)
        kcat(env, value=valid)
        kcat(env, key=user, value=None)
        kcat(env, key=user, value=b"[" * (300 * 1024))
        # Raw confluent-kafka: another schema, an unknown run, the wrong user's key, a
        # JSON array; and a zstd-compressed trigger of a real run, which must simply run.
        raw = Producer(producer_config(env, "corpus") | {"compression.type": "zstd"})
        topic = env.names.topic(RUNS)
        raw.produce(topic, key=user.encode(), value=valid, headers=[("schema", b"run.chunk/1")])
        raw.produce(topic, key=user.encode(), value=valid, headers=list(headers_for(RUN_REQUESTED)))
        other = RunRequested(real, "someone-else", f"s-{user}", "").encode()
        raw.produce(topic, key=user.encode(), value=other)
        raw.produce(topic, key=user.encode(), value=b"[1, 2, 3]")
        raw.produce(
            topic,
            key=user.encode(),
            value=RunRequested(real, user, f"s-{user}", "").encode(),
            headers=list(headers_for(RUN_REQUESTED)),
        )
        assert raw.flush(30) == 0
        after = sub.submit(user, {"text": "after", "demo": {"tokens": 2, "delay_ms": 1}})
        wait_until(
            lambda: sub.all_terminal([before, real, after]),
            timeout=60,
            what="real runs around the poison done",
        )
        assert set(sub.statuses([before, real, after]).values()) == {"done"}
        expected = sorted(
            [
                "undecodable",
                "unknown_schema_version",
                "null_key",
                "null_value",
                "oversized",
                "unknown_schema",
                "unknown_run",
                "key_mismatch",
                "invalid",
            ]
        )
        dlq = env.names.topic(RUNS_DLQ)
        letters: list[Any] = []

        def arrived() -> bool:
            letters[:] = read_topic(env, dlq)
            return len(letters) >= len(expected)

        try:
            wait_until(arrived, timeout=30, what="dead letters")
        except AssertionError:
            got = sorted(json.loads(m.value())["reason"] for m in letters)
            raise AssertionError(
                f"dead letters {got}, expected {expected}\n{worker.log()[-3000:]}"
            ) from None
        reasons = sorted(json.loads(m.value())["reason"] for m in letters)
        assert reasons == expected
        for m in letters:
            letter = json.loads(m.value())
            assert letter["topic"] == topic and letter["error"] and letter["offset"] >= 0
            if letter["reason"] == "undecodable":  # the original bytes, replayable
                assert base64.b64decode(letter["original_value"]) == garbage
                assert base64.b64decode(letter["original_key"]) == user.encode()
        log = worker.log()
        assert worker.alive(), log[-3000:]
        for bad in ("Restarting", "MaxRestartsExceeded", "Crashed", "Traceback"):
            assert bad not in log, log[-3000:]
    finally:
        worker.stop()
        sub.close()
