"""``koda db upgrade``: the environment's Postgres schema and its migrations."""

from __future__ import annotations

import typer

from koda_runtime.cli.common import friendly, load_settings

db_app = typer.Typer(no_args_is_help=True, help="Database migrations.")


@db_app.command("upgrade")
@friendly
def db_upgrade(revision: str = typer.Argument("head")) -> None:
    """Create the schema if missing and apply migrations up to REVISION."""
    from koda_runtime.schemas.migrate import upgrade

    settings = load_settings(database=True)
    upgrade(settings, revision)
    typer.echo(f"database schema {settings.names.pg_schema()} at {revision}")
