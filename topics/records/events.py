"""Reading ``run.event/1`` values (written by :func:`.codec.event_value`).

Two variants, told apart by ``event``: a status ``transition`` and a ``usage`` record
(one model call). Fields are checked against :data:`koda_runtime.topics.records.formats.RUN_EVENT`.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal, InvalidOperation

from koda_runtime.errors import RecordError
from koda_runtime.topics.records import formats as spec
from koda_runtime.topics.records.codec import json_object


@dataclass(frozen=True)
class Transition:
    """The run moved to ``to`` at ``at``; ``worker_id`` is set on ``running`` only."""

    run_id: str
    to: str
    attempt: int
    worker_id: str | None
    at: datetime
    reason: str | None = None  # "merged" on a rerun's running; the cancel reason


@dataclass(frozen=True)
class UsageEvent:
    """One model call's tokens; ``cost_usd`` only when the record carries it.

    The ledger fields are absent from older workers' records: ``attempt`` is then 0
    (unknown), ``kind`` chat, ``outcome`` ok (they recorded finished runs only),
    ``estimated`` false, ``user_id`` and ``price_id`` None.
    """

    run_id: str
    call_index: int
    model: str
    prompt_tokens: int
    completion_tokens: int
    cost_usd: Decimal | None
    at: datetime
    user_id: str | None = None
    attempt: int = 0
    kind: str = "chat"
    outcome: str = "ok"
    estimated: bool = False
    price_id: int | None = None


def parse_instant(text: str) -> datetime:
    """An ISO 8601 instant as an aware datetime (no zone means UTC); ValueError if not one."""
    value = datetime.fromisoformat(text)
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


def decode_run_event(value: bytes | None) -> Transition | UsageEvent:
    """Decode one run-events value; raise RecordError (reason ``invalid``, ``unknown_event``)."""
    obj = spec.RUN_EVENT.check(json_object(value))
    try:
        at = parse_instant(obj["at"])
    except ValueError:
        raise RecordError(
            "invalid", f"field 'at' is not an ISO 8601 instant: {obj['at']!r}"
        ) from None
    if obj["event"] == "transition":
        worker = obj.get("worker_id")
        return Transition(obj["run_id"], obj["to"], obj["attempt"], worker, at, obj.get("reason"))
    if obj["event"] == "usage":
        cost = obj.get("cost_usd")
        try:
            money = None if cost is None else Decimal(cost)
        except InvalidOperation:
            raise RecordError("invalid", f"field 'cost_usd' is not a decimal: {cost!r}") from None
        return UsageEvent(
            obj["run_id"],
            obj["call_index"],
            obj["model"],
            obj["prompt_tokens"],
            obj["completion_tokens"],
            money,
            at,
            user_id=obj.get("user_id"),
            attempt=obj.get("attempt") or 0,
            kind=obj.get("kind") or "chat",
            outcome=obj.get("outcome") or "ok",
            estimated=bool(obj.get("estimated", False)),
            price_id=obj.get("price_id"),
        )
    raise RecordError("unknown_event", f"event {obj['event']!r} is not transition or usage")
