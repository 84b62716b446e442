"""The process commands: ``koda worker``, ``koda entrypoint``, ``koda scheduler``,
``koda gateway`` and ``koda dev``, each running in the foreground until stopped."""

from __future__ import annotations

import sys

import typer

from koda_runtime.cli.common import fail, friendly, load_settings

# ROLE=compactor's round interval: a chunk lost between a commit and its produce is on
# the topic at most KODA_REPAIR_AFTER + this after its run ended.
COMPACTOR_EVERY_S = 60


def register(app: typer.Typer) -> None:
    """Add the process commands to ``app``."""
    app.command("worker")(worker_command)
    app.command(
        "entrypoint", context_settings={"allow_extra_args": True, "ignore_unknown_options": True}
    )(entrypoint_command)
    app.command("scheduler")(scheduler_command)
    app.command("gateway")(gateway_command)
    app.command("dev")(dev_command)


@friendly
def worker_command() -> None:
    """Run one worker of the consumer group in the foreground (SIGTERM drains)."""
    from koda_runtime.logs import configure_logging, observe
    from koda_runtime.processors.bootstrap import run_worker

    configure_logging()
    settings = load_settings(login=True)
    observe(settings, "worker")  # KODA_LOG_FORMAT, and traces when OTEL_* say so
    run_worker(settings)


@friendly
def entrypoint_command(
    ctx: typer.Context,
    role: str = typer.Option(
        ...,
        "--role",
        envvar="ROLE",
        help="gateway|worker|scheduler|compactor|webhooks|migrate|topics",
    ),
) -> None:
    """The container entrypoint: exec the ROLE's command in this process (stays PID 1)."""
    import os

    commands = {
        "gateway": ["gateway"],
        "worker": ["worker"],
        "scheduler": ["scheduler"],
        # The chunk-topic upkeep; the container's args add --port (a later --every wins).
        "compactor": ["chunks", "compact", "--every", str(COMPACTOR_EVERY_S)],
        "migrate": ["db", "upgrade"],
        # The webhook dispatcher; the container's args add --port.
        "webhooks": ["webhooks", "dispatch"],
        "topics": ["topics", "apply"],
    }
    if role not in commands:
        fail(f"ROLE={role!r}: use one of {', '.join(commands)}")
    argv = [sys.executable, "-m", "koda_runtime.cli", *commands[role], *ctx.args]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, argv)  # noqa: S606 - replaces this process, keeps the PID


@friendly
def scheduler_command() -> None:
    """Run one scheduler replica in the foreground: due schedules become runs (SIGTERM stops)."""
    from koda_runtime.logs import configure_logging, observe
    from koda_runtime.scheduler.bootstrap import run_scheduler

    configure_logging()
    settings = load_settings(login=True)
    observe(settings, "scheduler")
    run_scheduler(settings)


@friendly
def gateway_command() -> None:
    """Run the HTTP gateway in the foreground on KODA_GATEWAY_PORT."""
    from koda_runtime.gateway.server import serve
    from koda_runtime.logs import configure_logging, observe

    configure_logging()
    settings = load_settings(login=True)
    observe(settings, "gateway")
    serve(settings)


@friendly
def dev_command(
    state_dir: str = typer.Option(".koda", help="Where the local services keep their data."),
    workers: int = typer.Option(2, min=1, max=8),
) -> None:
    """Local stack + migrations + topics + gateway + workers (demo handler); Ctrl-C stops all."""
    import os
    from pathlib import Path

    from koda_runtime.cli.dev import run_dev

    raise typer.Exit(run_dev(Path(state_dir), os.environ, workers=workers))
