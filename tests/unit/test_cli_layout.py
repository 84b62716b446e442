"""The command line's one naming pattern: ``koda N`` is declared in ``cli/N.py``.

Every group registered on the root app by name N is a Typer app held by module
``koda_runtime.cli.N`` whose commands are defined there; every command registered on the
root app is defined in ``koda_runtime.cli.N`` or in ``cli/processes.py`` (the process
commands); ``cli/__init__.py`` defines no Typer app but the root one and no command; and
every module of cli/ but the few shared ones is named after a registered group or
command. Failure mode provoked: a planted package that breaks each rule is reported on
each count.
"""

from __future__ import annotations

import ast
import importlib
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import typer

from koda_runtime import cli

ROOT = Path(__file__).resolve().parents[2]
# Modules of cli/ that declare no `koda N` of their own name.
SHARED = {"__init__", "__main__", "common", "reference", "processes"}


def _defined_in(module: ModuleType, obj: object) -> bool:
    return any(value is obj for value in vars(module).values())


def _import(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError:
        return None


def layout_problems(package: ModuleType, root: typer.Typer, folder: Path) -> list[str]:
    """What breaks the pattern in ``package`` (its root app ``root``, its files in ``folder``)."""
    pkg = package.__name__
    problems: list[str] = []
    names: set[str] = set()
    for group in root.registered_groups:
        name, sub = group.name or "", group.typer_instance
        names.add(name)
        module = _import(f"{pkg}.{name}")
        if module is None or not _defined_in(module, sub):
            problems.append(f"group {name!r}: its app is not declared in {pkg}.{name}")
        for command in sub.registered_commands if sub is not None else []:
            where = getattr(command.callback, "__module__", None)
            if where != f"{pkg}.{name}":
                problems.append(f"group {name!r}: command {command.name!r} is defined in {where}")
    for command in root.registered_commands:
        name = str(command.name or getattr(command.callback, "__name__", "?"))
        names.add(name)
        where = getattr(command.callback, "__module__", None)
        if where not in (f"{pkg}.{name}", f"{pkg}.processes"):
            problems.append(f"command {name!r} is defined in {where}, not {pkg}.{name}")
    init = folder / "__init__.py"
    apps = [
        node
        for node in ast.walk(ast.parse(init.read_text()))
        if isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] == "Typer"
    ]
    if len(apps) > 1:
        problems.append(f"{init.name} defines {len(apps) - 1} Typer app(s) besides the root")
    for file in sorted(folder.glob("*.py")):
        if file.stem not in SHARED and file.stem not in names:
            problems.append(f"{file.name} is named after no registered group or command")
    return problems


@pytest.fixture
def whole_app() -> Iterator[typer.Typer]:
    """The root app with the groups main() attaches, put back as it was afterwards."""
    groups = list(cli.app.registered_groups)
    try:
        cli._add_optional_apps()
        yield cli.app
    finally:
        cli.app.registered_groups = groups


def test_every_group_and_command_lives_in_the_module_of_its_name(whole_app: typer.Typer) -> None:
    assert layout_problems(cli, whole_app, ROOT / "cli") == []
    registered = {g.name for g in whole_app.registered_groups}
    assert {"topics", "chunks", "traces", "prices", "runs", "users"} <= registered
    commands = {c.name for c in whole_app.registered_commands}
    assert {"replay", "worker", "gateway", "scheduler", "entrypoint", "dev"} <= commands


PLANTED = {
    "__init__.py": """
        import typer

        from plantedcli import good, replay

        app = typer.Typer()
        inline_app = typer.Typer()
        app.add_typer(good.good_app, name="good")
        app.add_typer(good.other_app, name="misnamed")
        app.add_typer(inline_app, name="inline")
        replay.register(app)

        @app.command("inline-command")
        def inline_command() -> None:
            pass

        @good.good_app.command("two")
        def two() -> None:
            pass
    """,
    "good.py": """
        import typer

        good_app = typer.Typer()
        other_app = typer.Typer()

        @good_app.command("one")
        def one() -> None:
            pass
    """,
    "replay.py": """
        import typer

        def register(app: typer.Typer) -> None:
            app.command("replay")(replay)
            app.command("stray-command")(replay)

        def replay() -> None:
            pass
    """,
    "stray.py": "",
}


def test_a_planted_package_breaking_each_rule_is_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "plantedcli"
    folder.mkdir()
    for name, text in PLANTED.items():
        (folder / name).write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(tmp_path))
    planted = importlib.import_module("plantedcli")
    try:
        problems = layout_problems(planted, planted.app, folder)
    finally:
        for name in [m for m in sys.modules if m.startswith("plantedcli")]:
            del sys.modules[name]
    assert sorted(problems) == sorted(
        [
            "group 'misnamed': its app is not declared in plantedcli.misnamed",
            "group 'inline': its app is not declared in plantedcli.inline",
            "group 'good': command 'two' is defined in plantedcli",
            "command 'stray-command' is defined in plantedcli.replay, not plantedcli.stray-command",
            "command 'inline-command' is defined in plantedcli, not plantedcli.inline-command",
            "__init__.py defines 1 Typer app(s) besides the root",
            "stray.py is named after no registered group or command",
        ]
    )
