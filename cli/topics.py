"""``koda topics apply|check|delete``: koda's topics against the catalogue."""

from __future__ import annotations

import typer

from koda_runtime.cli.common import CONFIRM_PROD, friendly, guarded_settings, load_settings

topics_app = typer.Typer(no_args_is_help=True, help="Create and check koda's topics.")


@topics_app.command("apply")
@friendly
def topics_apply(confirm_prod: bool = CONFIRM_PROD) -> None:
    """Create every missing topic of the catalogue (idempotent)."""
    from koda_runtime.topics.admin import apply_topics

    created = apply_topics(guarded_settings(confirm_prod, "topics apply"))
    for name in created:
        typer.echo(f"created {name}")
    typer.echo(f"topics ok ({len(created)} created)")


@topics_app.command("check")
@friendly
def topics_check() -> None:
    """Report drift between the broker and the catalogue, and broker settings that refuse
    the workers' session timeout or heartbeat; exit 1 on any."""
    from koda_runtime.topics.admin import check_broker, check_topics

    settings = load_settings(kafka=True)
    drifts = check_topics(settings)
    for d in drifts:
        typer.echo(f"drift: {d}")
    refusals, unchecked = check_broker(settings)
    for r in refusals:
        typer.echo(f"refused: {r}")
    if unchecked:
        typer.echo(f"not checked (the broker does not describe them): {', '.join(unchecked)}")
    if drifts or refusals:
        raise typer.Exit(1)
    typer.echo("topics match the catalogue; the brokers allow the workers' group timings")


@topics_app.command("delete")
@friendly
def topics_delete(confirm_prod: bool = CONFIRM_PROD) -> None:
    """Delete the catalogue's topics and every record in them (asks nothing in dev)."""
    from koda_runtime.topics.admin import delete_topics

    deleted = delete_topics(guarded_settings(confirm_prod, "topics delete"))
    for name in deleted:
        typer.echo(f"deleted {name}")
    typer.echo(f"topics deleted ({len(deleted)})")
