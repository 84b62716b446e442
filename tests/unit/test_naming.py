from __future__ import annotations

import itertools
import re
import subprocess
from pathlib import Path

import pytest

from koda.errors import ConfigError
from koda.naming import AppEnv, Names, NameKind, resource_name
from koda.settings import Settings
from topics.catalogue import catalogue

ROOT = Path(__file__).resolve().parents[2]


def test_app_env_refuses_anything_but_dev_and_prod() -> None:
    for bad in ("development", "production", "DEV", "", None, "test"):
        with pytest.raises(ConfigError, match="APP_ENV"):
            AppEnv.parse(bad)
    assert AppEnv.parse("dev") is AppEnv.DEV
    assert AppEnv.parse("prod") is AppEnv.PROD


def test_settings_refuse_app_env_development() -> None:
    with pytest.raises(ConfigError, match="APP_ENV='development'"):
        Settings.from_env({"APP_ENV": "development"})


def test_names_have_the_documented_shape() -> None:
    dev = Names(AppEnv.DEV)
    assert dev.topic("runs") == "dev.koda.runs"
    assert dev.group("workers") == "dev.koda.workers"
    assert Names(AppEnv.PROD, "t1").topic("run-chunks") == "prod.koda.t1.run-chunks"
    assert dev.pg_schema() == "koda_dev"
    assert Names(AppEnv.DEV, "t-1").pg_schema() == "koda_dev__t_1"


def test_dev_and_prod_names_never_collide() -> None:
    bases = ["runs", "run-control", "run-chunks", "run-events", "runs-dlq", "workers"]
    for kind, base, ns in itertools.product(NameKind, bases, [None, "a", "b"]):
        assert resource_name(kind, AppEnv.DEV, base, namespace=ns) != resource_name(
            kind, AppEnv.PROD, base, namespace=ns
        )
    dev = {s.name for s in catalogue(Settings(app_env=AppEnv.DEV))}
    prod_settings = Settings(app_env=AppEnv.PROD, handler="openai", allow_topic_autocreate=False)
    prod = {s.name for s in catalogue(prod_settings)}
    assert len(dev) == 6 and dev.isdisjoint(prod)


def test_bad_name_parts_are_refused() -> None:
    with pytest.raises(ConfigError, match="namespace"):
        resource_name(NameKind.TOPIC, AppEnv.DEV, "runs", namespace="Bad Name")
    with pytest.raises(ConfigError, match="name"):
        resource_name(NameKind.TOPIC, AppEnv.DEV, "runs;drop")


def test_no_name_literal_outside_the_naming_function() -> None:
    """Topic, group and schema names are built only by koda.naming."""
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.split()
    pattern = re.compile(r"""["'](dev|prod)\.koda\.|["']koda_(dev|prod)|\{[^}]*\}\.koda\.""")
    offenders = []
    for rel in files:
        if rel in ("koda/naming.py",) or rel.startswith("tests/"):
            continue
        text = (ROOT / rel).read_text()
        offenders += [f"{rel}: {m.group(0)}" for m in pattern.finditer(text)]
    assert offenders == []
