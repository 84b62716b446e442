"""``koda retention sweep [--every S] [--dry-run]``: Postgres retention for operators.

One pass deletes (or, ``--dry-run``, counts) what ``KODA_CHUNK_RETENTION``,
``KODA_RUN_RETENTION`` and ``KODA_LEDGER_RETENTION`` let go (processors/retention.py),
and prints one line: runs collapsed and rows deleted per table. ``--every S`` repeats
until SIGTERM or Ctrl-C, a log line per pass. The chunk-upkeep role runs the same loop
inside ``koda chunks compact --every S``, so a deployment needs no process of its own.
"""

from __future__ import annotations

import typer

from koda_runtime.cli.common import fail, friendly, load_settings

retention_app = typer.Typer(no_args_is_help=True, help="Postgres retention (chunks, runs, ledger).")


@retention_app.command("sweep")
@friendly
def sweep(
    every: float | None = typer.Option(
        None, "--every", min=1, help="Repeat every S seconds until interrupted."
    ),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="Count what one pass would delete; write nothing."
    ),
) -> None:
    """Collapse expired chunks, delete expired runs and ledger months, in small batches."""
    from koda_runtime.processors.retention import RetentionSweeper

    if every is not None and dry_run:
        fail("--dry-run counts one pass: leave out --every")
    settings = load_settings(database=True)
    sweeper = RetentionSweeper(settings)
    try:
        if every is not None:
            from koda_runtime.logs import configure_logging
            from koda_runtime.stopping import stop_on_signals

            configure_logging()
            with stop_on_signals() as stop:
                sweeper.run_forever(every, should_stop=stop.is_set)
            return
        report = sweeper.sweep_once(dry_run=dry_run)
    finally:
        sweeper.close()
    verb = "would collapse" if dry_run else "collapsed"
    done = "to delete" if dry_run else "deleted"
    rows = ", ".join(f"{table} {n}" for table, n in report.deleted.items())
    typer.echo(f"{verb} {report.collapsed} runs' chunks; rows {done}: {rows}")
