"""The ledger's pure rules: periods and resets, budget decisions, money parsing."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone
from decimal import Decimal

import pytest

from koda_runtime.lifecycle.handler import Usage
from koda_runtime.lifecycle.ledger import (
    BudgetState,
    Period,
    exceeded,
    parse_time,
    parse_usd,
    period_end,
    period_start,
    soft_crossed,
)


def state(**kw: object) -> BudgetState:
    base: dict[str, object] = {
        "monthly_usd": Decimal("20"),
        "daily_usd": None,
        "month_spend_usd": Decimal("0"),
        "day_spend_usd": Decimal("0"),
        "soft_ratio": Decimal("0.8"),
    }
    base.update(kw)
    return BudgetState(**base)  # type: ignore[arg-type]


def test_periods_are_utc_calendar_months_and_days() -> None:
    late = datetime(2026, 12, 31, 23, 30, tzinfo=UTC)
    assert period_start(Period.MONTH, late) == datetime(2026, 12, 1, tzinfo=UTC)
    assert period_end(Period.MONTH, late) == datetime(2027, 1, 1, tzinfo=UTC)
    assert period_end(Period.DAY, late) == datetime(2027, 1, 1, tzinfo=UTC)
    # 01:30 in UTC+2 is still the previous UTC day.
    east = datetime(2026, 3, 1, 1, 30, tzinfo=timezone(timedelta(hours=2)))
    assert period_start(Period.DAY, east) == datetime(2026, 2, 28, tzinfo=UTC)
    assert period_end(Period.MONTH, east) == datetime(2026, 3, 1, tzinfo=UTC)


def test_a_budget_is_spent_at_its_limit_and_names_itself() -> None:
    now = datetime(2026, 5, 17, 12, tzinfo=UTC)
    assert exceeded(state(month_spend_usd=Decimal("19.99999999")), now) is None
    over = exceeded(state(month_spend_usd=Decimal("20")), now)
    assert over is not None and over.period is Period.MONTH
    assert over.resets_at == datetime(2026, 6, 1, tzinfo=UTC)
    daily = exceeded(state(daily_usd=Decimal("1"), day_spend_usd=Decimal("1.5")), now)
    assert daily is not None and daily.period is Period.DAY
    assert daily.resets_at == datetime(2026, 5, 18, tzinfo=UTC)
    assert exceeded(state(monthly_usd=None), now) is None


def test_the_soft_threshold_is_a_share_of_each_budget() -> None:
    assert soft_crossed(state(month_spend_usd=Decimal("15.99"))) == []
    assert soft_crossed(state(month_spend_usd=Decimal("16"))) == [Period.MONTH]


@pytest.mark.parametrize(
    ("raw", "value"), [("20.00", Decimal("20")), (7, Decimal(7)), (Decimal("0.5"), Decimal("0.5"))]
)
def test_money_parses_exactly(raw: object, value: Decimal) -> None:
    assert parse_usd(raw, "x") == value


@pytest.mark.parametrize(
    "raw", ["-1", "abc", "NaN", "Infinity", "1e400", "0.000000001", 1.5, True, None, "20,00"]
)
def test_bad_money_is_refused_by_name(raw: object) -> None:
    with pytest.raises(ValueError, match="^x "):
        parse_usd(raw, "x")


def test_times_without_a_zone_are_utc() -> None:
    assert parse_time("2026-01-31", "from") == datetime(2026, 1, 31, tzinfo=UTC)
    assert parse_time("2026-01-31T12:00:00Z", "to") == datetime(2026, 1, 31, 12, tzinfo=UTC)
    with pytest.raises(ValueError, match="^from must be"):
        parse_time("last week", "from")


def test_usage_refuses_an_unknown_kind_and_negative_counts() -> None:
    with pytest.raises(ValueError, match="kind"):
        Usage("m", 1, 1, kind="image")
    with pytest.raises(ValueError, match="negative"):
        Usage("m", -1, 1)
