"""The package installs as one name, koda_runtime, and ships what its commands read.

pyproject.toml maps the checkout's folders under koda_runtime (``package-dir``) and
lists the packages by hand; these tests fail when a folder is added and not listed,
or when code imports a folder by its bare name (it would be imported twice, as two
modules).
"""

from __future__ import annotations

import ast
import sys
import tomllib
from pathlib import Path

import pytest

from koda_runtime import resources
from koda_runtime.topics.replay.errors import ReplayOptionError
from tests.fixtures.processes import ROOT

PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SETUPTOOLS = PROJECT["tool"]["setuptools"]
PACKAGE_DIR: dict[str, str] = SETUPTOOLS["package-dir"]
BARE = ("koda", "cli", "gateway", "processors", "scheduler", "topics", "schemas")


def folder_of(package: str) -> Path:
    """The checkout folder of a dotted package name, by the longest package-dir match."""
    parts = package.split(".")
    for n in range(len(parts), 0, -1):
        head = ".".join(parts[:n])
        if head in PACKAGE_DIR:
            return ROOT / PACKAGE_DIR[head] / Path(*parts[n:])
    raise AssertionError(f"{package} is not under a package-dir mapping")


def test_the_distribution_name_is_koda_runtime() -> None:
    # `koda` on PyPI is another project, which also imports as `koda`.
    assert PROJECT["project"]["name"] == resources.DISTRIBUTION == "koda-runtime"


def test_every_listed_package_is_a_folder_and_every_code_folder_is_listed() -> None:
    listed = set(SETUPTOOLS["packages"])
    for package in listed:
        assert folder_of(package).is_dir(), package
    for name, folder in PACKAGE_DIR.items():
        if name == "koda_runtime.deploy":
            continue
        for path in (ROOT / folder).rglob("*.py"):
            rel = path.parent.relative_to(ROOT / folder)
            package = ".".join([name, *rel.parts]) if rel.parts else name
            assert package in listed, f"{path.relative_to(ROOT)}: add {package} to pyproject"


def test_code_never_imports_a_folder_by_its_bare_name() -> None:
    offenders = []
    for path in sorted(ROOT.glob("*/**/*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in {".venv", "build", ".git"} or rel.parts[0].startswith(".venv"):
            continue
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                if name.split(".")[0] in BARE:
                    offenders.append(f"{rel}:{node.lineno}: {name}")
    assert offenders == [], "import koda_runtime.<folder> instead:\n" + "\n".join(offenders)


def test_the_deploy_data_the_local_stack_reads_is_shipped() -> None:
    for parts in (("local", "pom.xml"), ("local", "kafka-jars.lock"), ("prometheus", "alerts.yml")):
        assert resources.deploy_path(*parts).is_file()
    with pytest.raises(Exception, match="reinstall koda-runtime"):
        resources.deploy_path("local", "no-such-file")


def test_a_warehouse_sink_without_its_extra_names_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from koda_runtime.naming import AppEnv, Names
    from koda_runtime.topics.replay.sinks import open_sink

    for module in list(sys.modules):
        if module.startswith("koda_runtime.topics.replay.sinks.") or module == "duckdb":
            monkeypatch.delitem(sys.modules, module)
    monkeypatch.setitem(sys.modules, "duckdb", None)  # as when it is not installed
    with pytest.raises(ReplayOptionError, match=r"koda-runtime\[warehouse\]"):
        open_sink("duckdb:///w.duckdb", Names(AppEnv.DEV))
