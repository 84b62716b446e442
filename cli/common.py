"""What the ``koda`` commands share: the one-line error exit, the settings they load,
the prod guard, and the cost-ledger commands' (prices, budgets, usage) value parsing
and tables.

Errors a user can hit print one line naming the problem and the fix, and exit 2.
"""

from __future__ import annotations

import asyncio
import csv
import io
from collections.abc import Awaitable, Callable
from datetime import datetime
from decimal import Decimal
from functools import wraps
from typing import Any, TypeVar

import typer

from koda_runtime.errors import KodaError
from koda_runtime.lifecycle.ledger import parse_time, parse_usd
from koda_runtime.settings import Settings

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")

CONFIRM_PROD = typer.Option(False, "--confirm-prod", help="Required in prod.")


def fail(message: str) -> None:
    typer.echo(f"koda: {message}", err=True)
    raise typer.Exit(2)


def friendly(fn: F) -> F:
    """Turn KodaError into a one-line message and exit status 2."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except KodaError as exc:
            fail(str(exc))

    return wrapper  # type: ignore[return-value]


def load_settings(*, kafka: bool = False, database: bool = False, login: bool = False) -> Settings:
    """The settings; with ``kafka`` / ``database``, after checking that the broker /
    database answers (one line naming the address and its origin when not); with
    ``login`` (services, and commands that use Kafka without the reach check), after
    checking that no broker refuses koda's TLS handshake or SASL login (a broker that
    does not answer is an outage they ride out)."""
    from koda_runtime import reach

    settings = Settings.from_env()
    if kafka:
        reach.require_kafka(settings)
    if login:
        from koda_runtime.kafka import require_login

        require_login(settings)
    if database:
        reach.require_database(settings)
    return settings


def guarded_settings(confirm_prod: bool, what: str) -> Settings:
    """The Kafka settings, after refusing ``koda <what>`` in prod without ``--confirm-prod``."""
    from koda_runtime import reach

    settings = load_settings()
    require_confirmation(settings, confirm_prod, what)
    reach.require_kafka(settings)
    return settings


def require_confirmation(settings: Settings, confirmed: bool, what: str) -> None:
    """Destructive or shared-state commands demand ``--confirm-prod`` in prod."""
    from koda_runtime.naming import AppEnv

    if settings.app_env is AppEnv.PROD and not confirmed:
        raise KodaError(f"`koda {what}` in APP_ENV=prod needs --confirm-prod")


# The cost-ledger commands (cli/prices.py, cli/budgets.py, cli/usage.py). Every command
# talks to the environment's Postgres schema; bad input prints one line naming what was
# wrong and exits 2, having written nothing.

FORMATS = ("table", "csv", "json")


class LedgerInputError(KodaError):
    """A command-line value the ledger commands cannot use."""


def run_on_ledger(work: Callable[[Any], Awaitable[T]]) -> T:
    """Run ``work(conn)`` in one transaction on the environment's database."""

    from koda_runtime.schemas.db import async_engine, failing_as

    async def main() -> T:
        engine = async_engine(Settings.from_env(), pool_size=1)
        try:
            with failing_as("postgres", "is the database up and migrated? `koda db upgrade`"):
                async with engine.begin() as conn:
                    return await work(conn)
        finally:
            await engine.dispose()

    return asyncio.run(main())


def usd(raw: str, flag: str) -> Decimal:
    try:
        return parse_usd(raw, flag)
    except ValueError as exc:
        raise LedgerInputError(str(exc)) from None


def time_of(raw: str | None, flag: str, *, now_ok: bool = False) -> datetime | None:
    if raw is None or (now_ok and raw.strip().lower() == "now"):
        return None
    try:
        return parse_time(raw, flag)
    except ValueError as exc:
        raise LedgerInputError(str(exc)) from None


def check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise LedgerInputError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")


def render_rows(rows: list[dict[str, Any]], fmt: str, *, empty: str) -> str:
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
