"""prod refuses the demo handler, no client auto-creates a topic, destructive commands need
a flag."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from koda_runtime import cli
from koda_runtime.errors import ConfigError
from koda_runtime.naming import AppEnv
from koda_runtime.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()
# Nothing listens there: a command that tried to reach Kafka would fail or hang, not pass.
UNREACHABLE = {
    "KODA_KAFKA_BOOTSTRAP": "127.0.0.1:1",
    "KODA_DATABASE_URL": "postgresql://nobody@127.0.0.1:1/none",
}
PROD_ENV = {
    "APP_ENV": "prod",
    "KODA_HANDLER": "openai",
    "KODA_KAFKA_ALLOW_PLAINTEXT": "true",
    **UNREACHABLE,
}


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for key in list(os.environ):
        if key.startswith("KODA_") or key in ("APP_ENV", "ROLE"):
            monkeypatch.delenv(key)


def test_prod_refuses_the_demo_handler() -> None:
    with pytest.raises(ConfigError, match="KODA_HANDLER=demo is refused in prod"):
        Settings.from_env({**PROD_ENV, "KODA_HANDLER": "demo"})
    with pytest.raises(ConfigError, match="demo is refused in prod"):
        Settings.from_env({"APP_ENV": "prod"})  # the default


def test_prod_refuses_a_test_fault_and_dev_refuses_an_unknown_one() -> None:
    with pytest.raises(ConfigError, match="KODA_TEST_FAULT=kill-after-finish-commit is refused"):
        Settings.from_env({**PROD_ENV, "KODA_TEST_FAULT": "kill-after-finish-commit"})
    with pytest.raises(ConfigError, match="KODA_TEST_FAULT='kill-sometimes': use one of"):
        Settings.from_env({"APP_ENV": "dev", "KODA_TEST_FAULT": "kill-sometimes"})
    on = Settings.from_env({"APP_ENV": "dev", "KODA_TEST_FAULT": "kill-after-chunks-commit"})
    assert on.test_fault == "kill-after-chunks-commit"
    assert Settings.from_env({"APP_ENV": "dev"}).test_fault is None


def test_no_client_auto_creates_a_topic_and_no_setting_turns_it_on() -> None:
    """librdkafka's producer auto-creates a missing topic by default; koda's clients turn
    that off in every environment (topics come from `koda topics apply`), so a missing
    topic is an error, never a topic with the broker's default partitions."""
    from koda_runtime.kafka import consumer_config, producer_config
    from koda_runtime.knobs import knobs

    # Every librdkafka client of koda takes its config from these two (koda/kafka.py).
    for env in (AppEnv.DEV, AppEnv.PROD):
        settings = Settings(app_env=env, handler="openai", kafka_allow_plaintext=True)
        assert producer_config(settings, "gateway")["allow.auto.create.topics"] is False
        for group in (None, "g"):
            config = consumer_config(settings, "live-feed", group)
            assert config["allow.auto.create.topics"] is False
    assert not [spec.env for _, _, spec in knobs(Settings) if "CREATE" in spec.env]
    dev = Settings.from_env({"APP_ENV": "dev"})
    assert dev.handler == "demo"


@pytest.mark.parametrize(
    "argv",
    [
        ["topics", "delete"],
        ["topics", "apply"],
        ["dlq", "replay"],
        ["dlq", "replay", "--dry-run", "--reason", "unknown_run"],
        ["dlq", "replay", "0:3"],
    ],
)
def test_destructive_commands_refuse_in_prod_without_the_flag(argv: list[str]) -> None:
    result = runner.invoke(cli.app, argv, env=PROD_ENV)
    assert result.exit_code == 2, result.output
    assert f"`koda {' '.join(argv[:2])}` in APP_ENV=prod needs --confirm-prod" in result.stderr


def test_with_the_flag_prod_goes_on_to_the_broker(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Any] = []

    def delete(s: Any) -> list[str]:
        calls.append(s)
        return ["x"]

    monkeypatch.setattr("koda_runtime.topics.admin.delete_topics", delete)
    monkeypatch.setattr("koda_runtime.reach.require_kafka", lambda s: None)  # no broker here
    result = runner.invoke(cli.app, ["topics", "delete", "--confirm-prod"], env=PROD_ENV)
    assert result.exit_code == 0, result.output
    assert calls and calls[0].app_env is AppEnv.PROD


def test_dev_asks_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Any] = []

    def delete(s: Any) -> list[str]:
        calls.append(s)
        return []

    monkeypatch.setattr("koda_runtime.topics.admin.delete_topics", delete)
    monkeypatch.setattr("koda_runtime.reach.require_kafka", lambda s: None)  # no broker here
    result = runner.invoke(
        cli.app, ["topics", "delete"], env={"APP_ENV": "dev", **UNREACHABLE}, input=""
    )
    assert result.exit_code == 0, result.output
    assert len(calls) == 1 and "topics deleted (0)" in result.stdout


def test_entrypoint_execs_the_role_command(monkeypatch: pytest.MonkeyPatch) -> None:
    execs: list[list[str]] = []

    def fake_execv(path: str, argv: list[str]) -> None:
        execs.append(argv)
        raise SystemExit(0)

    monkeypatch.setattr("os.execv", fake_execv)
    for role, tail in [
        ("worker", ["worker"]),
        ("gateway", ["gateway"]),
        ("migrate", ["db", "upgrade"]),
        ("topics", ["topics", "apply", "--confirm-prod"]),
    ]:
        extra = ["--confirm-prod"] if role == "topics" else []
        result = runner.invoke(cli.app, ["entrypoint", *extra], env={"ROLE": role})
        assert result.exit_code == 0, result.output
        assert execs[-1] == [sys.executable, "-m", "koda_runtime.cli", *tail]
    result = runner.invoke(cli.app, ["entrypoint"], env={"ROLE": "shell"})
    assert result.exit_code == 2 and "ROLE='shell'" in result.stderr


def test_entrypoint_runs_the_role_for_real() -> None:
    """Through a real exec: ROLE=topics in prod reaches `topics apply`, which refuses."""
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("KODA_")}
    env.update(PROD_ENV, ROLE="topics")
    proc = subprocess.run(  # noqa: S603
        [sys.executable, "-m", "koda_runtime.cli", "entrypoint"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "`koda topics apply` in APP_ENV=prod needs --confirm-prod" in proc.stderr
