"""``koda prices``, ``koda budgets`` and ``koda usage``: the cost ledger for operators.

Every command talks to the environment's Postgres schema; bad input prints one line
naming what was wrong and exits 2, having written nothing.
"""

from __future__ import annotations

import asyncio
import csv
import io
import json
from collections.abc import Awaitable, Callable
from datetime import datetime
from decimal import Decimal
from typing import Any, TypeVar

import typer

from koda_runtime.errors import KodaError
from koda_runtime.lifecycle.ledger import check_window, parse_time, parse_usd

T = TypeVar("T")

prices_app = typer.Typer(no_args_is_help=True, help="Model prices (USD per million tokens).")
budgets_app = typer.Typer(no_args_is_help=True, help="Per-user spend budgets (USD).")
usage_app = typer.Typer(no_args_is_help=True, help="Usage and spend reports from the ledger.")
_COMMANDS: list[tuple[typer.Typer, str, Callable[..., None]]] = []


def _command(group: typer.Typer, name: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    def note(fn: Callable[..., None]) -> Callable[..., None]:
        _COMMANDS.append((group, name, fn))
        return fn

    return note


def register(app: typer.Typer, wrap: Callable[[Callable[..., None]], Callable[..., None]]) -> None:
    """Add ``prices``, ``budgets`` and ``usage`` to ``app``; ``wrap`` turns KodaError into
    the CLI's one-line message (koda_runtime.cli.friendly)."""
    for group, name, fn in _COMMANDS:
        group.command(name)(wrap(fn))
    app.add_typer(prices_app, name="prices")
    app.add_typer(budgets_app, name="budgets")
    app.add_typer(usage_app, name="usage")


FORMATS = ("table", "csv", "json")


class LedgerInputError(KodaError):
    """A command-line value the ledger commands cannot use."""


def _run(work: Callable[[Any], Awaitable[T]]) -> T:
    """Run ``work(conn)`` in one transaction on the environment's database."""

    from koda_runtime.schemas.db import async_engine, failing_as
    from koda_runtime.settings import Settings

    async def main() -> T:
        engine = async_engine(Settings.from_env(), pool_size=1)
        try:
            with failing_as("postgres", "is the database up and migrated? `koda db upgrade`"):
                async with engine.begin() as conn:
                    return await work(conn)
        finally:
            await engine.dispose()

    return asyncio.run(main())


def _usd(raw: str, flag: str) -> Decimal:
    try:
        return parse_usd(raw, flag)
    except ValueError as exc:
        raise LedgerInputError(str(exc)) from None


def _time(raw: str | None, flag: str, *, now_ok: bool = False) -> datetime | None:
    if raw is None or (now_ok and raw.strip().lower() == "now"):
        return None
    try:
        return parse_time(raw, flag)
    except ValueError as exc:
        raise LedgerInputError(str(exc)) from None


def _model(name: str) -> str:
    if not 0 < len(name) <= 200 or not name.isprintable() or name != name.strip():
        raise LedgerInputError(f"MODEL must be 1-200 printable chars without edge spaces: {name!r}")
    return name


@_command(prices_app, "set")
def prices_set(
    model: str = typer.Argument(..., help="The model name the handlers report."),
    prompt: str = typer.Option(..., "--prompt", help="USD per million prompt tokens."),
    completion: str = typer.Option(..., "--completion", help="USD per million completion tokens."),
    cached: str | None = typer.Option(
        None,
        "--cached-prompt",
        help="USD per million cached input tokens (default: the --prompt price).",
    ),
    reasoning: str | None = typer.Option(
        None,
        "--reasoning",
        help="USD per million reasoning tokens (default: the --completion price).",
    ),
    start: str = typer.Option(
        "now", "--from", help="When it applies from: ISO 8601 (no zone = UTC), or now."
    ),
) -> None:
    """Add a price from a time on; earlier calls keep the price they were written with."""
    from koda_runtime.schemas.ledger import PriceRefused, set_price

    name = _model(model)
    p, c = _usd(prompt, "--prompt"), _usd(completion, "--completion")
    cp = None if cached is None else _usd(cached, "--cached-prompt")
    rp = None if reasoning is None else _usd(reasoning, "--reasoning")
    at = _time(start, "--from", now_ok=True)
    try:
        price = _run(
            lambda conn: set_price(
                conn, name, p, c, at, cached_prompt_usd_per_mtok=cp, reasoning_usd_per_mtok=rp
            )
        )
    except PriceRefused as exc:
        raise LedgerInputError(str(exc)) from None
    extra = ""
    if price.cached_prompt_usd_per_mtok is not None:
        extra += f" cached prompt {price.cached_prompt_usd_per_mtok}"
    if price.reasoning_usd_per_mtok is not None:
        extra += f" reasoning {price.reasoning_usd_per_mtok}"
    typer.echo(
        f"price {price.id}: {price.model} from {price.effective_from.isoformat()} "
        f"prompt {price.prompt_usd_per_mtok} completion {price.completion_usd_per_mtok}"
        f"{extra} USD/Mtok"
    )


@_command(prices_app, "list")
def prices_list(
    model: str | None = typer.Option(None, "--model", help="Only this model."),
    fmt: str = typer.Option("table", "--format", help="table, csv or json."),
) -> None:
    """Every price, oldest first per model (history is never rewritten)."""
    from koda_runtime.schemas.ledger import list_prices

    _format(fmt)
    prices = _run(lambda conn: list_prices(conn, model))
    rows = [p.as_json() for p in prices]
    if fmt == "json":
        typer.echo(json.dumps({"prices": rows}, indent=2))
        return
    typer.echo(_render(rows, fmt, empty="no prices"))


@_command(budgets_app, "set")
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
    m = None if monthly is None else _usd(monthly, "--monthly")
    d = None if daily is None else _usd(daily, "--daily")
    ratio = _usd(soft, "--soft")
    if not 0 < ratio <= 1 or ratio != ratio.quantize(Decimal("0.001")):
        raise LedgerInputError(f"--soft must be in (0, 1] with at most 3 decimals, got {soft!r}")
    budget = _run(lambda conn: set_budget(conn, user, m, d, ratio))
    typer.echo(json.dumps(budget.as_json()))


@_command(budgets_app, "list")
def budgets_list(fmt: str = typer.Option("table", "--format", help="table, csv or json.")) -> None:
    """Every user's budgets with this month's and today's spend."""
    from koda_runtime.schemas.ledger import list_budgets

    _format(fmt)
    rows = [b.as_json() for b in _run(lambda conn: list_budgets(conn))]
    if fmt == "json":
        typer.echo(json.dumps({"budgets": rows}, indent=2))
        return
    typer.echo(_render(rows, fmt, empty="no budgets"))


@_command(usage_app, "report")
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
    _format(fmt)
    since, until = _time(start, "--from"), _time(end, "--to")
    try:
        check_window(since, until)
    except ValueError as exc:
        raise LedgerInputError(str(exc)) from None
    report = _run(lambda conn: report_of(conn, by, user_id=user, since=since, until=until))
    if fmt == "json":
        typer.echo(json.dumps(report, indent=2))
        return
    key = {"user": "user_id"}.get(by, by)
    rows = [*report["rows"], {key: "TOTAL", **report["totals"]}]
    typer.echo(_render(rows, fmt, empty="no ledger rows"))


def _format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise LedgerInputError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")


def _render(rows: list[dict[str, Any]], fmt: str, *, empty: str) -> str:
    if not rows:
        return empty
    cols = list(rows[0])
    if fmt == "csv":
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=cols, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        return out.getvalue().rstrip("\n")
    cells = [[("" if r.get(c) is None else str(r.get(c))) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(line.rstrip() for line in lines)
