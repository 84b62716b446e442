"""``koda runs submit|show|cancel|follow``: talk to a gateway over HTTP.

A client only: it imports no server module (FastAPI, uvicorn, the app), so the
``koda`` command line does not load the gateway to submit or follow a run.
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from typing import Any, NoReturn

import httpx
import typer

from koda_runtime.gateway.eventstream import RECONNECT, TERMINAL_KINDS, Event, EventParser
from koda_runtime.lifecycle.states import RunStatus

DEFAULT_GATEWAY = "http://127.0.0.1:8080"
POLL_INTERVAL_S = 0.5


runs_app = typer.Typer(
    no_args_is_help=True, add_completion=False, help="Submit runs to a gateway and read them."
)


def fail(message: str) -> NoReturn:
    typer.echo(f"koda: {message}", err=True)
    raise typer.Exit(2)


def _explain(response: httpx.Response) -> str:
    try:
        error = response.json()["error"]
        where = f" ({error['field']})" if error.get("field") else ""
        return f"HTTP {response.status_code} {error['code']}{where}: {error['message']}"
    except (ValueError, KeyError, TypeError):
        return f"HTTP {response.status_code}: {response.text[:200]}"


def new_message_id() -> str:
    """A client_message_id for one new message (a random UUID)."""
    return str(uuid.uuid4())


def call(client: httpx.Client, method: str, url: str, **kwargs: Any) -> dict[str, Any]:
    try:
        response = client.request(method, url, **kwargs)
    except httpx.HTTPError as exc:
        fail(f"cannot reach the gateway at {client.base_url}: {exc}; is `koda gateway` running?")
    if response.status_code >= 400:
        fail(_explain(response))
    body: dict[str, Any] = response.json()
    return body


@runs_app.command("submit")
def submit(
    text: str = typer.Argument(..., help="The input text of the run."),
    user: str = typer.Option(..., "--user", help="Submit as this user (dev token dev:<user>)."),
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
    headers = {"Authorization": f"Bearer dev:{user}"}
    if key is not None:
        headers["Idempotency-Key"] = key
    body: dict[str, Any] = {"input": text, "client_message_id": message_id or new_message_id()}
    if session is not None:
        body["session_id"] = session
    with httpx.Client(base_url=gateway, headers=headers, timeout=10.0) as client:
        accepted = call(client, "POST", "/v1/runs", json=body)
        run_id = str(accepted["run_id"])
        if not wait:
            typer.echo(run_id)
            return
        typer.echo(f"run {run_id} {accepted['status']}", err=True)
        run = _wait_terminal(client, run_id, timeout)
    typer.echo(run["output"])
    if run["status"] != RunStatus.DONE.value:
        detail = f": {run['error']}" if run.get("error") else ""
        fail(f"run {run_id} ended {run['status']}{detail}")


def _wait_terminal(client: httpx.Client, run_id: str, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    last_status = None
    while True:
        run = call(client, "GET", f"/v1/runs/{run_id}")
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
    user: str = typer.Option(..., "--user", help="The run's owner (dev token dev:<user>)."),
    gateway: str = typer.Option(DEFAULT_GATEWAY, "--gateway", help="Gateway base URL."),
) -> None:
    """Print a run as JSON."""
    with httpx.Client(
        base_url=gateway, headers={"Authorization": f"Bearer dev:{user}"}, timeout=10.0
    ) as client:
        typer.echo(json.dumps(call(client, "GET", f"/v1/runs/{run_id}"), indent=2))


@runs_app.command("cancel")
def cancel(
    run_id: str = typer.Argument(..., help="The run id."),
    user: str = typer.Option(..., "--user", help="The run's owner (dev token dev:<user>)."),
    reason: str | None = typer.Option(None, "--reason", help="Shown in the cancelled event."),
    gateway: str = typer.Option(DEFAULT_GATEWAY, "--gateway", help="Gateway base URL."),
) -> None:
    """Cancel RUN_ID (idempotent); print the answer as JSON.

    A pending run is cancelled at once; a running one is ended by its worker (follow
    it with `koda runs follow`); a run that already ended is left as it is.
    """
    body = {} if reason is None else {"reason": reason}
    with httpx.Client(
        base_url=gateway, headers={"Authorization": f"Bearer dev:{user}"}, timeout=10.0
    ) as client:
        answer = call(client, "POST", f"/v1/runs/{run_id}/cancel", json=body or None)
    typer.echo(json.dumps(answer, indent=2))


# --- koda runs follow ---------------------------------------------------------------

FOLLOW_READ_TIMEOUT_S = 60.0  # several keep-alive intervals: a silent link is dead
FOLLOW_DEFAULT_RETRY_S = 1.0


class _Follower:
    """Prints one run's events and remembers the last seq, across reconnections."""

    def __init__(self, last: int | None) -> None:
        self.last = last
        self.retry_s = FOLLOW_DEFAULT_RETRY_S
        self.outcome: str | None = None  # the terminal kind once seen
        self.heard_at = time.monotonic()  # when the gateway last answered

    def handle(self, event: Event) -> bool:
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


def _data(event: Event) -> dict[str, Any]:
    try:
        data = event.json()
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


@runs_app.command("follow")
def follow(
    run_id: str = typer.Argument(..., help="The run id."),
    user: str | None = typer.Option(None, "--user", help="Read as this user (dev:<user>)."),
    token: str | None = typer.Option(None, "--token", help="A bearer token (prod)."),
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
    if (user is None) == (token is None):
        fail("give exactly one of --user (dev token dev:<user>) or --token")
    bearer = token if token is not None else f"dev:{user}"
    follower = _Follower(after)
    timeout = httpx.Timeout(10.0, read=FOLLOW_READ_TIMEOUT_S)
    with httpx.Client(base_url=gateway, timeout=timeout) as client:
        while True:
            try:
                if _follow_once(client, run_id, bearer, follower):
                    break
            except httpx.HTTPError as exc:
                where = "the start" if follower.last is None else f"seq {follower.last}"
                typer.echo(
                    f"[connection lost ({type(exc).__name__}); resuming after {where}]", err=True
                )
            if time.monotonic() - follower.heard_at > give_up:
                fail(f"gave up: no answer from {gateway} for {give_up:.0f}s")
            time.sleep(follower.retry_s)
    if follower.outcome not in (None, "done"):
        raise typer.Exit(1)


def _follow_once(client: httpx.Client, run_id: str, bearer: str, follower: _Follower) -> bool:
    """One connection; True when the run is over (or there is nothing more to read)."""
    headers = {"Authorization": f"Bearer {bearer}", "Accept": "text/event-stream"}
    if follower.last is not None:
        headers["Last-Event-ID"] = str(follower.last)
    with client.stream("GET", f"/v1/runs/{run_id}/events", headers=headers) as response:
        follower.heard_at = time.monotonic()
        if response.status_code == 204:
            return True  # the run is over and nothing follows the last seq we have
        if response.status_code >= 500:
            raise httpx.HTTPStatusError(
                f"HTTP {response.status_code}", request=response.request, response=response
            )
        if response.status_code >= 400:
            response.read()
            fail(_explain(response))
        parser = EventParser()
        for chunk in response.iter_bytes():
            follower.heard_at = time.monotonic()
            for event in parser.feed(chunk):
                if parser.retry is not None:
                    follower.retry_s = parser.retry / 1000.0
                if follower.handle(event):
                    return event.event != RECONNECT
    return False  # closed without a terminal event: reconnect
