"""The ``koda`` command: services, topics, db, gateway, worker, runs, replay, dlq, schemas.

Errors a user can hit print one line naming the problem and the fix, and exit 2.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from functools import wraps
from pathlib import Path
from typing import Any, TypeVar

import typer

from koda_runtime.errors import KodaError
from koda_runtime.settings import Settings

F = TypeVar("F", bound=Callable[..., Any])

app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__)
topics_app = typer.Typer(no_args_is_help=True, help="Create and check koda's topics.")
db_app = typer.Typer(no_args_is_help=True, help="Database migrations.")
chunks_app = typer.Typer(no_args_is_help=True, help="The chunk topic as a replay log.")
dlq_app = typer.Typer(no_args_is_help=True, help="Dead letters.")
schemas_app = typer.Typer(no_args_is_help=True, help="JSON Schemas of koda's records.")
webhooks_app = typer.Typer(no_args_is_help=True, help="Webhooks: ended runs call back.")
app.add_typer(topics_app, name="topics")
app.add_typer(db_app, name="db")
app.add_typer(chunks_app, name="chunks")
app.add_typer(dlq_app, name="dlq")
app.add_typer(schemas_app, name="schemas")
app.add_typer(webhooks_app, name="webhooks")

CONFIRM_PROD = typer.Option(False, "--confirm-prod", help="Required in prod.")
# ROLE=compactor's round interval: a chunk lost between a commit and its produce is on
# the topic at most KODA_REPAIR_AFTER + this after its run ended.
COMPACTOR_EVERY_S = 60


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


@app.command("replay")
@friendly
def replay_command(
    topic: list[str] | None = typer.Argument(  # noqa: B008 - typer's idiom
        None, help="runs, run-events, run-chunks, runs-dlq (default: all four)."
    ),
    to: str = typer.Option(
        "duckdb:///warehouse.duckdb",
        "--to",
        help="duckdb:///FILE, postgresql://USER@HOST/DB[?schema=S], parquet:///DIR,"
        " iceberg:///DIR or iceberg+rest://HOST:PORT/PATH.",
    ),
    start: str | None = typer.Option(None, "--from", help="earliest (the default)."),
    from_timestamp: str | None = typer.Option(
        None, "--from-timestamp", help="ISO 8601 date/time, unix seconds, or an age like -2h."
    ),
    from_offsets: Path | None = typer.Option(  # noqa: B008 - typer's idiom
        None, "--from-offsets", help="File of '<topic> <partition> <offset>' lines."
    ),
    job: str | None = typer.Option(
        None, "--job", help="A named job: resumes where it stopped (its own consumer group)."
    ),
    follow: bool = typer.Option(False, "--follow", help="Keep reading new records until stopped."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Read and count; write nothing."),
    batch: int | None = typer.Option(
        None, "--batch", min=1, help="Records per sink transaction (default 40,000)."
    ),
    max_rate: float | None = typer.Option(
        None, "--max-rate", min=1, help="At most this many records/s (spares the brokers)."
    ),
    save_offsets: Path | None = typer.Option(  # noqa: B008 - typer's idiom
        None, "--save-offsets", help="Write where it stopped, for --from-offsets."
    ),
    quiet: bool = typer.Option(False, "--quiet", help="No progress line."),
    postgres: bool = typer.Option(
        True,
        "--postgres/--no-postgres",
        help="With the runs topic, also export run inputs, merges, schedules and memories"
        " from Postgres (docs/data-dictionary.md).",
    ),
) -> None:
    """Replay koda's topics into a warehouse; idempotent (upserts on natural keys)."""
    from koda_runtime.stopping import stop_on_signals
    from koda_runtime.topics.replay import Progress, ReplayOptions, run_replay, start_spec

    settings = load_settings(login=True)
    options = ReplayOptions(
        topics=tuple(topic or ()),
        start=start_spec(settings.names, start, from_timestamp, from_offsets),
        sink_url=to,
        job=job,
        follow=follow,
        dry_run=dry_run,
        max_rate=max_rate,
        save_offsets=save_offsets,
        with_postgres=postgres,
    )
    if batch is not None:
        options = dataclasses.replace(options, batch_records=batch)
    with stop_on_signals() as stop:
        summary = run_replay(settings, options, progress=Progress(enabled=not quiet), stop=stop)
    typer.echo("\n".join(summary.lines()))
    if summary.stopped:
        raise typer.Exit(130)


SCHEMAS_OUT = typer.Option(
    None,
    "--out",
    help="Write into this folder (default: topics/records/json of the source checkout).",
)


@schemas_app.command("write")
@friendly
def schemas_write(
    check: bool = typer.Option(False, "--check", help="Write nothing; exit 1 on drift."),
    out: Path | None = SCHEMAS_OUT,
) -> None:
    """Regenerate topics/records/json/*.schema.json from the record specs."""
    from koda_runtime import resources
    from koda_runtime.topics.records.json_schemas import DIRECTORY, drift, write_all

    if check:
        directory = out or DIRECTORY
        stale = drift(directory)
        for name in stale:
            typer.echo(f"drift: {directory / name}")
        if stale:
            raise typer.Exit(1)
        typer.echo("JSON Schemas match the record specs")
        return
    directory = out or resources.checkout_path(
        "topics", "records", "json", what="koda schemas write"
    )
    for path in write_all(directory):
        typer.echo(f"wrote {path}")
    typer.echo(f"JSON Schemas up to date in {directory}")


@db_app.command("upgrade")
@friendly
def db_upgrade(revision: str = typer.Argument("head")) -> None:
    """Create the schema if missing and apply migrations up to REVISION."""
    from koda_runtime.schemas.migrate import upgrade

    settings = load_settings(database=True)
    upgrade(settings, revision)
    typer.echo(f"database schema {settings.names.pg_schema()} at {revision}")


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


def require_confirmation(settings: Settings, confirmed: bool, what: str) -> None:
    """Destructive or shared-state commands demand ``--confirm-prod`` in prod."""
    from koda_runtime.naming import AppEnv

    if settings.app_env is AppEnv.PROD and not confirmed:
        raise KodaError(f"`koda {what}` in APP_ENV=prod needs --confirm-prod")


@app.command("worker")
@friendly
def worker_command() -> None:
    """Run one worker of the consumer group in the foreground (SIGTERM drains)."""
    from koda_runtime.logs import configure_logging, observe
    from koda_runtime.processors.bootstrap import run_worker

    configure_logging()
    settings = load_settings(login=True)
    observe(settings, "worker")  # KODA_LOG_FORMAT, and traces when OTEL_* say so
    run_worker(settings)


@app.command(
    "entrypoint", context_settings={"allow_extra_args": True, "ignore_unknown_options": True}
)
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


traces_app = typer.Typer(no_args_is_help=True, help="Read a run's trace from its receiver.")
app.add_typer(traces_app, name="traces")


@traces_app.command("show")
@friendly
def traces_show(
    run: str = typer.Argument(..., metavar="RUN_ID|TRACE_ID", help="A run id, or a trace id."),
    query: str | None = typer.Option(
        None,
        "--query",
        help="The receiver's query API (Jaeger's, e.g. http://jaeger:16686); default: the "
        "Jaeger of `koda services up --with-tracing`.",
    ),
) -> None:
    """Draw one run's trace (gateway, worker, model, viewers) as its receiver holds it."""
    from koda_runtime.cli import traces
    from koda_runtime.cli.services import DEFAULT_STATE_DIR
    from koda_runtime.localstack import jaeger
    from koda_runtime.schemas.db import sync_engine

    if query is None:
        ports = jaeger.load_ports(DEFAULT_STATE_DIR.resolve())
        if ports is None:
            fail("no --query and no local Jaeger: start one with `koda services up --with-tracing`")
            return
        query = ports.url
    trace_id = run.lower()
    if not traces.is_trace_id(trace_id):
        engine = sync_engine(load_settings(database=True))
        try:
            trace_id = traces.run_trace_id(engine, run)
        finally:
            engine.dispose()
    for line in traces.render(traces.fetch(query, trace_id)):
        typer.echo(line)


@app.command("scheduler")
@friendly
def scheduler_command() -> None:
    """Run one scheduler replica in the foreground: due schedules become runs (SIGTERM stops)."""
    from koda_runtime.logs import configure_logging, observe
    from koda_runtime.scheduler.bootstrap import run_scheduler

    configure_logging()
    settings = load_settings(login=True)
    observe(settings, "scheduler")
    run_scheduler(settings)


@app.command("gateway")
@friendly
def gateway_command() -> None:
    """Run the HTTP gateway in the foreground on KODA_GATEWAY_PORT."""
    from koda_runtime.gateway.server import serve
    from koda_runtime.logs import configure_logging, observe

    configure_logging()
    settings = load_settings(login=True)
    observe(settings, "gateway")
    serve(settings)


@app.command("dev")
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


def _add_optional_apps() -> None:
    from koda_runtime.cli.memories import memories_app
    from koda_runtime.cli.runs import runs_app
    from koda_runtime.cli.schedules import schedules_app
    from koda_runtime.cli.services import services_app
    from koda_runtime.cli.users import users_app

    app.add_typer(services_app, name="services")
    app.add_typer(runs_app, name="runs")
    app.add_typer(memories_app, name="memories")
    app.add_typer(schedules_app, name="schedules")
    app.add_typer(users_app, name="users")


def _add_ledger_apps() -> None:
    from koda_runtime.cli.ledger import register
    from koda_runtime.cli.retention import register as register_retention

    register(app, friendly)
    register_retention(app, friendly)


# At import, like the commands above: they need nothing beyond koda and schemas.
_add_ledger_apps()


def main() -> None:
    _add_optional_apps()
    try:
        app()
    except KodaError as exc:
        typer.echo(f"koda: {exc}", err=True)
        sys.exit(2)
