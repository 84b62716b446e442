"""``koda budgets set|list``: per-user spend budgets (USD) of the cost ledger."""

from __future__ import annotations

import json
from decimal import Decimal

import typer

from koda_runtime.cli.common import (
    LedgerInputError,
    check_format,
    friendly,
    render_rows,
    run_on_ledger,
    usd,
)

budgets_app = typer.Typer(no_args_is_help=True, help="Per-user spend budgets (USD).")


@budgets_app.command("set")
@friendly
def budgets_set(
    user: str = typer.Argument(..., help="The user id."),
    monthly: str | None = typer.Option(None, "--monthly", help="USD per calendar month (UTC)."),
    daily: str | None = typer.Option(None, "--daily", help="USD per calendar day (UTC)."),
    soft: str = typer.Option("0.8", "--soft", help="Share of a budget that raises an alert."),
) -> None:
    """Set (replace) a user's budgets; a new run over a spent budget is refused (402)."""
    from koda_runtime.schemas.ledger import set_budget

    if not 0 < len(user) <= 128 or not user.isprintable():
        raise LedgerInputError(f"USER must be 1-128 printable chars: {user!r}")
    if monthly is None and daily is None:
        raise LedgerInputError("give --monthly and/or --daily")
    m = None if monthly is None else usd(monthly, "--monthly")
    d = None if daily is None else usd(daily, "--daily")
    ratio = usd(soft, "--soft")
    if not 0 < ratio <= 1 or ratio != ratio.quantize(Decimal("0.001")):
        raise LedgerInputError(f"--soft must be in (0, 1] with at most 3 decimals, got {soft!r}")
    budget = run_on_ledger(lambda conn: set_budget(conn, user, m, d, ratio))
    typer.echo(json.dumps(budget.as_json()))


@budgets_app.command("list")
@friendly
def budgets_list(fmt: str = typer.Option("table", "--format", help="table, csv or json.")) -> None:
    """Every user's budgets with this month's and today's spend."""
    from koda_runtime.schemas.ledger import list_budgets

    check_format(fmt)
    rows = [b.as_json() for b in run_on_ledger(lambda conn: list_budgets(conn))]
    if fmt == "json":
        typer.echo(json.dumps({"budgets": rows}, indent=2))
        return
    typer.echo(render_rows(rows, fmt, empty="no budgets"))
