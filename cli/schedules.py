"""``koda schedules list|create|pause|resume|delete``: talk to a gateway's /v1/schedules."""

from __future__ import annotations

import json
from typing import Any

import httpx
import typer

from koda_runtime.cli.runs import DEFAULT_GATEWAY, call, fail

schedules_app = typer.Typer(
    no_args_is_help=True, add_completion=False, help="Create and manage scheduled runs."
)

USER = typer.Option(..., "--user", help="As this user (dev token dev:<user>).")
GATEWAY = typer.Option(DEFAULT_GATEWAY, "--gateway", help="Gateway base URL.")


def _client(user: str, gateway: str) -> httpx.Client:
    return httpx.Client(
        base_url=gateway, headers={"Authorization": f"Bearer dev:{user}"}, timeout=10.0
    )


def _line(s: dict[str, Any]) -> str:
    quiet = s["quiet_hours"]
    state = "enabled" if s["enabled"] else "paused"
    window = f" quiet={quiet['start']}-{quiet['end']}" if quiet else ""
    return (
        f"{s['id']}  {s['cron']!r} {s['timezone']}  {state}  next={s['next_fire_at'] or '-'}  "
        f"last={s['last_fire_at'] or '-'}  overlap={s['overlap']} cap={s['daily_cap']}/day "
        f"catchup={s['catchup_s']}s{window}"
    )


@schedules_app.command("list")
def list_command(user: str = USER, gateway: str = GATEWAY) -> None:
    """One line per schedule of USER."""
    with _client(user, gateway) as client:
        for s in call(client, "GET", "/v1/schedules")["schedules"]:
            typer.echo(_line(s))


@schedules_app.command("create")
def create_command(
    cron: str = typer.Argument(..., help='5-field cron, e.g. "30 2 * * 1-5".'),
    text: str = typer.Argument(..., help="The input text of every fire's run."),
    user: str = USER,
    timezone: str = typer.Option("UTC", "--timezone", help="IANA zone, e.g. Europe/Berlin."),
    quiet: str | None = typer.Option(None, "--quiet", help="Quiet hours HH:MM-HH:MM (local)."),
    daily_cap: int | None = typer.Option(None, "--daily-cap", help="Scheduled runs per day."),
    overlap: str | None = typer.Option(None, "--overlap", help="skip (default) or allow."),
    catchup: int | None = typer.Option(None, "--catchup", help="Catch-up window in seconds."),
    session: str | None = typer.Option(None, "--session", help="One fixed session."),
    paused: bool = typer.Option(False, "--paused", help="Create it paused."),
    gateway: str = GATEWAY,
) -> None:
    """Create a schedule; print it."""
    body: dict[str, Any] = {"cron": cron, "timezone": timezone, "input": text}
    if quiet is not None:
        start, sep, end = quiet.partition("-")
        if not sep:
            fail(f"--quiet {quiet!r}: use HH:MM-HH:MM, e.g. 22:00-07:00")
        body["quiet_hours"] = {"start": start, "end": end}
    for name, value in (
        ("daily_cap", daily_cap),
        ("overlap", overlap),
        ("catchup_s", catchup),
        ("session_id", session),
    ):
        if value is not None:
            body[name] = value
    if paused:
        body["enabled"] = False
    with _client(user, gateway) as client:
        typer.echo(_line(call(client, "POST", "/v1/schedules", json=body)))


@schedules_app.command("pause")
def pause_command(schedule_id: str, user: str = USER, gateway: str = GATEWAY) -> None:
    """Pause: due minutes are skipped until resumed."""
    with _client(user, gateway) as client:
        typer.echo(_line(call(client, "POST", f"/v1/schedules/{schedule_id}/pause")))


@schedules_app.command("resume")
def resume_command(schedule_id: str, user: str = USER, gateway: str = GATEWAY) -> None:
    """Resume from the next fire after now."""
    with _client(user, gateway) as client:
        typer.echo(_line(call(client, "POST", f"/v1/schedules/{schedule_id}/resume")))


@schedules_app.command("delete")
def delete_command(schedule_id: str, user: str = USER, gateway: str = GATEWAY) -> None:
    """Delete a schedule (its runs stay)."""
    with _client(user, gateway) as client:
        try:
            response = client.delete(f"/v1/schedules/{schedule_id}")
        except httpx.HTTPError as exc:
            fail(f"cannot reach the gateway at {gateway}: {exc}")
        if response.status_code != 204:
            try:
                error = response.json()["error"]
                fail(f"HTTP {response.status_code} {error['code']}: {error['message']}")
            except (ValueError, KeyError, TypeError):
                fail(f"HTTP {response.status_code}: {response.text[:200]}")
        typer.echo(json.dumps({"deleted": schedule_id}))
