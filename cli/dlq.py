"""``koda dlq list|show|replay``: the dead letters of the runs topic."""

from __future__ import annotations

import typer

from koda_runtime.cli.common import CONFIRM_PROD, friendly, guarded_settings, load_settings

dlq_app = typer.Typer(no_args_is_help=True, help="Dead letters.")


@dlq_app.command("list")
@friendly
def dlq_list(
    reason: list[str] | None = typer.Option(  # noqa: B008 - typer's idiom
        None, "--reason", help="Only this reason (repeatable)."
    ),
    from_offset: int = typer.Option(0, "--from-offset", min=0, help="First DLQ offset."),
    limit: int | None = typer.Option(None, "--limit", min=1, help="Stop after N letters."),
) -> None:
    """One line per dead letter: ID, time, reason, run, key, error."""
    from koda_runtime.topics.dlq import read_letters
    from koda_runtime.topics.dlq_view import list_line

    shown = 0
    letters = read_letters(load_settings(kafka=True), from_offset=from_offset)
    for at in letters:
        if reason and (at.letter is None or at.letter.reason not in reason):
            continue
        typer.echo(list_line(at))
        shown += 1
        if limit is not None and shown >= limit:
            letters.close()
            break
    typer.echo(f"{shown} dead letters; `koda dlq show ID` prints one in full")


@dlq_app.command("show")
@friendly
def dlq_show(letter_id: str = typer.Argument(..., metavar="ID", help="PARTITION:OFFSET")) -> None:
    """Every field of one dead letter, with its original record."""
    from koda_runtime.topics.dlq import LetterId, read_letters
    from koda_runtime.topics.dlq_view import detail_lines

    for at in read_letters(load_settings(kafka=True), only=LetterId.parse(letter_id)):
        typer.echo("\n".join(detail_lines(at)))


@dlq_app.command("replay")
@friendly
def dlq_replay(
    letter_id: str | None = typer.Argument(
        None, metavar="[ID]", help="Only this letter (PARTITION:OFFSET)."
    ),
    reason: list[str] | None = typer.Option(  # noqa: B008 - typer's idiom
        None, "--reason", help="Only this reason (repeatable)."
    ),
    from_offset: int = typer.Option(0, "--from-offset", min=0, help="First DLQ offset."),
    limit: int | None = typer.Option(None, "--limit", min=1, help="Stop after N replayed."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Read and report; produce nothing."),
    confirm_prod: bool = CONFIRM_PROD,
) -> None:
    """Re-publish dead letters' original records (key, value, headers) to the runs topic."""
    from koda_runtime.topics.dlq import LetterId, replay_dead_letters

    settings = guarded_settings(confirm_prod, "dlq replay")
    report = replay_dead_letters(
        settings,
        reasons=reason or (),
        from_offset=from_offset,
        only=None if letter_id is None else LetterId.parse(letter_id),
        limit=limit,
        dry_run=dry_run,
        on_letter=typer.echo,
    )
    verb = "would replay" if dry_run else "replayed"
    typer.echo(
        f"{verb} {report.replayed} of {report.read} dead letters; next offsets {report.next_offset}"
    )
