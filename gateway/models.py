"""Response bodies and the documented request body, for OpenAPI and serialisation.

Requests are validated by :mod:`koda_runtime.gateway.intake` (it must name the field at fault
in koda's error shape, and refuse deep nesting before building objects);
:class:`RunSubmission` only documents the same contract in ``/openapi.json``.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class RunSubmission(BaseModel):
    """Body of ``POST /v1/runs``."""

    model_config = ConfigDict(extra="forbid")

    session_id: str | None = Field(
        None,
        description="An existing session of yours, or a new id to create one; "
        "omitted: a new session.",
        pattern=r"^[A-Za-z0-9._:@-]{1,128}$",
    )
    input: dict[str, Any] | str = Field(
        description='The job input; a string is shorthand for {"text": <string>}. '
        "At most 32 levels of nesting."
    )
    metadata: dict[str, Any] | None = Field(None, description="Opaque to koda; stored as given.")
    client_message_id: str | None = Field(
        None,
        pattern=r"^[\x21-\x7e]{1,200}$",
        description="The client's id of this message (1-200 printable ASCII chars, no "
        "spaces; a new one per message, the same one when resending it). Without an "
        "Idempotency-Key header the key is derived from it, so a repeated message with a "
        "new id is a new run. Without either, the same body is one run only within "
        "KODA_DEDUP_WINDOW_S (10 s by default).",
    )


class RunAccepted(BaseModel):
    """``202`` answer of ``POST /v1/runs``; the same key always yields the same run_id."""

    run_id: str
    status: str
    events_url: str
    merged: bool = Field(
        False,
        description="True when the message was merged into the session's running run "
        "(running or streaming, created less than KODA_MERGE_WINDOW_S ago, 30 s by "
        "default): run_id names that run, which starts over on both messages.",
    )


class ErrorDetail(BaseModel):
    code: str = Field(description="Machine-readable, e.g. invalid_field, rate_limited.")
    message: str = Field(description="What was wrong and how to fix it.")
    field: str | None = Field(description="The body field or header at fault, if any.")


class ErrorBody(BaseModel):
    """Every error answer has this shape."""

    error: ErrorDetail


def error_responses(described: dict[int, str]) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` for a route: each status answers an :class:`ErrorBody`."""
    return {status: {"model": ErrorBody, "description": d} for status, d in described.items()}


class Health(BaseModel):
    """``/livez`` and ``/readyz``: ``ok`` or ``unavailable``, with one entry per check."""

    status: str
    checks: dict[str, str] = Field(default_factory=dict)


# --- run control (cancel, history) ----------------------------------------------------


class CancelRequest(BaseModel):
    """Optional body of ``POST /v1/runs/{run_id}/cancel``."""

    model_config = ConfigDict(extra="forbid")

    reason: str | None = Field(
        None, max_length=500, description="Shown in the terminal `cancelled` event."
    )


class RunCancel(BaseModel):
    """Answer of ``POST /v1/runs/{run_id}/cancel``.

    ``200``: the run is terminal (it was pending and is now ``cancelled``, or it had
    already ended: nothing changed). ``202``: the run is running; the cancel request is
    durable and the worker ends it ``cancelled`` (watch ``events_url``).
    """

    run_id: str
    status: str
    cancel_requested: bool
    cancel_reason: str | None
    events_url: str


class RunSummary(BaseModel):
    """One run in a history listing: the wire form of
    :class:`koda_runtime.schemas.runs.control.ListedRun`."""

    run_id: str
    session_id: str
    status: str
    attempt: int
    created_at: datetime
    finished_at: datetime | None
    cancel_reason: str | None
    merged_messages: int = Field(description="Messages merged into this run.")
    schedule_id: str | None = Field(None, description="The schedule that fired it, if any.")
    scheduled_for: datetime | None = Field(
        None, description="The scheduled UTC minute it was fired for, if scheduled."
    )


class RunPage(BaseModel):
    """A page of runs, newest first; pass ``next_before`` as ``before`` for the next."""

    runs: list[RunSummary]
    next_before: str | None


class OperatorRunSummary(RunSummary):
    """One run in the operators' listing across users."""

    user_id: str


class OperatorRunPage(BaseModel):
    """A page of every user's runs, newest first; ``next_before`` as for :class:`RunPage`."""

    runs: list[OperatorRunSummary]
    next_before: str | None
