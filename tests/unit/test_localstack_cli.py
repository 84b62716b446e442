"""`koda services` command line: output format and one-line errors with exit status 2."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from koda_runtime.cli.services import services_app
from koda_runtime.localstack import StackInfo, env_lines

runner = CliRunner()


def test_env_lines_are_the_two_documented_keys() -> None:
    info = StackInfo("127.0.0.1:1,127.0.0.1:2", "postgresql://koda@127.0.0.1:3/koda", 2)
    assert env_lines(info) == [
        "KODA_KAFKA_BOOTSTRAP=127.0.0.1:1,127.0.0.1:2",
        "KODA_DATABASE_URL=postgresql://koda@127.0.0.1:3/koda",
    ]


def test_env_without_services_is_a_one_line_error(tmp_path: Path) -> None:
    result = runner.invoke(services_app, ["env", "--state-dir", str(tmp_path)])
    assert result.exit_code == 2
    assert result.stderr.count("\n") == 1
    assert result.stderr.startswith("error: no local services in")
    assert "koda services up" in result.stderr
    assert result.stdout == ""


def test_up_with_an_unsupported_broker_count_exits_2(tmp_path: Path) -> None:
    result = runner.invoke(services_app, ["up", "--brokers", "2", "--state-dir", str(tmp_path)])
    assert result.exit_code == 2
    assert result.stderr == "error: --brokers 2 is not supported: use 1 or 3\n"
    assert not (tmp_path / "kafka").exists()


def test_status_of_an_empty_state_dir_exits_1(tmp_path: Path) -> None:
    result = runner.invoke(services_app, ["status", "--state-dir", str(tmp_path)])
    assert result.exit_code == 1
    assert "kafka      not set up" in result.stdout
    assert "postgres   not set up" in result.stdout


def test_down_of_an_empty_state_dir_is_a_no_op(tmp_path: Path) -> None:
    result = runner.invoke(services_app, ["down", "--state-dir", str(tmp_path / "none")])
    assert result.exit_code == 0
