"""docs/cli.md, the command reference, generated from the ``koda`` Typer app.

``python -m koda_runtime.cli.reference [--check] [FILE]`` writes every command and
subcommand of ``koda`` (the root app with the groups ``_add_optional_apps`` attaches)
with its usage, arguments, options and help text into FILE (default: the checkout's
docs/cli.md); ``--check`` writes nothing and exits 1 when FILE differs from what the
app gives now (tests/unit/test_docs_fresh.py runs the same comparison).

The output depends on nothing but the app: the text is built from the command and
parameter objects Typer builds (its own click-compatible core, ``typer._click``), never
from a terminal-width help formatter or rich markup.
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import typer.main
from typer._click.core import Command, Context, Parameter

DOC = Path(__file__).resolve().parents[1] / "docs" / "cli.md"
HEADER = (
    "# The `koda` command reference\n\n"
    "Generated from the CLI (`cli/`) by `python -m koda_runtime.cli.reference`; do not edit.\n"
    "`python -m koda_runtime.cli.reference --check` (and tests/unit/test_docs_fresh.py) fails\n"
    "when this file is stale. `koda <command> --help` prints the same text.\n"
)


def koda_command() -> Command:
    """The whole ``koda`` command as Typer builds it, optional groups included.

    ``_add_optional_apps`` attaches its groups to the module's app; the registration is
    put back as it was, so building the reference changes nothing for the caller."""
    from koda_runtime import cli

    groups = list(cli.app.registered_groups)
    try:
        cli._add_optional_apps()
        return typer.main.get_command(cli.app)
    finally:
        cli.app.registered_groups = groups


def render(command: Command, name: str = "koda") -> str:
    """The Markdown reference of ``command`` and every subcommand, depth first, by name."""
    parts = [HEADER]
    _render(command, Context(command, info_name=name), parts)
    return "\n".join(parts)


def subcommands(command: Command, ctx: Context) -> list[tuple[str, Command]]:
    """The visible subcommands of ``command`` (a group) by name; none for a command."""
    lister = getattr(command, "list_commands", None)
    getter = getattr(command, "get_command", None)
    if lister is None or getter is None:
        return []
    found = []
    for name in sorted(lister(ctx)):
        sub = getter(ctx, name)
        if sub is not None and not sub.hidden:
            found.append((name, sub))
    return found


def _render(command: Command, ctx: Context, parts: list[str]) -> None:
    path = ctx.command_path
    depth = min(path.count(" ") + 2, 4)
    parts.append(f"{'#' * depth} `{path}`\n")
    usage = " ".join([path, *command.collect_usage_pieces(ctx)])
    parts.append(f"```\n{usage}\n```\n")
    text = _help(command)
    if text:
        parts.append(text + "\n")
    arguments = [p for p in command.params if p.param_type_name == "argument"]
    options = [
        p
        for p in command.params
        if p.param_type_name == "option" and not getattr(p, "hidden", False)
    ]
    if arguments:
        parts.append("Arguments:\n\n" + "\n".join(_argument(p) for p in arguments) + "\n")
    if options:
        parts.append("Options:\n\n" + "\n".join(_option(p, ctx) for p in options) + "\n")
    subs = subcommands(command, ctx)
    if subs:
        parts.append(
            "Commands:\n\n" + "\n".join(f"* `{n}`: {_first_line(c)}" for n, c in subs) + "\n"
        )
    for n, c in subs:
        _render(c, Context(c, info_name=n, parent=ctx), parts)


def _help(command: Command) -> str:
    return inspect.cleandoc(command.help or "").replace("\b\n", "").strip()


def _first_line(command: Command) -> str:
    return (command.short_help or _help(command).split("\n\n")[0]).replace("\n", " ").strip()


def _argument(p: Parameter) -> str:
    name = (p.metavar or p.name or "").upper()
    required = "required" if p.required else "optional"
    if p.nargs == -1:
        required += ", any number"
    text = f"* `{name}` ({required})"
    help_text = getattr(p, "help", None)
    if help_text:
        text += f": {_one_line(help_text)}"
    return text + _default(p)


def _option(p: Parameter, ctx: Context) -> str:
    names = ", ".join(f"`{o}`" for o in [*p.opts, *p.secondary_opts])
    text = f"* {names}"
    if not (getattr(p, "is_flag", False) or getattr(p, "count", False)):
        text += f" `{_value_name(p, ctx)}`"
    if p.multiple:
        text += " (repeatable)"
    if p.required:
        text += " (required)"
    help_text = getattr(p, "help", None)
    if help_text:
        text += f": {_one_line(help_text)}"
    return text + _default(p)


def _value_name(p: Parameter, ctx: Context) -> str:
    if p.metavar:
        return p.metavar
    shown = getattr(p, "display_type", None)
    name = shown(ctx) if shown is not None else None
    return name or (p.name or "value").upper()


def _default(p: Parameter) -> str:
    default = p.default
    if default is None or callable(default) or default == () or default is False:
        return ""
    if getattr(p, "is_flag", False) and default is True:
        return " (default: on)"
    if isinstance(default, (list, tuple)):
        default = ", ".join(str(d) for d in default)
    return f" (default: `{default}`)"


def _one_line(text: str) -> str:
    return " ".join(text.split())


def main(argv: list[str], command: Command | None = None) -> int:
    paths = [a for a in argv if a != "--check"]
    doc = Path(paths[0]) if paths else DOC
    fresh = render(command if command is not None else koda_command())
    if "--check" in argv:
        if not doc.exists() or doc.read_text() != fresh:
            print(f"{doc}: stale; run python -m koda_runtime.cli.reference")
            return 1
        return 0
    doc.write_text(fresh)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
