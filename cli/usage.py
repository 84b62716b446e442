"""``koda usage report``: usage and spend per user, day, model or kind, from the ledger."""

from __future__ import annotations

import json

import typer

from koda_runtime.cli.common import (
    LedgerInputError,
    check_format,
    friendly,
    render_rows,
    run_on_ledger,
    time_of,
)
from koda_runtime.lifecycle.ledger import check_window

usage_app = typer.Typer(no_args_is_help=True, help="Usage and spend reports from the ledger.")


@usage_app.command("report")
@friendly
def usage_report(
    by: str = typer.Option(..., "--by", help="user, day, model or kind."),
    start: str | None = typer.Option(None, "--from", help="From (inclusive), ISO 8601."),
    end: str | None = typer.Option(None, "--to", help="To (exclusive), ISO 8601."),
    user: str | None = typer.Option(None, "--user", help="Only this user."),
    fmt: str = typer.Option("table", "--format", help="table, csv or json."),
) -> None:
    """Cost, tokens, calls and runs per group, with unit costs and failed/cancelled spend."""
    from koda_runtime.schemas.ledger import GROUPS
    from koda_runtime.schemas.ledger import usage_report as report_of

    if by not in GROUPS:
        raise LedgerInputError(f"--by must be one of {', '.join(GROUPS)}, got {by!r}")
    check_format(fmt)
    since, until = time_of(start, "--from"), time_of(end, "--to")
    try:
        check_window(since, until)
    except ValueError as exc:
        raise LedgerInputError(str(exc)) from None
    report = run_on_ledger(lambda conn: report_of(conn, by, user_id=user, since=since, until=until))
    if fmt == "json":
        typer.echo(json.dumps(report, indent=2))
        return
    key = {"user": "user_id"}.get(by, by)
    rows = [*report["rows"], {key: "TOTAL", **report["totals"]}]
    typer.echo(render_rows(rows, fmt, empty="no ledger rows"))
