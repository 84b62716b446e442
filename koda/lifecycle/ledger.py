"""The cost ledger's rules, free of I/O: calls, outcomes, budget periods and decisions.

A ledger row is one billable call of one attempt, written as soon as the model reports
the call's usage: then its outcome is ``ok``. What the attempt's end finds unwritten
(a call it cut, estimated) takes the attempt's outcome: ``ok`` (the attempt finished
the run), ``failed`` (the handler failed), or ``cancelled`` (the attempt was cut off: a
handoff ceiling, a cancel). Money is
``Decimal`` everywhere; periods are UTC calendar months and days, so a budget resets
by itself when the next period starts (no reset job to forget).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from enum import StrEnum

from koda_runtime.errors import Refused
from koda_runtime.lifecycle.handler import Usage


class Outcome(StrEnum):
    OK = "ok"
    FAILED = "failed"
    CANCELLED = "cancelled"


class Period(StrEnum):
    MONTH = "month"
    DAY = "day"


@dataclass(frozen=True)
class LedgerCall:
    """One ledger row before pricing: whose call, which attempt, what it counted."""

    user_id: str
    run_id: str | None  # None: system work that belongs to no run
    attempt: int
    call_index: int
    usage: Usage
    outcome: Outcome


def calls_of(
    user_id: str, run_id: str, attempt: int, usage: list[Usage], outcome: Outcome
) -> list[LedgerCall]:
    """An attempt's usage records as ledger calls, numbered in the order they came."""
    return [LedgerCall(user_id, run_id, attempt, i, u, outcome) for i, u in enumerate(usage)]


def period_start(period: Period, at: datetime) -> datetime:
    """The UTC start of the month or day holding ``at``."""
    at = at.astimezone(UTC)
    if period is Period.MONTH:
        return at.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    return at.replace(hour=0, minute=0, second=0, microsecond=0)


def period_end(period: Period, at: datetime) -> datetime:
    """When the period holding ``at`` ends, i.e. when its budget resets."""
    start = period_start(period, at)
    if period is Period.DAY:
        return start + timedelta(days=1)
    if start.month == 12:
        return start.replace(year=start.year + 1, month=1)
    return start.replace(month=start.month + 1)


@dataclass(frozen=True)
class BudgetState:
    """A user's budgets and what the current periods have spent (USD)."""

    monthly_usd: Decimal | None
    daily_usd: Decimal | None
    month_spend_usd: Decimal
    day_spend_usd: Decimal
    soft_ratio: Decimal


@dataclass(frozen=True)
class Exceeded:
    """The budget a new run would break: which, its limit, the spend, when it resets."""

    period: Period
    limit_usd: Decimal
    spend_usd: Decimal
    resets_at: datetime


class OverBudget(Refused):
    """A new run (or a merge) refused: ``over`` is the budget it would break. Nothing
    was written."""

    def __init__(self, user_id: str, over: Exceeded) -> None:
        super().__init__(f"user {user_id} is over the {over.period.value}ly budget")
        self.over = over


def exceeded(state: BudgetState, now: datetime) -> Exceeded | None:
    """The first budget whose period has spent its limit, or None: a run may start.

    A run is refused once spend >= limit. A run admitted below the limit is checked
    again with every usage record it writes: once spend reaches the limit it stops
    after the current model call (``budget_exceeded``, processors/streaming.py), so it
    passes the limit by at most that call.
    """
    for period, limit, spend in (
        (Period.DAY, state.daily_usd, state.day_spend_usd),
        (Period.MONTH, state.monthly_usd, state.month_spend_usd),
    ):
        if limit is not None and spend >= limit:
            return Exceeded(period, limit, spend, period_end(period, now))
    return None


def soft_crossed(state: BudgetState) -> list[Period]:
    """The periods whose spend reached ``soft_ratio`` of their budget."""
    out = []
    for period, limit, spend in (
        (Period.MONTH, state.monthly_usd, state.month_spend_usd),
        (Period.DAY, state.daily_usd, state.day_spend_usd),
    ):
        if limit is not None and spend >= limit * state.soft_ratio:
            out.append(period)
    return out


MAX_USD = Decimal("9999999999")  # numeric(18,8) holds 10 digits before the point


def parse_usd(raw: object, name: str) -> Decimal:
    """A USD amount from a decimal string or a JSON number (never through a float):
    finite, >= 0, at most 8 decimal places. ValueError naming ``name`` otherwise."""
    if isinstance(raw, bool) or not isinstance(raw, str | int | Decimal):
        raise ValueError(f'{name} must be a decimal string such as "20.00", got {raw!r}')
    try:
        value = Decimal(raw.strip() if isinstance(raw, str) else raw)
    except ArithmeticError:
        raise ValueError(f"{name} must be a decimal number such as 20.00, got {raw!r}") from None
    if not value.is_finite() or value < 0:
        raise ValueError(f"{name} must be a finite amount >= 0, got {raw!r}")
    if value > MAX_USD:
        raise ValueError(f"{name} must be at most {MAX_USD}, got {raw!r}")
    if value != value.quantize(Decimal("0.00000001")):
        raise ValueError(f"{name} has more than 8 decimal places: {raw!r}")
    return value


def parse_time(raw: str, name: str) -> datetime:
    """An ISO 8601 date (midnight UTC) or date-time (no zone means UTC); ValueError
    naming ``name`` otherwise."""
    text = raw.strip()
    try:
        value = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(
            f"{name} must be an ISO 8601 date or date-time such as 2026-01-31 or "
            f"2026-01-31T12:00:00Z, got {raw!r}"
        ) from None
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


def check_window(since: datetime | None, until: datetime | None) -> None:
    """Refuse an empty or reversed report window."""
    if since is not None and until is not None and since >= until:
        raise ValueError(f"from ({since.isoformat()}) must be before to ({until.isoformat()})")
