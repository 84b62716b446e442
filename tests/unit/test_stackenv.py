"""Finding a local stack's services.env (koda/stackenv.py) and what it may change."""

from __future__ import annotations

from pathlib import Path

import pytest

from koda_runtime.errors import ConfigError, ServiceError
from koda_runtime.naming import AppEnv
from koda_runtime.reach import database_address, kafka_addresses
from koda_runtime.settings import DEFAULT_BOOTSTRAP, Settings

LINES = "KODA_KAFKA_BOOTSTRAP=127.0.0.1:19092\nKODA_DATABASE_URL=postgresql://koda@127.0.0.1:15432/koda\n"


def stack_dir(root: Path, text: str = LINES, name: str = ".koda") -> Path:
    path = root / name / "services.env"
    path.parent.mkdir(parents=True)
    path.write_text(text)
    return path


def test_a_services_env_in_a_parent_directory_is_found_and_makes_it_dev(tmp_path: Path) -> None:
    path = stack_dir(tmp_path)
    deeper = tmp_path / "a" / "b"
    deeper.mkdir(parents=True)
    settings = Settings.from_env({}, cwd=deeper)
    assert settings.app_env is AppEnv.DEV
    assert settings.kafka_bootstrap == "127.0.0.1:19092"
    assert settings.database_url == "postgresql://koda@127.0.0.1:15432/koda"
    assert settings.origin("KODA_KAFKA_BOOTSTRAP") == str(path)
    assert settings.origin("APP_ENV") == str(path)


def test_an_explicit_variable_wins_over_the_file(tmp_path: Path) -> None:
    path = stack_dir(tmp_path)
    settings = Settings.from_env({"KODA_KAFKA_BOOTSTRAP": "kafka:9092"}, cwd=tmp_path)
    assert settings.kafka_bootstrap == "kafka:9092"
    assert settings.origin("KODA_KAFKA_BOOTSTRAP") == "KODA_KAFKA_BOOTSTRAP in the environment"
    assert settings.database_url.endswith(":15432/koda")
    assert settings.origin("KODA_DATABASE_URL") == str(path)


def test_prod_never_reads_the_file(tmp_path: Path) -> None:
    stack_dir(tmp_path)
    env = {"APP_ENV": "prod", "KODA_HANDLER": "openai", "KODA_KAFKA_ALLOW_PLAINTEXT": "true"}
    settings = Settings.from_env(env, cwd=tmp_path)
    assert settings.app_env is AppEnv.PROD
    assert settings.kafka_bootstrap == DEFAULT_BOOTSTRAP
    assert settings.origin("KODA_KAFKA_BOOTSTRAP") == "the default: KODA_KAFKA_BOOTSTRAP is not set"


def test_without_a_file_app_env_is_still_required(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="APP_ENV is not set"):
        Settings.from_env({}, cwd=tmp_path)


def test_an_explicit_environ_alone_is_taken_as_it_is(tmp_path: Path, monkeypatch) -> None:
    stack_dir(tmp_path)
    monkeypatch.chdir(tmp_path)
    settings = Settings.from_env({"APP_ENV": "dev"})
    assert settings.kafka_bootstrap == DEFAULT_BOOTSTRAP


def test_koda_state_dir_names_the_stack(tmp_path: Path) -> None:
    stack_dir(tmp_path)  # the default .koda, which KODA_STATE_DIR overrides
    other = stack_dir(tmp_path, LINES.replace("19092", "29092"), name="other")
    settings = Settings.from_env({"KODA_STATE_DIR": "other"}, cwd=tmp_path)
    assert settings.kafka_bootstrap == "127.0.0.1:29092"
    assert settings.origin("KODA_KAFKA_BOOTSTRAP") == str(other)


@pytest.mark.parametrize(
    "text", ["KODA_KAFKA_BOOTSTRAP\n", "KODA_HANDLER=openai\n", "KODA_DATABASE_URL=\n"]
)
def test_a_bad_line_is_refused_naming_the_file_and_line(tmp_path: Path, text: str) -> None:
    path = stack_dir(tmp_path, "# written by koda services up\n" + text)
    with pytest.raises(ConfigError, match=f"{path}:2: expected KEY=VALUE"):
        Settings.from_env({}, cwd=tmp_path)


def test_bootstrap_lists_are_split_into_addresses() -> None:
    assert kafka_addresses("a:1, SASL_SSL://b:2,[::1]:3") == [("a", 1), ("b", 2), ("::1", 3)]
    with pytest.raises(ServiceError, match="'b' is not host:port"):
        kafka_addresses("a:1,b")


def test_database_urls_give_their_tcp_address() -> None:
    assert database_address("postgresql://u:p@db.example:6432/koda") == ("db.example", 6432)
    assert database_address("postgresql://koda@127.0.0.1/koda") == ("127.0.0.1", 5432)
    assert database_address("postgresql:///koda?host=/run/postgresql") is None
    assert database_address("postgresql://h1:5432,h2:5432/koda") is None


def test_a_default_address_says_nothing_was_found(tmp_path: Path) -> None:
    settings = Settings.from_env({"APP_ENV": "dev"}, cwd=tmp_path)
    assert settings.kafka_bootstrap == DEFAULT_BOOTSTRAP
    assert settings.origin("KODA_DATABASE_URL") == (
        "the default: no KODA_DATABASE_URL, no .koda/services.env found"
    )
