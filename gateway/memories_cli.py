"""``koda memories list|delete --user U``: operators read and forget a user's memories."""

from __future__ import annotations

import asyncio

import typer

from koda_runtime.db import async_engine
from koda_runtime.schemas.memories import forget, list_for
from koda_runtime.settings import Settings

memories_app = typer.Typer(no_args_is_help=True, help="Users' long-term memories.")


@memories_app.command("list")
def memories_list(
    user: str = typer.Option(..., "--user", help="The user whose memories to list."),
) -> None:
    """One line per memory of USER, newest first: ID, created, source run, text."""

    async def run() -> int:
        engine = async_engine(Settings.from_env(), pool_size=1)
        try:
            memories = await list_for(engine, user)
        finally:
            await engine.dispose()
        for m in memories:
            typer.echo(f"{m.id}\t{m.created_at.isoformat()}\t{m.run_id or '-'}\t{m.text}")
        return len(memories)

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
