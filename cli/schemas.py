"""``koda schemas write [--check]``: the JSON Schemas of koda's records."""

from __future__ import annotations

from pathlib import Path

import typer

from koda_runtime.cli.common import friendly

schemas_app = typer.Typer(no_args_is_help=True, help="JSON Schemas of koda's records.")

SCHEMAS_OUT = typer.Option(
    None,
    "--out",
    help="Write into this folder (default: topics/records/json of the source checkout).",
)


@schemas_app.command("write")
@friendly
def schemas_write(
    check: bool = typer.Option(False, "--check", help="Write nothing; exit 1 on drift."),
    out: Path | None = SCHEMAS_OUT,
) -> None:
    """Regenerate topics/records/json/*.schema.json from the record specs."""
    from koda_runtime import resources
    from koda_runtime.topics.records.json_schemas import DIRECTORY, drift, write_all

    if check:
        directory = out or DIRECTORY
        stale = drift(directory)
        for name in stale:
            typer.echo(f"drift: {directory / name}")
        if stale:
            raise typer.Exit(1)
        typer.echo("JSON Schemas match the record specs")
        return
    directory = out or resources.checkout_path(
        "topics", "records", "json", what="koda schemas write"
    )
    for path in write_all(directory):
        typer.echo(f"wrote {path}")
    typer.echo(f"JSON Schemas up to date in {directory}")
