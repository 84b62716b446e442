"""``koda memories list|delete|forget --user U``: operators read and forget a user's
memories; ``koda memories reembed`` recomputes every vector after KODA_EMBEDDER changed."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from typing import TextIO

import typer

from koda_runtime.processors.memory import store
from koda_runtime.processors.memory.service import build_embedder
from koda_runtime.schemas.db import async_engine
from koda_runtime.schemas.memories import LIST_LIMIT, forget, forget_many, list_for, to_reembed
from koda_runtime.settings import Settings

log = logging.getLogger(__name__)

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


class ReembedProgress:
    """A progress bar on stderr: rewritten in place on a terminal, a line every 5 s
    otherwise (logs, CI), as ``koda replay``'s progress line."""

    def __init__(self, total: int, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.total = total
        self.done = 0
        self.tty = self.stream.isatty()
        self.every_s = 0.2 if self.tty else 5.0
        self.started = time.monotonic()
        self._last = float("-inf")  # the first batch is shown at once
        self._written = False

    def add(self, n: int, *, force: bool = False) -> None:
        self.done += n
        now = time.monotonic()
        if not force and now - self._last < self.every_s:
            return
        self._last = now
        share = self.done / self.total if self.total else 1.0
        filled = int(share * 30)
        rate = self.done / max(now - self.started, 1e-6)
        line = (
            f"reembed [{'#' * filled}{'.' * (30 - filled)}] {self.done:,}/{self.total:,} "
            f"{share:4.0%}  {rate:,.0f} memories/s"
        )
        self.stream.write(("\r" + line) if self.tty else (line + "\n"))
        self.stream.flush()
        self._written = True

    def finish(self) -> None:
        if self.tty and self._written:
            self.stream.write("\n")
            self.stream.flush()


@memories_app.command("reembed")
def memories_reembed(
    batch: int = typer.Option(
        100, "--batch", min=1, max=10_000, help="Memories embedded per call and transaction."
    ),
    quiet: bool = typer.Option(False, "--quiet", help="No progress bar."),
) -> None:
    """Recompute the vectors of every memory another embedder made with KODA_EMBEDDER's.

    A batch at a time, each committed with its rows marked as the new embedder's, so a
    run stopped anywhere and started again continues where it stopped and never does a
    row twice. Searches go on meanwhile: they compare only vectors of the embedder the
    worker runs with, so they see the rows reembedded so far."""
    settings = Settings.from_env()
    fault = settings.test_fault

    async def run() -> tuple[str, int, int]:  # the embedder, rows done, rows left
        engine = async_engine(settings, pool_size=1)
        embedder = build_embedder(settings)
        try:
            total = await to_reembed(engine, embedder.name)
            progress = None if quiet else ReembedProgress(total)
            done, after, this_pass = 0, "", 0
            while True:
                got = await store.reembed_batch(engine, embedder, after=after, limit=batch)
                if got is None:
                    # Rows a worker still on the old embedder wrote behind us: another
                    # pass, as long as a pass gets something done.
                    if this_pass and await to_reembed(engine, embedder.name):
                        after, this_pass = "", 0
                        continue
                    break
                done += got.updated
                this_pass += got.updated
                after = got.last_id
                if progress is not None:
                    progress.add(got.read)
                if fault == "kill-after-reembed-batch":
                    log.warning("test fault %s: SIGKILL after a batch", fault)
                    sys.stderr.flush()
                    os.kill(os.getpid(), signal.SIGKILL)
            if progress is not None:
                progress.add(0, force=True)
                progress.finish()
            left = await to_reembed(engine, embedder.name)
            return embedder.name, done, left
        finally:
            aclose = getattr(embedder, "aclose", None)
            if aclose is not None:
                await aclose()
            await engine.dispose()

    name, done, left = asyncio.run(run())
    typer.echo(f"reembedded {done} memories with {name}; {left} left of another embedder")
    if left:
        typer.echo(
            "koda: memories of another embedder are still being written: restart every "
            "worker with the new KODA_EMBEDDER, then run reembed again",
            err=True,
        )
        raise typer.Exit(1)
