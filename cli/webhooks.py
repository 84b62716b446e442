"""``koda webhooks dispatch``: the webhook dispatcher, in the foreground."""

from __future__ import annotations

import typer

from koda_runtime.cli.common import friendly, load_settings

webhooks_app = typer.Typer(no_args_is_help=True, help="Webhooks: ended runs call back.")


@webhooks_app.command("dispatch")
@friendly
def webhooks_dispatch(
    port: int | None = typer.Option(
        None,
        "--port",
        min=1,
        max=65535,
        help="Serve /livez, /readyz and /metrics on this port (default KODA_WEBHOOK_PORT).",
    ),
) -> None:
    """Deliver ended runs to their webhooks (own consumer group; SIGTERM stops)."""
    from koda_runtime.logs import configure_logging, observe
    from koda_runtime.processors.webhooks import run_dispatcher

    configure_logging()
    settings = load_settings(login=True)
    observe(settings, "webhooks")
    run_dispatcher(settings, port)
