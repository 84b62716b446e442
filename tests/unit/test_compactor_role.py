"""The compactor as a long-running role: its rounds, gauges, probes and command line.

Pure code: the compactor's engine and producer are never used here (its passes are
replaced), the health server is real on a free port. The real loop against Kafka and
Postgres is tests/integration/test_compactor_role.py.
"""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from confluent_kafka import KafkaException
from sqlalchemy.exc import OperationalError
from typer.testing import CliRunner

from koda_runtime import cli, metrics
from koda_runtime.cli import chunks as cli_chunks
from koda_runtime.naming import AppEnv
from koda_runtime.processors import compactor as compactor_module
from koda_runtime.processors.compactor import (
    STALL_AFTER_S,
    ChunkCompactor,
    CompactionError,
    CompactionReport,
    RepairReport,
    serve_health,
)
from koda_runtime.settings import Settings

SETTINGS = Settings(app_env=AppEnv.DEV, namespace="unit")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def compactor() -> ChunkCompactor:
    built = ChunkCompactor(SETTINGS, engine=object(), producer=object())  # type: ignore[arg-type]
    built.clock = Clock()
    built.last_progress = built.clock()
    return built


@pytest.fixture
def served(compactor: ChunkCompactor) -> Iterator[str]:
    server = serve_health(compactor, 0, "127.0.0.1")
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:  # noqa: S310 - our server
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def rounds(compactor: ChunkCompactor, outcomes: list[Exception | None]) -> None:
    """Run the loop for ``len(outcomes)`` rounds, each raising its outcome (or not)."""
    left = list(outcomes)

    def repair_once(older_than_s: float | None = None, batch: int = 200) -> RepairReport:
        outcome = left.pop(0)
        if outcome is not None:
            raise outcome
        return RepairReport(0, 0)

    def compact_once(older_than_s: float | None = None, batch: int = 100) -> CompactionReport:
        return CompactionReport(0, 0)

    compactor.repair_once = repair_once  # type: ignore[method-assign]
    compactor.compact_once = compact_once  # type: ignore[method-assign]
    compactor.run_forever(0.001, should_stop=lambda: not left)


def test_a_round_sets_the_gauges_and_readiness_follows_the_last_round(
    compactor: ChunkCompactor,
) -> None:
    metrics.CHUNK_UPKEEP_LAST_PASS.set(0)
    assert compactor.ready() == (False, {"rounds": 0, "reason": "no round has completed yet"})
    rounds(compactor, [CompactionError("the broker said no")])
    ok, detail = compactor.ready()
    assert not ok
    assert detail["reason"] == "the last round failed: kafka: CompactionError: the broker said no"
    assert metrics.REGISTRY.get_sample_value(
        "koda_chunk_upkeep_last_pass_timestamp_seconds"
    ) == pytest.approx(0)
    rounds(compactor, [None])
    assert compactor.ready() == (True, {"rounds": 1})
    last_pass = metrics.REGISTRY.get_sample_value("koda_chunk_upkeep_last_pass_timestamp_seconds")
    assert last_pass is not None and last_pass > 0
    assert metrics.REGISTRY.get_sample_value("koda_chunk_upkeep_interval_seconds") == 0.001
    # A later failure takes readiness away again; the last completed round stays.
    rounds(compactor, [CompactionError("again")])
    assert compactor.ready()[0] is False and compactor.rounds == 1


def failures(cause: str) -> float:
    value = metrics.REGISTRY.get_sample_value("koda_chunk_upkeep_failures_total", {"cause": cause})
    return value or 0.0


def test_a_round_that_meets_any_error_is_counted_by_cause_and_the_loop_goes_on(
    compactor: ChunkCompactor, caplog: pytest.LogCaptureFixture
) -> None:
    """The role's failure mode: before, only KodaError was caught, so Postgres away
    (an OperationalError) ended the process."""
    statement = "SELECT id FROM runs WHERE user_id = %(secret_user)s"
    pg_down = OperationalError(
        statement,
        {"secret_user": "alice-private"},
        psycopg.OperationalError("connection failed: Connection refused\nIs the server up?"),
    )
    before = {c: failures(c) for c in ("postgres", "kafka", "other")}
    caplog.set_level(logging.INFO, logger=compactor_module.__name__)
    rounds(compactor, [pg_down, CompactionError("no broker"), RuntimeError("a bug"), None])
    assert {c: failures(c) - before[c] for c in before} == {
        "postgres": 1,
        "kafka": 1,
        "other": 1,
    }
    assert compactor.ready() == (True, {"rounds": 1})
    text = caplog.text
    assert "event=chunk_upkeep_failed cause=postgres failures=1" in text
    assert "OperationalError: connection failed: Connection refused" in text
    assert "event=chunk_upkeep_failed cause=other failures=3" in text
    assert "event=chunk_upkeep_resumed after_failures=3" in text
    # Neither the statement nor its parameters reach the log.
    assert "alice-private" not in text and "SELECT id FROM runs" not in text


def test_readiness_names_the_store_while_it_is_away(compactor: ChunkCompactor) -> None:
    rounds(compactor, [None])
    rounds(compactor, [OperationalError("SELECT 1", {}, psycopg.OperationalError("gone"))])
    ok, detail = compactor.ready()
    assert not ok
    assert detail["reason"] == "the last round failed: postgres: OperationalError: gone"
    assert compactor.live()[0] is True  # a restart would not bring Postgres back


def test_failed_rounds_back_off_from_one_second_up_to_the_interval(
    compactor: ChunkCompactor, monkeypatch: pytest.MonkeyPatch
) -> None:
    slept: list[float] = []
    now = [0.0]

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    # The loop's waits, on a clock of this test's (for this test only: monkeypatch).
    monkeypatch.setattr("time.sleep", sleep)
    monkeypatch.setattr("time.monotonic", lambda: now[0])
    outcomes: list[Exception | None] = [CompactionError("down")] * 5 + [None, None]
    waits: list[float] = []

    def repair_once(older_than_s: float | None = None, batch: int = 200) -> RepairReport:
        waits.append(now[0])
        outcome = outcomes.pop(0)
        if outcome is not None:
            raise outcome
        return RepairReport(0, 0)

    compactor.repair_once = repair_once  # type: ignore[method-assign]
    compactor.compact_once = lambda *a, **k: CompactionReport(0, 0)  # type: ignore[method-assign]
    compactor.run_forever(6.0, should_stop=lambda: not outcomes)
    gaps = [b - a for a, b in zip(waits, waits[1:], strict=False)]
    assert gaps == [1.0, 2.0, 4.0, 6.0, 6.0, 6.0]


def test_failure_causes() -> None:
    assert compactor_module.failure_cause(OperationalError("x", {}, Exception("y"))) == "postgres"
    assert compactor_module.failure_cause(psycopg.OperationalError("down")) == "postgres"
    assert compactor_module.failure_cause(CompactionError("x")) == "kafka"
    assert compactor_module.failure_cause(KafkaException("x")) == "kafka"
    assert compactor_module.failure_cause(KeyError("x")) == "other"


def test_livez_fails_once_the_loop_has_been_silent_past_the_stall_limit(
    compactor: ChunkCompactor, served: str
) -> None:
    clock = compactor.clock
    assert isinstance(clock, Clock)
    status, body = get(f"{served}/livez")
    assert status == 200 and json.loads(body)["ok"] is True
    clock.now += STALL_AFTER_S + 1  # a statement or a flush that hangs: no progress
    status, body = get(f"{served}/livez")
    assert status == 503
    assert json.loads(body) == {
        "ok": False,
        "silent_s": STALL_AFTER_S + 1,
        "stall_after_s": STALL_AFTER_S,
    }
    compactor._progress()  # a batch written, a record enqueued, a second waited
    assert get(f"{served}/livez")[0] == 200


def test_the_server_answers_readyz_metrics_and_404(compactor: ChunkCompactor, served: str) -> None:
    status, body = get(f"{served}/readyz")
    assert status == 503 and json.loads(body)["reason"] == "no round has completed yet"
    compactor.rounds = 1
    assert get(f"{served}/readyz")[0] == 200
    status, body = get(f"{served}/metrics")
    assert status == 200 and b"koda_chunk_upkeep_last_pass_timestamp_seconds" in body
    assert get(f"{served}/nope")[0] == 404
    assert set(compactor_module.ROUTES) == {"/livez", "/readyz", "/metrics"}


# --- the command line ------------------------------------------------------------


class FakeCompactor:
    instances: list[FakeCompactor] = []

    def __init__(self, settings: Settings) -> None:
        self.every: float | None = None
        self.closed = False
        FakeCompactor.instances.append(self)

    def run_forever(self, every_s: float, older_than_s: float | None, should_stop: Any) -> None:
        self.every = every_s

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def fake_role(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, str]]:
    served: list[tuple[int, str]] = []

    class Server:
        def shutdown(self) -> None:
            pass

    def fake_serve(compactor: Any, port: int, host: str) -> Server:
        served.append((port, host))
        return Server()

    FakeCompactor.instances.clear()
    monkeypatch.setattr(compactor_module, "ChunkCompactor", FakeCompactor)
    monkeypatch.setattr(compactor_module, "serve_health", fake_serve)
    monkeypatch.setattr(cli_chunks, "load_settings", lambda **_: SETTINGS)
    monkeypatch.setattr("koda_runtime.logs.configure_logging", lambda: None)
    return served


def test_the_role_command_line_runs_the_loop_with_its_server(
    fake_role: list[tuple[int, str]],
) -> None:
    """ROLE=compactor's argv plus the deploy files' ``--port 9103``; a later ``--every``
    replaces the role's."""
    runner = CliRunner()
    execs: list[list[str]] = []

    def fake_execv(path: str, argv: list[str]) -> None:
        execs.append(argv)
        raise SystemExit(0)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("os.execv", fake_execv)
        done = runner.invoke(cli.app, ["entrypoint", "--port", "9103"], env={"ROLE": "compactor"})
    assert done.exit_code == 0, done.output
    role_args = execs[-1][3:]
    assert role_args == [
        "chunks",
        "compact",
        "--every",
        str(cli.COMPACTOR_EVERY_S),
        "--port",
        "9103",
    ]
    done = runner.invoke(cli.app, role_args)
    assert done.exit_code == 0, done.output
    (compactor,) = FakeCompactor.instances
    assert compactor.every == cli.COMPACTOR_EVERY_S and compactor.closed
    assert fake_role == [(9103, SETTINGS.worker_host)]
    done = runner.invoke(cli.app, [*role_args, "--every", "5"])
    assert done.exit_code == 0, done.output
    assert FakeCompactor.instances[-1].every == 5


def test_port_without_every_is_refused_naming_the_fix(fake_role: list[tuple[int, str]]) -> None:
    done = CliRunner().invoke(cli.app, ["chunks", "compact", "--port", "9103"])
    assert done.exit_code == 2
    assert "--port serves the probes of a repeating compactor: give --every S too" in done.stderr
    assert fake_role == [] and FakeCompactor.instances == []
