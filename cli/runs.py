"""``koda runs submit|show|cancel|follow``: talk to a gateway over HTTP.

The commands are :mod:`koda_runtime.client`'s own use: they submit, read, cancel and
follow through :class:`~koda_runtime.client.Client`. A client only: it imports no
server module (FastAPI, uvicorn, the app), so the ``koda`` command line does not load
the gateway to submit or follow a run.

Who calls: ``--token`` (or ``KODA_TOKEN``) is a bearer token, a user's own or a service
token (KODA_SERVICE_TOKENS), and ``--user`` (or ``KODA_USER``) then names the user it
acts for (``X-Koda-User``); without a token, ``--user`` is the dev token
``dev:<user>``.
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

import httpx
import typer

from koda_runtime.client import ApiError, Client, ClientError, Event, GatewayUnreachable
from koda_runtime.gateway.eventstream import RECONNECT, TERMINAL_KINDS
from koda_runtime.gateway.eventstream import Event as WireEvent
from koda_runtime.lifecycle.states import RunStatus

DEFAULT_GATEWAY = "http://127.0.0.1:8080"
POLL_INTERVAL_S = 0.5


runs_app = typer.Typer(
    no_args_is_help=True, add_completion=False, help="Submit runs to a gateway and read them."
)

USER_HELP = "The user: with --token, the user it acts for (X-Koda-User); else dev:<user>."
TOKEN_HELP = "A bearer token (prod): a user's own, or a service token acting for --user."  # noqa: S105 - help text


def fail(message: str) -> NoReturn:
    typer.echo(f"koda: {message}", err=True)
    raise typer.Exit(2)


def _explain(response: httpx.Response) -> str:
    return str(ApiError.of(response))


def call(client: httpx.Client, method: str, url: str, **kwargs: Any) -> dict[str, Any]:
    """One request on a plain httpx client (``koda schedules``), refusals ending the
    command with the gateway's error."""
    try:
        response = client.request(method, url, **kwargs)
    except httpx.HTTPError as exc:
        fail(f"cannot reach the gateway at {client.base_url}: {exc}; is `koda gateway` running?")
    if response.status_code >= 400:
        fail(_explain(response))
    body: dict[str, Any] = response.json()
    return body


def new_message_id() -> str:
    """A client_message_id for one new message (a random UUID)."""
    return str(uuid.uuid4())


def credentials(user: str | None, token: str | None) -> tuple[str, str | None]:
    """The bearer token and the user it acts for (None: the token's own)."""
    if token:
        return token, user
    if user:
        return f"dev:{user}", None
    fail("give --user (dev token dev:<user>) or --token (with --user for a service token)")


@contextmanager
def connected(gateway: str, user: str | None, token: str | None) -> Iterator[Client]:
    """A :class:`Client` whose refusals end the command with the gateway's error."""
    bearer, on_behalf_of = credentials(user, token)
    with Client(gateway, bearer, on_behalf_of=on_behalf_of) as client:
        try:
            yield client
        except GatewayUnreachable as exc:
            fail(f"{exc}; is `koda gateway` running?")
        except ClientError as exc:
            fail(str(exc))


@runs_app.command("submit")
def submit(
    text: str = typer.Argument(..., help="The input text of the run."),
    user: str | None = typer.Option(None, "--user", envvar="KODA_USER", help=USER_HELP),
    token: str | None = typer.Option(None, "--token", envvar="KODA_TOKEN", help=TOKEN_HELP),
    session: str | None = typer.Option(None, "--session", help="Session id; default: new."),
    key: str | None = typer.Option(None, "--key", help="Idempotency-Key header."),
    message_id: str | None = typer.Option(
        None,
        "--message-id",
        help="client_message_id of the message; default: a new one, so the same text "
        "submitted twice is two runs.",
    ),
    gateway: str = typer.Option(DEFAULT_GATEWAY, "--gateway", help="Gateway base URL."),
    wait: bool = typer.Option(False, "--wait", help="Poll until the run ends; print output."),
    timeout: float = typer.Option(300.0, "--timeout", help="With --wait: give up after (s)."),
) -> None:
    """Submit TEXT as a run; print its run id, or with --wait its output."""
    with connected(gateway, user, token) as client:
        accepted = client.submit(
            text,
            session_id=session,
            idempotency_key=key,
            client_message_id=message_id or new_message_id(),
        )
        if not wait:
            typer.echo(accepted.run_id)
            return
        typer.echo(f"run {accepted.run_id} {accepted.status}", err=True)
        run = _wait_terminal(client, accepted.run_id, timeout)
    typer.echo(run["output"])
    if run["status"] != RunStatus.DONE.value:
        detail = f": {run['error']}" if run.get("error") else ""
        fail(f"run {accepted.run_id} ended {run['status']}{detail}")


def _wait_terminal(client: Client, run_id: str, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    last_status = None
    while True:
        run = client.get(run_id)
        if run["status"] != last_status:
            last_status = run["status"]
            typer.echo(f"run {run_id} {last_status}", err=True)
        if RunStatus(run["status"]).terminal:
            return run
        if time.monotonic() >= deadline:
            fail(f"run {run_id} is still {last_status} after {timeout_s:.0f}s")
        time.sleep(POLL_INTERVAL_S)


@runs_app.command("show")
def show(
    run_id: str = typer.Argument(..., help="The run id."),
    user: str | None = typer.Option(None, "--user", envvar="KODA_USER", help=USER_HELP),
    token: str | None = typer.Option(None, "--token", envvar="KODA_TOKEN", help=TOKEN_HELP),
    gateway: str = typer.Option(DEFAULT_GATEWAY, "--gateway", help="Gateway base URL."),
) -> None:
    """Print a run as JSON."""
    with connected(gateway, user, token) as client:
        typer.echo(json.dumps(client.get(run_id), indent=2))


@runs_app.command("cancel")
def cancel(
    run_id: str = typer.Argument(..., help="The run id."),
    user: str | None = typer.Option(None, "--user", envvar="KODA_USER", help=USER_HELP),
    token: str | None = typer.Option(None, "--token", envvar="KODA_TOKEN", help=TOKEN_HELP),
    reason: str | None = typer.Option(None, "--reason", help="Shown in the cancelled event."),
    gateway: str = typer.Option(DEFAULT_GATEWAY, "--gateway", help="Gateway base URL."),
) -> None:
    """Cancel RUN_ID (idempotent); print the answer as JSON.

    A pending run is cancelled at once; a running one is ended by its worker (follow
    it with `koda runs follow`); a run that already ended is left as it is.
    """
    with connected(gateway, user, token) as client:
        answer = client.cancel(run_id, reason=reason)
    typer.echo(json.dumps(answer, indent=2))


# --- koda runs follow ---------------------------------------------------------------


class _Follower:
    """Prints one run's events (the client resumes the stream across reconnections)."""

    def __init__(self, last: int | None) -> None:
        self.last = last
        self.outcome: str | None = None  # the terminal kind once seen

    def handle(self, event: Event | WireEvent) -> bool:
        """Print ``event``; True when the stream is over (terminal) or must be reopened."""
        if event.seq is not None:
            self.last = event.seq
        if event.event == RECONNECT:
            return True
        data = _data(event)
        if event.event == "chunk":
            sys.stdout.write(str(data.get("content", "")))
            sys.stdout.flush()
        elif event.event == "reset":
            sys.stdout.write("\n")
            sys.stdout.flush()
            typer.echo(f"[reset: attempt {data.get('attempt', '?')} starts over]", err=True)
        elif event.event == "status":
            typer.echo(f"[status {data.get('content', '')}]", err=True)
        elif event.event == "tool":
            typer.echo(f"[tool {_tool_line(str(data.get('content', '')))}]", err=True)
        if event.event in TERMINAL_KINDS:
            self.outcome = event.event
            sys.stdout.write("\n")
            sys.stdout.flush()
            if event.event != "done":
                detail = data.get("content") or data.get("status") or ""
                typer.echo(f"[{event.event}] {detail}", err=True)
            return True
        return False


def _tool_line(content: str) -> str:
    """``memory_search({"query": ...})`` for a call, ``memory_search -> <result>`` after."""
    try:
        tool = json.loads(content)
    except json.JSONDecodeError:
        return content[:200]
    if not isinstance(tool, dict):
        return content[:200]
    if "arguments" in tool:
        return f"{tool.get('name')}({str(tool['arguments'])[:200]})"
    return f"{tool.get('name')} -> {str(tool.get('result', ''))[:200]}"


def _data(event: Event | WireEvent) -> dict[str, Any]:
    try:
        data = event.json()
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


@runs_app.command("follow")
def follow(
    run_id: str = typer.Argument(..., help="The run id."),
    user: str | None = typer.Option(None, "--user", envvar="KODA_USER", help=USER_HELP),
    token: str | None = typer.Option(None, "--token", envvar="KODA_TOKEN", help=TOKEN_HELP),
    after: int | None = typer.Option(
        None, "--after", min=0, help="Start after this seq (default: from the first event)."
    ),
    gateway: str = typer.Option(DEFAULT_GATEWAY, "--gateway", help="Gateway base URL."),
    give_up: float = typer.Option(
        300.0, "--give-up", help="Stop after this many seconds without reaching the gateway."
    ),
) -> None:
    """Stream a run's output to the terminal until it ends; reconnect with Last-Event-ID.

    Exit status: 0 done, 1 failed or cancelled, 2 refused or unreachable.
    """
    follower = _Follower(after)

    def lost(exc: Exception, last: int | None) -> None:
        where = "the start" if last is None else f"seq {last}"
        typer.echo(f"[connection lost ({type(exc).__name__}); resuming after {where}]", err=True)

    with connected(gateway, user, token) as client:
        try:
            for event in client.follow(run_id, after=after, give_up_s=give_up, on_retry=lost):
                if follower.handle(event):
                    break
        except ApiError as exc:
            fail(str(exc))
        except GatewayUnreachable as exc:
            fail(str(exc))
    if follower.outcome not in (None, "done"):
        raise typer.Exit(1)
