"""The import layers ARCHITECTURE.md draws ("Code map"), enforced.

Every module of the project's packages is parsed (never imported) and each of its
imports, at module level or inside a function, is checked against the layer table below.
A module belongs to the layer of the longest prefix in ``LAYER_OF`` that names it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# The one installed import name, and the checkout folder of each of its packages
# (pyproject's package-dir): the only place they are spelled.
NS = "koda_runtime"
FOLDERS = {
    "koda": NS,
    "cli": f"{NS}.cli",
    "topics": f"{NS}.topics",
    "schemas": f"{NS}.schemas",
    "gateway": f"{NS}.gateway",
    "processors": f"{NS}.processors",
    "scheduler": f"{NS}.scheduler",
}
KODA, CLI, TOPICS, SCHEMAS, GATEWAY, PROCESSORS, SCHEDULER = FOLDERS.values()

# Module name prefix -> layer. cli/ (every ``koda`` command) composes every package and
# is the only entry layer; koda/ is the core everything else stands on.
LAYER_OF = {
    KODA: "core",
    f"{KODA}.lifecycle": "lifecycle",
    f"{KODA}.errors": "errors",
    CLI: "entry",
    SCHEMAS: "schemas",
    TOPICS: "topics",
    GATEWAY: "gateway",
    PROCESSORS: "processors",
    SCHEDULER: "scheduler",
}

# Layer -> the layers it may import (itself always).
MAY_IMPORT = {
    "errors": set(),
    "lifecycle": {"errors"},
    "core": {"errors", "lifecycle"},
    "schemas": {"errors", "lifecycle", "core"},
    "topics": {"errors", "lifecycle", "core", "schemas"},
    "gateway": {"errors", "lifecycle", "core", "schemas", "topics"},
    "processors": {"errors", "lifecycle", "core", "schemas", "topics"},
    # The scheduler admits runs through schemas/runs/admission.py and publishes them with
    # topics/: it imports nothing of the gateway.
    "scheduler": {"errors", "lifecycle", "core", "schemas", "topics"},
    "entry": set(LAYER_OF.values()),
}

# The pure lifecycle talks to no broker and no database.
LIFECYCLE_NEVER = ("aiokafka", "confluent_kafka", "faust", "sqlalchemy", "asyncpg", "psycopg")

# Imports that break the picture for a while, (importer, imported) -> the change that
# removes it. An entry that no longer matches fails the test, so the list only shrinks.
KNOWN: dict[tuple[str, str], str] = {}


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        layer = LAYER_OF.get(".".join(parts[:n]))
        if layer is not None:
            return layer
    return None


def module_name(path: Path) -> str:
    folder, *parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join([FOLDERS[folder], *(parts[:-1] if parts[-1:] == ["__init__"] else parts)])


def path_of(name: str) -> Path | None:
    """The checkout path of a dotted name under NS (without a suffix)."""
    for folder, package in sorted(FOLDERS.items(), key=lambda kv: -len(kv[1])):
        if name == package or name.startswith(package + "."):
            rest = name[len(package) :].strip(".")
            return ROOT.joinpath(folder, *(rest.split(".") if rest else []))
    return None


def ours(name: str) -> bool:
    return name == NS or name.startswith(NS + ".")


def imports(path: Path, module: str) -> Iterator[str]:
    """Every module ``path`` imports, relative imports resolved against ``module``."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            yield target
            # ``from pkg import mod`` imports pkg.mod when mod is a module.
            yield from (f"{target}.{alias.name}" for alias in node.names)


def project_modules() -> list[tuple[Path, str]]:
    found = []
    for top in FOLDERS:
        for path in sorted((ROOT / top).rglob("*.py")):
            found.append((path, module_name(path)))
    return found


def resolved(name: str) -> str:
    """``name`` cut back to a module or package that exists in the tree."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        base = path_of(".".join(parts[:n]))
        if base is None:
            break
        if base.with_suffix(".py").is_file() or (base / "__init__.py").is_file() or base.is_dir():
            return ".".join(parts[:n])
    return name


def crossings(modules: list[tuple[Path, str]]) -> dict[tuple[str, str], str]:
    """(importer, imported) -> why it breaks the layers, for every forbidden import."""
    bad: dict[tuple[str, str], str] = {}
    for path, module in modules:
        mine = layer_of(module)
        assert mine is not None, f"{module} is in no layer: add it to LAYER_OF"
        for name in imports(path, module):
            if mine == "lifecycle" and name.split(".")[0] in LIFECYCLE_NEVER:
                bad[(module, name)] = f"the pure lifecycle imports {name}"
                continue
            if not ours(name):
                continue
            target = resolved(name)
            theirs = layer_of(target)
            if theirs is None or theirs == mine or theirs in MAY_IMPORT[mine]:
                continue
            bad[(module, target)] = f"{mine} may not import {theirs}"
    return bad


def test_every_layer_imports_only_the_layers_below_it() -> None:
    found = crossings(project_modules())
    new = {k: v for k, v in found.items() if k not in KNOWN}
    assert not new, "imports across the layers of ARCHITECTURE.md:\n" + "\n".join(
        f"  {a} -> {b}: {why}" for (a, b), why in sorted(new.items())
    )
    gone = sorted(set(KNOWN) - set(found))
    assert not gone, f"these known crossings are gone; delete them from KNOWN: {gone}"


@pytest.mark.parametrize(
    ("source", "importer", "why"),
    [
        (f"import {GATEWAY}.app\n", f"{PROCESSORS}.x", "processors may not import gateway"),
        (f"from {PROCESSORS} import runner\n", f"{GATEWAY}.x", "gateway may not import"),
        (f"from {GATEWAY}.store import RunStore\n", f"{TOPICS}.x", "topics may not import"),
        (f"from {TOPICS}.catalogue import RUNS\n", f"{SCHEMAS}.x", "schemas may not import"),
        ("import sqlalchemy\n", f"{KODA}.lifecycle.x", "the pure lifecycle imports"),
        (f"from {KODA}.settings import Settings\n", f"{KODA}.lifecycle.x", "lifecycle may not"),
        (f"from {SCHEDULER} import service\n", f"{GATEWAY}.x", "gateway may not import"),
        (f"from {GATEWAY}.admission import Admissions\n", f"{SCHEDULER}.x", "scheduler may not"),
        (f"from {GATEWAY} import cli\n", f"{KODA}.db", "core may not import gateway"),
    ],
    ids=[
        "processors-gateway",
        "gateway-processors",
        "topics-gateway",
        "schemas-topics",
        "lifecycle-sqlalchemy",
        "lifecycle-core",
        "gateway-scheduler",
        "scheduler-gateway",
        "core-gateway",
    ],
)
def test_the_contract_catches_a_crossing(
    tmp_path: Path, source: str, importer: str, why: str
) -> None:
    """A planted forbidden import is found: the check above cannot pass vacuously."""
    path = tmp_path / "planted.py"
    path.write_text(source)
    reasons = [r for (a, _), r in crossings([(path, importer)]).items() if a == importer]
    assert any(why in r for r in reasons), reasons
