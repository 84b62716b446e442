"""The ``koda`` command: services, topics, db, gateway, worker, runs, replay, dlq, schemas.

Errors a user can hit print one line naming the problem and the fix, and exit 2.
"""

from __future__ import annotations

import importlib
import sys

import typer

from koda_runtime.cli.processes import COMPACTOR_EVERY_S
from koda_runtime.errors import KodaError

__all__ = ["COMPACTOR_EVERY_S", "app", "main"]

app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__)

# Every `koda` command and group, in the order `koda --help` lists them. `koda N` is
# declared in koda_runtime.cli.N: a group as its Typer app `N_app`, a command (or, for
# `processes`, the process commands) by its `register(app)`.
COMMANDS = ("replay", "processes")
GROUPS = (
    "topics",
    "db",
    "chunks",
    "dlq",
    "schemas",
    "webhooks",
    "traces",
    "prices",
    "budgets",
    "usage",
    "retention",
)
# Attached by main() (and the reference) only: they load the HTTP client, the gateway's
# stores or the local stack, which the commands above do not need.
STARTUP_GROUPS = ("services", "runs", "memories", "schedules", "users")


def _add_groups(names: tuple[str, ...]) -> None:
    for name in names:
        module = importlib.import_module(f"{__name__}.{name}")
        app.add_typer(getattr(module, f"{name}_app"), name=name)


def _add_optional_apps() -> None:
    _add_groups(STARTUP_GROUPS)


for _name in COMMANDS:
    importlib.import_module(f"{__name__}.{_name}").register(app)
_add_groups(GROUPS)


def main() -> None:
    _add_optional_apps()
    try:
        app()
    except KodaError as exc:
        typer.echo(f"koda: {exc}", err=True)
        sys.exit(2)
