from __future__ import annotations

import itertools
import re
import subprocess
from pathlib import Path

import pytest

from koda_runtime.errors import ConfigError
from koda_runtime.naming import AppEnv, NameKind, Names, resource_name
from koda_runtime.settings import Settings
from koda_runtime.topics.catalogue import catalogue

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


def test_replay_jobs_and_the_warehouse_have_names_of_their_own() -> None:
    dev, ns = Names(AppEnv.DEV), Names(AppEnv.PROD, "t1")
    assert dev.replay_group("nightly") == "dev.koda.replay.nightly"
    assert ns.replay_group("nightly") == "prod.koda.t1.replay.nightly"
    assert dev.replay_group("workers") != dev.group("workers")
    assert dev.warehouse_schema() == "koda_dev_warehouse"
    assert ns.warehouse_schema() == "koda_prod__t1_warehouse"
    assert dev.warehouse_schema() != dev.pg_schema()
    with pytest.raises(ConfigError, match="name part"):
        dev.replay_group("a b")


def test_dev_and_prod_names_never_collide() -> None:
    bases = ["runs", "run-control", "run-chunks", "run-events", "runs-dlq", "workers"]
    for kind, base, ns in itertools.product(NameKind, bases, [None, "a", "b"]):
        assert resource_name(kind, AppEnv.DEV, base, namespace=ns) != resource_name(
            kind, AppEnv.PROD, base, namespace=ns
        )
    dev = {s.name for s in catalogue(Settings(app_env=AppEnv.DEV))}
    prod_settings = Settings(app_env=AppEnv.PROD, handler="openai", kafka_allow_plaintext=True)
    prod = {s.name for s in catalogue(prod_settings)}
    assert len(dev) == 6 and dev.isdisjoint(prod)


def test_bad_name_parts_are_refused() -> None:
    with pytest.raises(ConfigError, match="namespace"):
        resource_name(NameKind.TOPIC, AppEnv.DEV, "runs", namespace="Bad Name")
    with pytest.raises(ConfigError, match="name"):
        resource_name(NameKind.TOPIC, AppEnv.DEV, "runs;drop")


# A name built anywhere but koda_runtime.naming: an env-prefixed topic or group, a Postgres schema,
# a literal consumer group id (librdkafka, aiokafka or Faust), or SQL naming a koda schema.
NAME_LITERAL = re.compile(
    r"""["'](dev|prod)\.koda\.|["']koda_(dev|prod)|["']koda_\{|\{[^}]*\}\.koda\."""
    r"""|["']group\.id["']\s*:\s*f?["']|\bgroup_id\s*=\s*f?["']|\bApp\(\s*f?["']"""
    r"""|\b(CREATE|DROP|ALTER)\s+SCHEMA\s+(IF\s+(NOT\s+)?EXISTS\s+)?["']?koda"""
    r"""|search_path\s*(TO|=)\s*["']?koda""",
    re.IGNORECASE,
)
SCANNED = ("*.py", "*.yaml", "*.yml", "*.toml", "*.sh", "*.ini", "Dockerfile", "Makefile")


def test_the_literal_scan_catches_names_built_elsewhere() -> None:
    for bad in [
        '"dev.koda.runs"',
        "'prod.koda.workers'",
        '"koda_dev__t1"',
        'f"koda_{env}"',
        'f"{env}.koda.runs"',
        '{"group.id": "workers"}',
        "group_id='dev-workers'",
        'faust.App("koda-workers")',
        "CREATE SCHEMA IF NOT EXISTS koda_dev",
        'SET search_path TO "koda_prod"',
    ]:
        assert NAME_LITERAL.search(bad), bad
    for fine in [
        'settings.names.group("workers")',
        '{"group.id": group}',
        "group_id=None",
        "KodaApp(settings.names.group(settings.worker_group))",
        'CREATE SCHEMA IF NOT EXISTS "{schema}"',
    ]:
        assert not NAME_LITERAL.search(fine), fine


def test_no_name_literal_outside_the_naming_function() -> None:
    """Topic, group and schema names are built only by koda_runtime.naming."""
    files = subprocess.run(
        [
            "git",
            "ls-files",
            "--cached",
            "--others",
            "--exclude-standard",
            *SCANNED,
            *(f"**/{p}" for p in SCANNED),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    offenders = []
    for rel in sorted(set(files)):
        if (
            rel == "koda/naming.py"
            or rel.startswith(("tests/", "."))
            or "/." in rel
            or not (ROOT / rel).exists()
        ):  # hidden dirs hold tools and virtualenvs
            continue
        text = (ROOT / rel).read_text(errors="replace")
        offenders += [f"{rel}: {m.group(0)}" for m in NAME_LITERAL.finditer(text)]
    assert offenders == []
