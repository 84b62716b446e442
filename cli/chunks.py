"""``koda chunks compact|repair|verify|outputs``: the chunk topic as a replay log."""

from __future__ import annotations

import typer

from koda_runtime.cli.common import fail, friendly, load_settings
from koda_runtime.errors import KodaError

chunks_app = typer.Typer(no_args_is_help=True, help="The chunk topic as a replay log.")


@chunks_app.command("compact")
@friendly
def chunks_compact(
    older_than: float | None = typer.Option(
        None,
        "--older-than",
        min=0,
        help="Seconds since the run finished (default KODA_COMPACT_AFTER, 24 h).",
    ),
    every: float | None = typer.Option(
        None, "--every", min=1, help="Repeat every S seconds until interrupted."
    ),
    batch: int = typer.Option(100, "--batch", min=1, help="Runs per transaction."),
    port: int | None = typer.Option(
        None,
        "--port",
        min=1,
        max=65535,
        help="With --every: serve /livez, /readyz and /metrics on this port (KODA_WORKER_HOST).",
    ),
) -> None:
    """Replace finished runs' chunk records with one <run_id>:final record each."""
    from koda_runtime.processors.compactor import ChunkCompactor, serve_health

    if port is not None and every is None:
        fail("--port serves the probes of a repeating compactor: give --every S too")
    # The repeating role rides out Kafka or Postgres being away, at start too (it is not
    # ready until a round completes); a one-shot run names the one that does not answer.
    if every is not None:
        settings = load_settings(login=True)
    else:
        settings = load_settings(kafka=True, database=True)
    compactor = ChunkCompactor(settings)
    try:
        if every is not None:
            from koda_runtime.logs import configure_logging
            from koda_runtime.stopping import stop_on_signals

            configure_logging()
            server = None if port is None else serve_health(compactor, port, settings.worker_host)
            # The chunk-upkeep role also runs the retention sweep, in a thread of its own
            # at the same interval (processors/retention.py).
            from koda_runtime.processors.retention import RetentionSweeper

            sweeper = RetentionSweeper(settings)
            stop_sweeper = sweeper.start(every)
            try:
                # SIGTERM ends the loop after the round in progress.
                with stop_on_signals() as stop:
                    compactor.run_forever(every, older_than, should_stop=stop.is_set)
            finally:
                stop_sweeper()
                sweeper.close()
                if server is not None:
                    server.shutdown()
            return
        report = compactor.compact_once(older_than, batch)
    finally:
        compactor.close()
    typer.echo(f"compacted {report.runs} runs ({report.tombstones} tombstones)")


@chunks_app.command("repair")
@friendly
def chunks_repair(
    older_than: float | None = typer.Option(
        None,
        "--older-than",
        min=0,
        help="Seconds since the run finished (default KODA_REPAIR_AFTER, 30 s).",
    ),
) -> None:
    """Produce again, from Postgres, the chunks of finished runs not known to be on the topic."""
    from koda_runtime.processors.compactor import ChunkCompactor

    compactor = ChunkCompactor(load_settings(login=True))
    try:
        report = compactor.repair_once(older_than)
    finally:
        compactor.close()
    typer.echo(f"completed {report.runs} runs ({report.chunks} chunk records produced)")


@chunks_app.command("verify")
@friendly
def chunks_verify(
    since: str = typer.Option(
        "-24h",
        "--since",
        help="Runs finished since: ISO 8601, unix seconds or an age like -2h [default: -24h].",
    ),
) -> None:
    """Compare the chunk topic with Postgres for finished runs; exit 1 on any gap."""
    from datetime import UTC, datetime

    from koda_runtime.processors.chunkverify import verify_chunks
    from koda_runtime.topics.replay.errors import BadTimestampError
    from koda_runtime.topics.replay.positions import TIMESTAMP_FORMATS, parse_timestamp

    try:
        start = datetime.fromtimestamp(parse_timestamp(since) / 1000, UTC)
    except BadTimestampError:
        raise KodaError(f"--since {since!r} is not a time: use {TIMESTAMP_FORMATS}") from None
    report = verify_chunks(load_settings(login=True), start)
    for gap in report.gaps:
        typer.echo(gap.describe())
    summary = (
        f"{report.runs} runs finished since {start.isoformat()}, {report.chunks} chunks:"
        f" {len(report.gaps)} runs with gaps, {report.chunks_missing} chunks missing on the topic"
    )
    typer.echo(summary)
    if report.gaps:
        raise typer.Exit(1)


@chunks_app.command("outputs")
@friendly
def chunks_outputs() -> None:
    """Rebuild every run's output from the chunk topic alone; print JSON lines."""
    import json

    from koda_runtime.topics.chunklog import read_chunk_log

    for run in read_chunk_log(load_settings(kafka=True)).runs.values():
        row = {"run_id": run.run_id, "end": run.end, "compacted": run.compacted}
        typer.echo(json.dumps({**row, "missing": run.missing, "output": run.output}))
