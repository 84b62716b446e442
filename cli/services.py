"""``koda services up|down|status|env``: the local Kafka and PostgreSQL from the shell.

Errors print one line to stderr and exit with status 2.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer

from koda_runtime.errors import KodaError
from koda_runtime.localstack import jaeger, kafka_cluster, prometheus, stack

services_app = typer.Typer(
    help="Start, stop and inspect the local Kafka and PostgreSQL.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

StateDir = Annotated[
    Path,
    typer.Option("--state-dir", help="Where data, logs and pid files live.", file_okay=False),
]
DEFAULT_STATE_DIR = Path(".koda")


@contextmanager
def _exit_on_error() -> Iterator[None]:
    try:
        yield
    except KodaError as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        typer.echo(f"error: {first}", err=True)
        raise typer.Exit(2) from None


@services_app.callback()
def _main() -> None:
    """Local services for development and tests."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s %(message)s")
    # Progress (jar downloads, nodes starting) is worth seeing on a terminal.
    logging.getLogger("koda.localstack").setLevel(logging.INFO)


@services_app.command()
def up(
    brokers: Annotated[
        int | None,
        typer.Option(
            "--brokers", help="Kafka nodes: 1 or 3 [default: the state dir's cluster, else 1]."
        ),
    ] = None,
    state_dir: StateDir = DEFAULT_STATE_DIR,
    with_prometheus: Annotated[
        bool,
        typer.Option(
            "--with-prometheus",
            help="Also run Prometheus, scraping `make dev` and loading the alert rules.",
        ),
    ] = False,
    with_tracing: Annotated[
        bool,
        typer.Option(
            "--with-tracing",
            help="Also run Jaeger; services.env then makes koda's processes send it traces.",
        ),
    ] = False,
) -> None:
    """Start Kafka and PostgreSQL (reusing running ones) and write <state-dir>/services.env."""
    with _exit_on_error():
        if brokers is None:
            cluster = kafka_cluster.load_cluster(state_dir.resolve())
            brokers = cluster.brokers if cluster is not None else 1
        # Before the stack: its services.env names a running Jaeger.
        traces = jaeger.start(state_dir) if with_tracing else None
        info = stack.up(state_dir, brokers=brokers)
        _apply_catalogue(info)
        prometheus_url = prometheus.start(state_dir) if with_prometheus else None
    for line in stack.env_lines(info) + jaeger.env_lines(state_dir):
        typer.echo(line)
    typer.echo(f"wrote {state_dir / stack.ENV_FILE}", err=True)
    if traces is not None:
        typer.echo(
            f"jaeger on {traces.url} (traces: {traces.url}/api/traces?service=koda-gateway); "
            "`make dev` sends it every run's trace",
            err=True,
        )
    if prometheus_url is not None:
        typer.echo(
            f"prometheus on {prometheus_url} (targets: {prometheus_url}/targets, "
            f"alerts: {prometheus_url}/alerts); it scrapes what `make dev` runs",
            err=True,
        )


def _apply_catalogue(info: stack.StackInfo) -> None:
    """Migrations and topics for APP_ENV on the stack just started (docs/design.md §11)."""
    import os

    from koda_runtime.schemas.migrate import upgrade
    from koda_runtime.settings import Settings
    from koda_runtime.topics.admin import apply_topics

    env = dict(os.environ)
    env.update(line.split("=", 1) for line in stack.env_lines(info))  # type: ignore[misc]
    env.setdefault("APP_ENV", "dev")  # the local stack, like `koda dev`; an explicit one wins
    if info.brokers == 3:
        env.setdefault("KODA_REPLICATION_FACTOR", "3")
        env.setdefault("KODA_MIN_INSYNC_REPLICAS", "2")
    settings = Settings.from_env(env)
    upgrade(settings)
    created = apply_topics(settings)
    typer.echo(
        f"schema {settings.names.pg_schema()} migrated; {len(created)} topics created", err=True
    )


@services_app.command()
def down(state_dir: StateDir = DEFAULT_STATE_DIR) -> None:
    """Stop every local service of the state dir, Prometheus too (data is kept)."""
    with _exit_on_error():
        stack.down(state_dir)


@services_app.command()
def status(
    state_dir: StateDir = DEFAULT_STATE_DIR,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """Show each service's port, pid and state; exit 1 unless all run."""
    with _exit_on_error():
        report = stack.status(state_dir)
    if as_json:
        typer.echo(json.dumps(report, indent=2))
    else:
        for line in _status_lines(report):
            typer.echo(line)
    if not report["running"]:
        raise typer.Exit(1)


def _status_lines(report: dict[str, Any]) -> list[str]:
    def state(entry: dict[str, Any]) -> str:
        return f"running pid={entry['pid']}" if entry["running"] else "stopped"

    lines = [f"state dir  {report['state_dir']}"]
    if report["kafka"] is None:
        lines.append("kafka      not set up")
    else:
        for node in report["kafka"]["nodes"]:
            lines.append(
                f"kafka {node['node_id']}    127.0.0.1:{node['port']} "
                f"(controller {node['controller_port']})  {state(node)}"
            )
    pg = report["postgres"]
    lines.append("postgres   not set up" if pg is None else f"postgres   {pg['url']}  {state(pg)}")
    prom = report.get("prometheus")
    if prom is not None:
        lines.append(f"prometheus {prom['url']}  {state(prom)}")
    traces = report.get("jaeger")
    if traces is not None:
        lines.append(f"jaeger     {traces['url']}  {state(traces)}")
    return lines


@services_app.command()
def env(state_dir: StateDir = DEFAULT_STATE_DIR) -> None:
    """Print the KODA_KAFKA_BOOTSTRAP and KODA_DATABASE_URL lines of the state dir."""
    with _exit_on_error():
        info = stack.read_info(state_dir)
    for line in stack.env_lines(info):
        typer.echo(line)
