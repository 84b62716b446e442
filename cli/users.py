"""``koda users erase USER [--yes]``: operators erase one user (gateway/erasure.py)."""

from __future__ import annotations

import asyncio
import getpass
import json

import typer

from koda_runtime.gateway.erasure import Eraser, Receipt, RunsStillOpen
from koda_runtime.naming import AppEnv
from koda_runtime.schemas.db import async_engine
from koda_runtime.settings import USER_ID, Settings
from koda_runtime.topics.kafka.publisher import RunPublisher

users_app = typer.Typer(no_args_is_help=True, help="Users: erase one.")


@users_app.callback()
def users() -> None:
    """Users: erase one (a group, so `erase` stays a subcommand however many there are)."""


STOP_TIMEOUT_S = 10.0


def _operator() -> str:
    try:
        return f"cli:{getpass.getuser()}"
    except (KeyError, OSError):  # no login name (a container without a passwd entry)
        return "cli"


@users_app.command("erase")
def users_erase(
    user: str = typer.Argument(..., metavar="USER", help="The user id to erase."),
    yes: bool = typer.Option(False, "--yes", help="Do not ask for confirmation."),
    by: str | None = typer.Option(
        None, "--by", help="Who asks (kept in the receipt); default: cli:<login name>."
    ),
    confirm_prod: bool = typer.Option(False, "--confirm-prod", help="Required in prod."),
) -> None:
    """Erase USER: cancel their open runs, delete their runs, output, sessions, memories,
    schedules, budgets and period spend, tombstone their chunk records, keep their ledger
    rows under a pseudonym, and print the receipt (JSON). Exit 1 when runs did not end
    within KODA_ERASURE_WAIT_S (named); erase again."""
    if not USER_ID.fullmatch(user):
        typer.echo(f"koda: USER must be 1-128 chars of A-Z a-z 0-9 . _ @ -, got {user!r}", err=True)
        raise typer.Exit(2)
    requested_by = by if by is not None else _operator()
    if not 0 < len(requested_by) <= 200 or not requested_by.isprintable():
        typer.echo("koda: --by must be 1-200 printable chars", err=True)
        raise typer.Exit(2)
    settings = Settings.from_env()
    if settings.app_env is AppEnv.PROD and not confirm_prod:
        typer.echo("koda: `koda users erase` in APP_ENV=prod needs --confirm-prod", err=True)
        raise typer.Exit(2)
    if not yes:
        typer.confirm(
            f"Erase user {user} in {settings.app_env.value}"
            f"{f' (namespace {settings.namespace})' if settings.namespace else ''}? "
            "This cannot be undone",
            abort=True,
        )
    try:
        receipt = asyncio.run(_erase(settings, user, requested_by))
    except RunsStillOpen as exc:
        typer.echo(f"koda: {exc}", err=True)
        raise typer.Exit(1) from exc
    typer.echo(json.dumps(_receipt_json(receipt), indent=2))


async def _erase(settings: Settings, user: str, requested_by: str) -> Receipt:
    engine = async_engine(settings, pool_size=2)
    publisher = RunPublisher(settings)
    try:
        await publisher.start()
        return await Eraser(engine, settings, publisher.send).erase(user, requested_by)
    finally:
        await publisher.stop(STOP_TIMEOUT_S)
        await engine.dispose()


def _receipt_json(r: Receipt) -> dict[str, object]:
    return {
        "erasure_id": r.id,
        "user_digest": r.user_digest,
        "pseudonym": r.pseudonym,
        "requested_at": r.requested_at.isoformat(),
        "completed_at": r.completed_at.isoformat(),
        "counts": r.counts,
        "requested_by": r.requested_by,
    }
