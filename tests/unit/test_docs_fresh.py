"""The generated references are fresh, the two front documents stay short, and every
relative link in the docs leads to a file.

docs/cli.md is generated from the ``koda`` Typer app (``python -m
koda_runtime.cli.reference``) and docs/settings.md's table from the knob declarations
(``python -m koda_runtime.settingsdoc``); each test here fails when its file is stale.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import typer
import typer.main
from typer._click.core import Context

from koda_runtime import settingsdoc
from koda_runtime.cli import reference

ROOT = Path(__file__).resolve().parents[2]
README_MAX = 15_000
ARCHITECTURE_MAX = 25_000


def test_the_command_reference_is_what_the_cli_gives_now() -> None:
    doc = (ROOT / "docs" / "cli.md").read_text()
    assert doc == reference.render(reference.koda_command()), (
        "run python -m koda_runtime.cli.reference"
    )
    assert reference.main(["--check", str(ROOT / "docs" / "cli.md")]) == 0


def test_the_command_reference_names_every_command_and_subcommand() -> None:
    doc = (ROOT / "docs" / "cli.md").read_text()
    root = reference.koda_command()
    ctx = Context(root, info_name="koda")
    commands = reference.subcommands(root, ctx)
    assert len(commands) > 15
    for name, command in commands:
        assert f"`koda {name}`" in doc, name
        sub = Context(command, info_name=name, parent=ctx)
        for child, _ in reference.subcommands(command, sub):
            assert f"`koda {name} {child}`" in doc, (name, child)
    # the groups attached at start-up only are there too, and building left the app as it was
    for group in ("runs", "schedules", "memories", "services", "users"):
        assert f"## `koda {group}`" in doc, group
    from koda_runtime import cli

    assert "users" not in {g.name for g in cli.app.registered_groups if g.name}


def test_a_changed_help_text_makes_the_check_fail(tmp_path: Path) -> None:
    current = tmp_path / "cli.md"
    current.write_text((ROOT / "docs" / "cli.md").read_text())
    changed = reference.koda_command()
    ctx = Context(changed, info_name="koda")
    runs = dict(reference.subcommands(changed, ctx))["runs"]
    submit = dict(reference.subcommands(runs, Context(runs, info_name="runs", parent=ctx)))[
        "submit"
    ]
    submit.help = "Submit a run, said differently."
    assert reference.main(["--check", str(current)], command=changed) == 1
    # writing brings the file up to date with the changed app, and the check passes again
    assert reference.main([str(current)], command=changed) == 0
    assert "Submit a run, said differently." in current.read_text()
    assert reference.main(["--check", str(current)], command=changed) == 0
    assert reference.main(["--check", str(current)]) == 1


def test_a_new_option_or_command_changes_the_reference() -> None:
    app = typer.Typer(help="A small app.")

    @app.command()
    def hello(name: str, loud: bool = typer.Option(False, "--loud", help="Shout it.")) -> None:
        """Say hello."""

    before = reference.render(typer.main.get_command(app), name="demo")
    assert "Say hello." in before and "`--loud`" in before and "Shout it." in before

    @app.command()
    def bye(times: int = typer.Option(1, "--times", help="How often.")) -> None:
        """Say goodbye."""

    after = reference.render(typer.main.get_command(app), name="demo")
    assert after != before
    assert "## `demo bye`" in after and "(default: `1`)" in after


def test_the_reference_does_not_depend_on_the_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    first = reference.render(reference.koda_command())
    monkeypatch.setenv("COLUMNS", "40")
    monkeypatch.setenv("TERM", "xterm-256color")
    monkeypatch.setenv("FORCE_COLOR", "1")
    assert reference.render(reference.koda_command()) == first
    assert "\x1b[" not in first


def test_the_settings_reference_is_rendered_from_the_declarations(tmp_path: Path) -> None:
    doc = (ROOT / "docs" / "settings.md").read_text()
    assert settingsdoc.rendered(doc) == doc, "run python -m koda_runtime.settingsdoc"
    assert settingsdoc.main(["--check", str(ROOT / "docs" / "settings.md")]) == 0
    stale = tmp_path / "settings.md"
    stale.write_text(doc.replace("| `KODA_PARTITIONS` | `32` |", "| `KODA_PARTITIONS` | `16` |"))
    assert settingsdoc.main(["--check", str(stale)]) == 1


def test_readme_and_architecture_fit_on_a_screen() -> None:
    readme = (ROOT / "README.md").read_bytes()
    architecture = (ROOT / "ARCHITECTURE.md").read_bytes()
    assert len(readme) <= README_MAX, f"README.md is {len(readme)} bytes (at most {README_MAX})"
    assert len(architecture) <= ARCHITECTURE_MAX, (
        f"ARCHITECTURE.md is {len(architecture)} bytes (at most {ARCHITECTURE_MAX})"
    )


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def relative_links(path: Path) -> list[str]:
    """The targets of the Markdown links of ``path`` that name a file of the checkout
    (no scheme, no pure anchor), outside code blocks and code spans."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    found = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue
        found.append(target.split("#", 1)[0])
    return found


def documents() -> list[Path]:
    return [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_every_relative_link_leads_to_a_file() -> None:
    broken = [
        f"{doc.relative_to(ROOT)} -> {target}"
        for doc in documents()
        for target in relative_links(doc)
        if not (doc.parent / target).exists()
    ]
    assert broken == []
    assert sum(len(relative_links(doc)) for doc in documents()) > 40


def test_the_link_check_sees_a_broken_link(tmp_path: Path) -> None:
    doc = tmp_path / "x.md"
    (tmp_path / "there.md").write_text("#\n")
    doc.write_text(
        "[ok](there.md) [gone](missing.md#part) [web](https://example.com) [anchor](#a)\n"
        "`[code](nope.md)`\n```\n[fenced](nope2.md)\n```\n![img](pic.png)\n"
    )
    targets = relative_links(doc)
    assert targets == ["there.md", "missing.md", "pic.png"]
    assert [t for t in targets if not (tmp_path / t).exists()] == ["missing.md", "pic.png"]


def test_every_decision_is_in_the_index() -> None:
    decisions = ROOT / "docs" / "decisions"
    index = (decisions / "README.md").read_text()
    files = sorted(p.name for p in decisions.glob("[0-9][0-9][0-9][0-9]-*.md"))
    assert files, "no decision records"
    numbers = [f[:4] for f in files]
    assert numbers == [f"{n:04d}" for n in range(1, len(files) + 1)], "numbers with a gap"
    for name in files:
        assert f"]({name})" in index, name
