"""The compactor as a long-running role: its rounds, gauges, probes and command line.

Pure code: the compactor's engine and producer are never used here (its passes are
replaced), the health server is real on a free port. The real loop against Kafka and
Postgres is tests/integration/test_compactor_role.py.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from typer.testing import CliRunner

from koda_runtime import cli, metrics
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
    assert not ok and detail["reason"] == "the last round failed: the broker said no"
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
    monkeypatch.setattr(cli, "load_settings", lambda **_: SETTINGS)
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
