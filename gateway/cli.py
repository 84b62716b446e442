"""Run the gateway (:func:`serve`) and talk to one (``koda runs ...``, :data:`runs_app`).

``serve`` runs uvicorn in the foreground. On SIGTERM or Ctrl-C uvicorn stops
accepting connections, lets in-flight requests finish (up to
``GRACEFUL_SHUTDOWN_S``), then the lifespan drains deliveries and closes the
producer and the engine; the process exits 0. A second Ctrl-C forces the exit; a
second SIGTERM changes nothing (one drain only).
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

import httpx
import typer
import uvicorn

from gateway.app import create_app
from koda.lifecycle.states import RunStatus
from koda.logs import configure_logging
from koda.settings import Settings

# In-flight requests get 15 s, then the lifespan drains up to 5 s of deliveries and
# flushes the producer up to 3 s: within an orchestrator's 25 s grace period.
GRACEFUL_SHUTDOWN_S = 15
DEFAULT_GATEWAY = "http://127.0.0.1:8080"
POLL_INTERVAL_S = 0.5


class _Server(uvicorn.Server):
    """uvicorn, minus re-raising the signal after a graceful stop.

    uvicorn re-raises SIGTERM once it has shut down, so the process dies by the
    signal (status 143) even though every request finished; a gateway that
    drained cleanly exits 0.
    """

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        originals = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)


def serve(settings: Settings) -> None:
    """Serve the gateway on ``settings.gateway_host:gateway_port`` until SIGTERM/SIGINT."""
    configure_logging()
    config = uvicorn.Config(
        create_app(settings),
        host=settings.gateway_host,
        port=settings.gateway_port,
        lifespan="on",
        log_config=None,
        access_log=False,  # RequestMetrics logs one key=value line per request instead
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        server_header=False,
    )
    server = _Server(config)
    server.run()
    if not server.started:
        # Startup failed (port taken, lifespan error): uvicorn already logged why.
        raise SystemExit(3)


runs_app = typer.Typer(
    no_args_is_help=True, add_completion=False, help="Submit runs to a gateway and read them."
)


def _fail(message: str) -> NoReturn:
    typer.echo(f"koda: {message}", err=True)
    raise typer.Exit(2)


def _explain(response: httpx.Response) -> str:
    try:
        error = response.json()["error"]
        where = f" ({error['field']})" if error.get("field") else ""
        return f"HTTP {response.status_code} {error['code']}{where}: {error['message']}"
    except (ValueError, KeyError, TypeError):
        return f"HTTP {response.status_code}: {response.text[:200]}"


def _request(client: httpx.Client, method: str, url: str, **kwargs: Any) -> dict[str, Any]:
    try:
        response = client.request(method, url, **kwargs)
    except httpx.HTTPError as exc:
        _fail(f"cannot reach the gateway at {client.base_url}: {exc}; is `koda gateway` running?")
    if response.status_code >= 400:
        _fail(_explain(response))
    body: dict[str, Any] = response.json()
    return body


@runs_app.command("submit")
def submit(
    text: str = typer.Argument(..., help="The input text of the run."),
    user: str = typer.Option(..., "--user", help="Submit as this user (dev token dev:<user>)."),
    session: str | None = typer.Option(None, "--session", help="Session id; default: new."),
    key: str | None = typer.Option(None, "--key", help="Idempotency-Key header."),
    gateway: str = typer.Option(DEFAULT_GATEWAY, "--gateway", help="Gateway base URL."),
    wait: bool = typer.Option(False, "--wait", help="Poll until the run ends; print output."),
    timeout: float = typer.Option(300.0, "--timeout", help="With --wait: give up after (s)."),
) -> None:
    """Submit TEXT as a run; print its run id, or with --wait its output."""
    headers = {"Authorization": f"Bearer dev:{user}"}
    if key is not None:
        headers["Idempotency-Key"] = key
    body: dict[str, Any] = {"input": text}
    if session is not None:
        body["session_id"] = session
    with httpx.Client(base_url=gateway, headers=headers, timeout=10.0) as client:
        accepted = _request(client, "POST", "/v1/runs", json=body)
        run_id = str(accepted["run_id"])
        if not wait:
            typer.echo(run_id)
            return
        typer.echo(f"run {run_id} {accepted['status']}", err=True)
        run = _wait_terminal(client, run_id, timeout)
    typer.echo(run["output"])
    if run["status"] != RunStatus.DONE.value:
        detail = f": {run['error']}" if run.get("error") else ""
        _fail(f"run {run_id} ended {run['status']}{detail}")


def _wait_terminal(client: httpx.Client, run_id: str, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    last_status = None
    while True:
        run = _request(client, "GET", f"/v1/runs/{run_id}")
        if run["status"] != last_status:
            last_status = run["status"]
            typer.echo(f"run {run_id} {last_status}", err=True)
        if RunStatus(run["status"]).terminal:
            return run
        if time.monotonic() >= deadline:
            _fail(f"run {run_id} is still {last_status} after {timeout_s:.0f}s")
        time.sleep(POLL_INTERVAL_S)


@runs_app.command("show")
def show(
    run_id: str = typer.Argument(..., help="The run id."),
    user: str = typer.Option(..., "--user", help="The run's owner (dev token dev:<user>)."),
    gateway: str = typer.Option(DEFAULT_GATEWAY, "--gateway", help="Gateway base URL."),
) -> None:
    """Print a run as JSON."""
    with httpx.Client(
        base_url=gateway, headers={"Authorization": f"Bearer dev:{user}"}, timeout=10.0
    ) as client:
        typer.echo(json.dumps(_request(client, "GET", f"/v1/runs/{run_id}"), indent=2))
