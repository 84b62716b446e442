"""``koda memories list|delete|forget --user U``: operators read and forget a user's memories."""

from __future__ import annotations

import asyncio

import typer

from koda_runtime.db import async_engine
from koda_runtime.schemas.memories import LIST_LIMIT, forget, forget_many, list_for
from koda_runtime.settings import Settings

memories_app = typer.Typer(no_args_is_help=True, help="Users' long-term memories.")


@memories_app.command("list")
def memories_list(
    user: str = typer.Option(..., "--user", help="The user whose memories to list."),
) -> None:
    """One line per memory of USER, newest first: ID, created, source run, text."""

    async def run() -> int:
        engine = async_engine(Settings.from_env(), pool_size=1)
        shown = 0
        try:
            after = None
            while True:  # page by page, so every memory is listed however many
                page = await list_for(engine, user, LIST_LIMIT, after)
                for m in page:
                    typer.echo(f"{m.id}\t{m.created_at.isoformat()}\t{m.run_id or '-'}\t{m.text}")
                shown += len(page)
                if len(page) < LIST_LIMIT:
                    return shown
                after = page[-1].position
        finally:
            await engine.dispose()

    shown = asyncio.run(run())
    typer.echo(f"{shown} memories of user {user}")


@memories_app.command("delete")
def memories_delete(
    memory_id: str = typer.Argument(..., metavar="ID", help="The memory's id (from list)."),
    user: str = typer.Option(..., "--user", help="The user the memory belongs to."),
) -> None:
    """Forget one memory of USER; exit 1 if USER has no memory ID."""

    async def run() -> bool:
        engine = async_engine(Settings.from_env(), pool_size=1)
        try:
            return await forget(engine, user, memory_id)
        finally:
            await engine.dispose()

    if not asyncio.run(run()):
        typer.echo(f"koda: user {user} has no memory {memory_id}", err=True)
        raise typer.Exit(1)
    typer.echo(f"forgot memory {memory_id} of user {user}")


@memories_app.command("forget")
def memories_forget(
    user: str = typer.Option(..., "--user", help="The user whose memories to forget."),
    run_id: str | None = typer.Option(None, "--run-id", help="Only those from this run."),
    every: bool = typer.Option(False, "--all", help="Every memory of USER."),
) -> None:
    """Forget many memories of USER: --all, or those of one run (--run-id)."""
    if every == (run_id is not None):
        typer.echo("koda: give --all or --run-id (one of them)", err=True)
        raise typer.Exit(2)

    async def run() -> int:
        engine = async_engine(Settings.from_env(), pool_size=1)
        try:
            return await forget_many(engine, user, run_id=run_id)
        finally:
            await engine.dispose()

    typer.echo(f"forgot {asyncio.run(run())} memories of user {user}")
