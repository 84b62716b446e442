"""``koda replay``: koda's topics into a warehouse (topics/replay/)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import typer

from koda_runtime.cli.common import friendly, load_settings


def register(app: typer.Typer) -> None:
    """Add ``koda replay`` to ``app``."""
    app.command("replay")(replay_command)


@friendly
def replay_command(
    topic: list[str] | None = typer.Argument(  # noqa: B008 - typer's idiom
        None, help="runs, run-events, run-chunks, runs-dlq (default: all four)."
    ),
    to: str = typer.Option(
        "duckdb:///warehouse.duckdb",
        "--to",
        help="duckdb:///FILE, postgresql://USER@HOST/DB[?schema=S], parquet:///DIR,"
        " iceberg:///DIR or iceberg+rest://HOST:PORT/PATH.",
    ),
    start: str | None = typer.Option(None, "--from", help="earliest (the default)."),
    from_timestamp: str | None = typer.Option(
        None, "--from-timestamp", help="ISO 8601 date/time, unix seconds, or an age like -2h."
    ),
    from_offsets: Path | None = typer.Option(  # noqa: B008 - typer's idiom
        None, "--from-offsets", help="File of '<topic> <partition> <offset>' lines."
    ),
    job: str | None = typer.Option(
        None, "--job", help="A named job: resumes where it stopped (its own consumer group)."
    ),
    follow: bool = typer.Option(False, "--follow", help="Keep reading new records until stopped."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Read and count; write nothing."),
    batch: int | None = typer.Option(
        None, "--batch", min=1, help="Records per sink transaction (default 40,000)."
    ),
    max_rate: float | None = typer.Option(
        None, "--max-rate", min=1, help="At most this many records/s (spares the brokers)."
    ),
    save_offsets: Path | None = typer.Option(  # noqa: B008 - typer's idiom
        None, "--save-offsets", help="Write where it stopped, for --from-offsets."
    ),
    quiet: bool = typer.Option(False, "--quiet", help="No progress line."),
    postgres: bool = typer.Option(
        True,
        "--postgres/--no-postgres",
        help="With the runs topic, also export run inputs, merges, schedules and memories"
        " from Postgres (docs/data-dictionary.md).",
    ),
) -> None:
    """Replay koda's topics into a warehouse; idempotent (upserts on natural keys)."""
    from koda_runtime.stopping import stop_on_signals
    from koda_runtime.topics.replay import Progress, ReplayOptions, run_replay, start_spec

    settings = load_settings(login=True)
    options = ReplayOptions(
        topics=tuple(topic or ()),
        start=start_spec(settings.names, start, from_timestamp, from_offsets),
        sink_url=to,
        job=job,
        follow=follow,
        dry_run=dry_run,
        max_rate=max_rate,
        save_offsets=save_offsets,
        with_postgres=postgres,
    )
    if batch is not None:
        options = dataclasses.replace(options, batch_records=batch)
    with stop_on_signals() as stop:
        summary = run_replay(settings, options, progress=Progress(enabled=not quiet), stop=stop)
    typer.echo("\n".join(summary.lines()))
    if summary.stopped:
        raise typer.Exit(130)
