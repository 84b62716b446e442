"""``koda prices set|list``: model prices for the cost ledger (USD per million tokens)."""

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
    usd,
)

prices_app = typer.Typer(no_args_is_help=True, help="Model prices (USD per million tokens).")


def _model(name: str) -> str:
    if not 0 < len(name) <= 200 or not name.isprintable() or name != name.strip():
        raise LedgerInputError(f"MODEL must be 1-200 printable chars without edge spaces: {name!r}")
    return name


@prices_app.command("set")
@friendly
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
    p, c = usd(prompt, "--prompt"), usd(completion, "--completion")
    cp = None if cached is None else usd(cached, "--cached-prompt")
    rp = None if reasoning is None else usd(reasoning, "--reasoning")
    at = time_of(start, "--from", now_ok=True)
    try:
        price = run_on_ledger(
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


@prices_app.command("list")
@friendly
def prices_list(
    model: str | None = typer.Option(None, "--model", help="Only this model."),
    fmt: str = typer.Option("table", "--format", help="table, csv or json."),
) -> None:
    """Every price, oldest first per model (history is never rewritten)."""
    from koda_runtime.schemas.ledger import list_prices

    check_format(fmt)
    prices = run_on_ledger(lambda conn: list_prices(conn, model))
    rows = [p.as_json() for p in prices]
    if fmt == "json":
        typer.echo(json.dumps({"prices": rows}, indent=2))
        return
    typer.echo(render_rows(rows, fmt, empty="no prices"))
