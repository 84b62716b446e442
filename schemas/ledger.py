"""The cost ledger's SQL: priced call rows, period spend, prices, budgets, reports.

One module speaks this SQL for the worker (ledger rows), the gateway (admission's
budget read, the usage reports, the budget API) and the CLI (prices, budgets,
reports), so the rules cannot drift apart:

* a call is priced in the statement that writes it, from the newest price of its model
  whose ``effective_from`` is not after the transaction's time; the row keeps that cost
  and the price's id for ever (a price set later never changes it). A model without a
  price costs 0 and has ``price_id`` NULL, so reports can count unpriced calls. Cached
  input tokens and reasoning tokens are parts of the prompt and completion counts,
  priced at the price's cached and reasoning rates (NULL: the prompt or completion
  rate), the rest of each count at the full rate;
* the same statement adds the rows it inserted (not the duplicates it skipped) to the
  user's month and day rows of ``spend_periods``, so spend is exactly the ledger's sum
  and admission reads one row;
* money is ``Decimal`` rounded like ``numeric(18,8)``; sums are exact.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import Connection, text
from sqlalchemy.ext.asyncio import AsyncConnection

from koda_runtime.errors import KodaError
from koda_runtime.lifecycle.ledger import BudgetState, LedgerCall, Period
from koda_runtime.schemas.db import for_driver

GROUPS = ("user", "day", "model", "kind")
USD_PLACES = Decimal("0.00000001")
SHARE_PLACES = Decimal("0.0001")

# Public with its parameters (calls_params) for a writer that sends it itself: the
# worker's group write queues it in a psycopg pipeline (schemas/runs/worker.py).
INSERT_CALLS = text(
    """
    WITH q AS (
        SELECT * FROM unnest(CAST(:users AS text[]), CAST(:runs AS text[]),
                             CAST(:attempts AS int[]), CAST(:idx AS int[]),
                             CAST(:models AS text[]), CAST(:kinds AS text[]),
                             CAST(:pt AS int[]), CAST(:ct AS int[]),
                             CAST(:outcomes AS text[]), CAST(:est AS bool[]),
                             CAST(:cached AS int[]), CAST(:reasoning AS int[]))
              AS q(user_id, run_id, attempt, call_index, model, kind, pt, ct, outcome,
                   estimated, cached, reasoning)
    ), ins AS (
        INSERT INTO ledger (user_id, run_id, attempt, call_index, model, kind, prompt_tokens,
                            completion_tokens, cost_usd, price_id, outcome, estimated,
                            cached_tokens, reasoning_tokens)
        SELECT q.user_id, q.run_id, q.attempt, q.call_index, q.model, q.kind, q.pt, q.ct,
               COALESCE(((q.pt - q.cached) * p.prompt_usd_per_mtok
                         + q.cached * COALESCE(p.cached_prompt_usd_per_mtok,
                                               p.prompt_usd_per_mtok)
                         + (q.ct - q.reasoning) * p.completion_usd_per_mtok
                         + q.reasoning * COALESCE(p.reasoning_usd_per_mtok,
                                                  p.completion_usd_per_mtok)) / 1000000, 0),
               p.id, q.outcome, q.estimated, q.cached, q.reasoning
          FROM q LEFT JOIN LATERAL (
                SELECT id, prompt_usd_per_mtok, completion_usd_per_mtok,
                       cached_prompt_usd_per_mtok, reasoning_usd_per_mtok FROM prices
                 WHERE model = q.model AND effective_from <= now()
                 ORDER BY effective_from DESC LIMIT 1) p ON true
        ON CONFLICT (run_id, attempt, call_index) DO NOTHING
        RETURNING user_id, run_id, attempt, call_index, cost_usd, price_id, created_at
    ), spent AS (
        -- In key order, so two transactions adding to one user's rows cannot deadlock.
        INSERT INTO spend_periods (user_id, period, starts_at, spend_usd, calls)
        SELECT i.user_id, g.period, date_trunc(g.period, i.created_at, 'UTC'),
               sum(i.cost_usd), count(*)
          FROM ins i CROSS JOIN (VALUES ('day'), ('month')) AS g(period)
         GROUP BY 1, 2, 3
         ORDER BY 1, 2, 3
        ON CONFLICT (user_id, period, starts_at) DO UPDATE
           SET spend_usd = spend_periods.spend_usd + EXCLUDED.spend_usd,
               calls = spend_periods.calls + EXCLUDED.calls
    )
    SELECT run_id, attempt, call_index, cost_usd, price_id FROM ins
    """
)


@dataclass(frozen=True)
class PricedCall:
    """A ledger row as written: its cost (USD) and the price row used (None: unpriced)."""

    run_id: str | None
    attempt: int
    call_index: int
    cost_usd: Decimal
    price_id: int | None


async def insert_calls(conn: AsyncConnection, calls: Sequence[LedgerCall]) -> list[PricedCall]:
    """Price and write ``calls`` and add them to their users' period spend, in ``conn``'s
    transaction. Calls already in the ledger (same run, attempt, call index) are skipped
    and not returned: a redelivered or retried write counts once."""
    if not calls:
        return []
    return priced_calls(await conn.execute(INSERT_CALLS, calls_params(calls)))


def calls_params(calls: Sequence[LedgerCall]) -> dict[str, list[Any]]:
    return {
        "users": [c.user_id for c in calls],
        "runs": [c.run_id for c in calls],
        "attempts": [c.attempt for c in calls],
        "idx": [c.call_index for c in calls],
        "models": [c.usage.model for c in calls],
        "kinds": [c.usage.kind for c in calls],
        "pt": [c.usage.prompt_tokens for c in calls],
        "ct": [c.usage.completion_tokens for c in calls],
        "outcomes": [c.outcome.value for c in calls],
        "est": [c.usage.estimated for c in calls],
        "cached": [c.usage.cached_tokens for c in calls],
        "reasoning": [c.usage.reasoning_tokens for c in calls],
    }


def priced_calls(rows: Any) -> list[PricedCall]:
    """The rows :data:`INSERT_CALLS` returns (run_id, attempt, call_index, cost_usd,
    price_id), as written."""
    return [
        PricedCall(r.run_id, int(r.attempt), int(r.call_index), r.cost_usd, r.price_id)
        for r in rows
    ]


# -- budgets -------------------------------------------------------------------------


@dataclass(frozen=True)
class BudgetRead:
    """What admission reads: the state, and which periods already had their soft alert."""

    state: BudgetState
    alerted: frozenset[Period]


def _budget_of(row: Any) -> BudgetRead | None:
    """The budget columns of a row (None when the user has no budget)."""
    if row.soft_ratio is None:
        return None
    alerted = set()
    if row.month_alerted is not None:
        alerted.add(Period.MONTH)
    if row.day_alerted is not None:
        alerted.add(Period.DAY)
    return BudgetRead(
        BudgetState(
            monthly_usd=row.monthly_usd,
            daily_usd=row.daily_usd,
            month_spend_usd=row.month_spend,
            day_spend_usd=row.day_spend,
            soft_ratio=row.soft_ratio,
        ),
        frozenset(alerted),
    )


# What admission reads of a user's budgets: the caps, the current periods' spend and
# whether their soft alert was recorded (``_budget_of`` reads the row). The one budget
# read of admission (schemas/runs/admission.py sends it in its pipeline) and of a merge.
_BUDGETS_OF = text(
    """
    SELECT b.user_id, b.monthly_usd, b.daily_usd, b.soft_ratio,
           COALESCE(m.spend_usd, 0) AS month_spend, COALESCE(d.spend_usd, 0) AS day_spend,
           m.soft_alerted_at AS month_alerted, d.soft_alerted_at AS day_alerted
      FROM budgets b
      LEFT JOIN spend_periods m ON m.user_id = b.user_id AND m.period = 'month'
       AND m.starts_at = date_trunc('month', now(), 'UTC')
      LEFT JOIN spend_periods d ON d.user_id = b.user_id AND d.period = 'day'
       AND d.starts_at = date_trunc('day', now(), 'UTC')
     WHERE b.user_id = ANY(CAST(:users AS text[]))
    """
)


# The same read for the psycopg connection itself (admission's pipeline): parameter
# ``users``; its rows go to budget_reads.
BUDGETS_OF_DRIVER = for_driver(_BUDGETS_OF)


def budget_reads(rows: Iterable[Any]) -> dict[str, BudgetRead]:
    """The rows of the budget read, by user (users without a budget left out)."""
    return {r.user_id: read for r in rows if (read := _budget_of(r)) is not None}


async def budgets_of(conn: AsyncConnection, users: list[str]) -> dict[str, BudgetRead]:
    """Admission's budget read for many users in one statement: each of
    ``users`` that has a budget, with its current periods' spend and soft alerts.
    Not locked, as there: runs admitted concurrently all see the same spend."""
    if not users:
        return {}
    return budget_reads((await conn.execute(_BUDGETS_OF, {"users": users})).all())


_SPENT = text(
    """
    SELECT b.user_id
      FROM budgets b
      LEFT JOIN spend_periods m ON m.user_id = b.user_id AND m.period = 'month'
       AND m.starts_at = date_trunc('month', now(), 'UTC')
      LEFT JOIN spend_periods d ON d.user_id = b.user_id AND d.period = 'day'
       AND d.starts_at = date_trunc('day', now(), 'UTC')
     WHERE b.user_id = ANY(CAST(:users AS text[]))
       -- The rule of koda_runtime.lifecycle.ledger.exceeded (admission applies it in Python).
       AND ((b.monthly_usd IS NOT NULL AND COALESCE(m.spend_usd, 0) >= b.monthly_usd)
         OR (b.daily_usd IS NOT NULL AND COALESCE(d.spend_usd, 0) >= b.daily_usd))
    """
)
# Every user's: the same rule over the whole budgets table (one row per user).
_SPENT_COUNT = text(
    """
    SELECT count(*) FROM budgets b
     WHERE b.monthly_usd <= COALESCE((SELECT spend_usd FROM spend_periods
                                       WHERE user_id = b.user_id AND period = 'month'
                                         AND starts_at = date_trunc('month', now(), 'UTC')), 0)
        OR b.daily_usd <= COALESCE((SELECT spend_usd FROM spend_periods
                                     WHERE user_id = b.user_id AND period = 'day'
                                       AND starts_at = date_trunc('day', now(), 'UTC')), 0)
    """
)


async def spent_users(conn: AsyncConnection, users: list[str]) -> set[str]:
    """Those of ``users`` with a budget spent now: a new run of theirs would be refused."""
    if not users:
        return set()
    return {r.user_id for r in (await conn.execute(_SPENT, {"users": users})).all()}


async def spent_user_count(conn: AsyncConnection) -> int:
    """How many users have a budget spent now (every new run of theirs is refused)."""
    return int((await conn.execute(_SPENT_COUNT)).scalar_one())


_MARK_SOFT = text(
    """
    UPDATE spend_periods SET soft_alerted_at = now()
     WHERE user_id = :user_id AND period = :period
       AND starts_at = date_trunc(:period, now(), 'UTC') AND soft_alerted_at IS NULL
    RETURNING spend_usd
    """
)


async def mark_soft_alert(conn: AsyncConnection, user_id: str, period: Period) -> bool:
    """Record the period's soft-threshold alert; True for the one caller that recorded it
    (whichever gateway gets there first), so it is logged once per user and period."""
    row = (await conn.execute(_MARK_SOFT, {"user_id": user_id, "period": period.value})).first()
    return row is not None


@dataclass(frozen=True)
class Budget:
    user_id: str
    monthly_usd: Decimal | None
    daily_usd: Decimal | None
    soft_ratio: Decimal
    month_spend_usd: Decimal
    day_spend_usd: Decimal
    updated_at: datetime

    def as_json(self) -> dict[str, Any]:
        return {
            "user_id": self.user_id,
            "monthly_usd": money(self.monthly_usd),
            "daily_usd": money(self.daily_usd),
            "soft_ratio": f"{self.soft_ratio:f}",
            "month_spend_usd": money(self.month_spend_usd),
            "day_spend_usd": money(self.day_spend_usd),
            "updated_at": self.updated_at.isoformat(),
        }


_SET_BUDGET = text(
    """
    INSERT INTO budgets (user_id, monthly_usd, daily_usd, soft_ratio, updated_at)
    VALUES (:user_id, :monthly, :daily, :soft, now())
    ON CONFLICT (user_id) DO UPDATE
       SET monthly_usd = EXCLUDED.monthly_usd, daily_usd = EXCLUDED.daily_usd,
           soft_ratio = EXCLUDED.soft_ratio, updated_at = now()
    """
)

_LIST_BUDGETS = text(
    """
    SELECT b.user_id, b.monthly_usd, b.daily_usd, b.soft_ratio, b.updated_at,
           COALESCE(m.spend_usd, 0) AS month_spend, COALESCE(d.spend_usd, 0) AS day_spend
      FROM budgets b
      LEFT JOIN spend_periods m ON m.user_id = b.user_id AND m.period = 'month'
       AND m.starts_at = date_trunc('month', now(), 'UTC')
      LEFT JOIN spend_periods d ON d.user_id = b.user_id AND d.period = 'day'
       AND d.starts_at = date_trunc('day', now(), 'UTC')
     WHERE CAST(:user_id AS text) IS NULL OR b.user_id = :user_id
     ORDER BY b.user_id
    """
)


async def set_budget(
    conn: AsyncConnection,
    user_id: str,
    monthly_usd: Decimal | None,
    daily_usd: Decimal | None,
    soft_ratio: Decimal,
) -> Budget:
    """Set (replace) the user's budgets; a None amount removes that cap."""
    await conn.execute(
        _SET_BUDGET,
        {"user_id": user_id, "monthly": monthly_usd, "daily": daily_usd, "soft": soft_ratio},
    )
    return (await list_budgets(conn, user_id))[0]


async def delete_budget(conn: AsyncConnection, user_id: str) -> bool:
    """Remove the user's budgets (no cap any more); False when there were none."""
    result = await conn.execute(
        text("DELETE FROM budgets WHERE user_id = :user_id"), {"user_id": user_id}
    )
    return bool(result.rowcount)


async def list_budgets(conn: AsyncConnection, user_id: str | None = None) -> list[Budget]:
    rows = await conn.execute(_LIST_BUDGETS, {"user_id": user_id})
    return [
        Budget(
            r.user_id,
            r.monthly_usd,
            r.daily_usd,
            r.soft_ratio,
            r.month_spend,
            r.day_spend,
            r.updated_at,
        )
        for r in rows
    ]


# -- prices --------------------------------------------------------------------------


@dataclass(frozen=True)
class Price:
    """A model's price from a time on. ``cached_prompt_usd_per_mtok`` and
    ``reasoning_usd_per_mtok`` price cached input and reasoning tokens; None: the prompt
    or completion price applies to them."""

    id: int
    model: str
    effective_from: datetime
    prompt_usd_per_mtok: Decimal
    completion_usd_per_mtok: Decimal
    cached_prompt_usd_per_mtok: Decimal | None = None
    reasoning_usd_per_mtok: Decimal | None = None

    def as_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "model": self.model,
            "effective_from": self.effective_from.isoformat(),
            "prompt_usd_per_mtok": f"{self.prompt_usd_per_mtok:f}",
            "completion_usd_per_mtok": f"{self.completion_usd_per_mtok:f}",
            "cached_prompt_usd_per_mtok": _rate(self.cached_prompt_usd_per_mtok),
            "reasoning_usd_per_mtok": _rate(self.reasoning_usd_per_mtok),
        }


def _rate(value: Decimal | None) -> str | None:
    return None if value is None else f"{value:f}"


class PriceRefused(KodaError, ValueError):
    """A price that would rewrite history (its time is past) or already exists."""


_SET_PRICE = text(
    """
    INSERT INTO prices (model, effective_from, prompt_usd_per_mtok, completion_usd_per_mtok,
                        cached_prompt_usd_per_mtok, reasoning_usd_per_mtok)
    SELECT :model, COALESCE(CAST(:at AS timestamptz), now()), :prompt, :completion,
           CAST(:cached AS numeric), CAST(:reasoning AS numeric)
     WHERE COALESCE(CAST(:at AS timestamptz), now()) >= now()
    ON CONFLICT (model, effective_from) DO NOTHING
    RETURNING id, model, effective_from, prompt_usd_per_mtok, completion_usd_per_mtok,
              cached_prompt_usd_per_mtok, reasoning_usd_per_mtok
    """
)


async def set_price(
    conn: AsyncConnection,
    model: str,
    prompt_usd_per_mtok: Decimal,
    completion_usd_per_mtok: Decimal,
    effective_from: datetime | None,
    *,
    cached_prompt_usd_per_mtok: Decimal | None = None,
    reasoning_usd_per_mtok: Decimal | None = None,
) -> Price:
    """Add a price for ``model`` from ``effective_from`` (None: now) on; the cached input
    and reasoning rates are optional (None: the prompt or completion rate).

    Raises PriceRefused for a time already past (the calls of that time are priced;
    history is never rewritten) or when the model already has a price at that time.
    """
    row = (
        await conn.execute(
            _SET_PRICE,
            {
                "model": model,
                "at": effective_from,
                "prompt": prompt_usd_per_mtok,
                "completion": completion_usd_per_mtok,
                "cached": cached_prompt_usd_per_mtok,
                "reasoning": reasoning_usd_per_mtok,
            },
        )
    ).first()
    if row is None:
        past = (
            await conn.execute(
                text("SELECT CAST(:at AS timestamptz) < now()"), {"at": effective_from}
            )
        ).scalar()
        if past:
            raise PriceRefused(
                f"--from {effective_from.isoformat() if effective_from else 'now'} is in the"
                " past: calls of that time are already priced, history is never rewritten;"
                " give a time from now on"
            )
        raise PriceRefused(
            f"{model} already has a price from {effective_from}: prices are never changed,"
            " set a new one from a later time"
        )
    return Price(*row)


async def list_prices(conn: AsyncConnection, model: str | None = None) -> list[Price]:
    rows = await conn.execute(
        text(
            """
            SELECT id, model, effective_from, prompt_usd_per_mtok, completion_usd_per_mtok,
                   cached_prompt_usd_per_mtok, reasoning_usd_per_mtok
              FROM prices WHERE CAST(:model AS text) IS NULL OR model = :model
             ORDER BY model, effective_from
            """
        ),
        {"model": model},
    )
    return [Price(*r) for r in rows]


_PRICE_HISTORY = text(
    "SELECT model, effective_from, prompt_usd_per_mtok, completion_usd_per_mtok"
    " FROM prices ORDER BY model, effective_from"
)


def price_history(conn: Connection) -> Sequence[Any]:
    """Every price (``model, effective_from, prompt_usd_per_mtok,
    completion_usd_per_mtok``), oldest first per model: the replay prices usage with it
    (topics/replay/prices.py)."""
    return conn.execute(_PRICE_HISTORY).all()


# -- reports -------------------------------------------------------------------------

_KEYS = {
    "user": "user_id",
    "day": "to_char(date_trunc('day', created_at, 'UTC') AT TIME ZONE 'UTC', 'YYYY-MM-DD')",
    "model": "model",
    "kind": "kind",
}
_KEY_NAMES = {"user": "user_id", "day": "day", "model": "model", "kind": "kind"}

_FIGURES = """
    COALESCE(sum(cost_usd), 0) AS cost_usd,
    COALESCE(sum(prompt_tokens), 0) AS prompt_tokens,
    COALESCE(sum(completion_tokens), 0) AS completion_tokens,
    COALESCE(sum(cached_tokens), 0) AS cached_tokens,
    COALESCE(sum(reasoning_tokens), 0) AS reasoning_tokens,
    COALESCE(sum(CASE WHEN cached_tokens > 0 THEN cached_tokens * (
        SELECT COALESCE(p.cached_prompt_usd_per_mtok, p.prompt_usd_per_mtok)
          FROM prices p WHERE p.id = ledger.price_id) END) / 1000000, 0) AS cached_cost_usd,
    COALESCE(sum(CASE WHEN reasoning_tokens > 0 THEN reasoning_tokens * (
        SELECT COALESCE(p.reasoning_usd_per_mtok, p.completion_usd_per_mtok)
          FROM prices p WHERE p.id = ledger.price_id) END) / 1000000, 0) AS reasoning_cost_usd,
    count(*) AS calls,
    count(DISTINCT run_id) AS runs,
    count(DISTINCT user_id) AS users,
    COALESCE(sum(cost_usd) FILTER (WHERE outcome = 'failed'), 0) AS failed_cost_usd,
    COALESCE(sum(cost_usd) FILTER (WHERE outcome = 'cancelled'), 0) AS cancelled_cost_usd,
    count(*) FILTER (WHERE estimated) AS estimated_calls,
    count(*) FILTER (WHERE price_id IS NULL) AS unpriced_calls
"""

_WHERE = """
     WHERE (CAST(:user_id AS text) IS NULL OR user_id = :user_id)
       AND (CAST(:since AS timestamptz) IS NULL OR created_at >= :since)
       AND (CAST(:until AS timestamptz) IS NULL OR created_at < :until)
"""


def money(value: Decimal | None) -> str | None:
    """USD as a decimal string with 8 places (never a float); None stays None."""
    return None if value is None else f"{Decimal(value).quantize(USD_PLACES):f}"


def _ratio(num: Decimal, den: int | Decimal) -> str | None:
    if not den:
        return None
    return f"{(Decimal(num) / Decimal(den)).quantize(USD_PLACES):f}"


def _figures(row: Any) -> dict[str, Any]:
    cost = Decimal(row.cost_usd)
    wasted = Decimal(row.failed_cost_usd) + Decimal(row.cancelled_cost_usd)
    return {
        "cost_usd": money(cost),
        "prompt_tokens": int(row.prompt_tokens),
        "completion_tokens": int(row.completion_tokens),
        "cached_tokens": int(row.cached_tokens),
        "reasoning_tokens": int(row.reasoning_tokens),
        "cached_cost_usd": money(row.cached_cost_usd),
        "reasoning_cost_usd": money(row.reasoning_cost_usd),
        "calls": int(row.calls),
        "runs": int(row.runs),
        "active_users": int(row.users),
        "cost_per_run_usd": _ratio(cost, int(row.runs)),
        "cost_per_active_user_usd": _ratio(cost, int(row.users)),
        "failed_cost_usd": money(row.failed_cost_usd),
        "cancelled_cost_usd": money(row.cancelled_cost_usd),
        "failed_or_cancelled_share": (
            f"{(wasted / cost).quantize(SHARE_PLACES):f}" if cost else None
        ),
        "estimated_calls": int(row.estimated_calls),
        "unpriced_calls": int(row.unpriced_calls),
    }


async def usage_report(
    conn: AsyncConnection,
    group_by: str,
    *,
    user_id: str | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
) -> dict[str, Any]:
    """``{"rows": [...], "totals": {...}}`` over ledger rows with ``since <= created_at <
    until`` (either bound optional), of ``user_id`` only when given. Each row holds its
    group key and the figures; money is a decimal string."""
    if group_by not in GROUPS:
        raise ValueError(f"group_by must be one of {', '.join(GROUPS)}, not {group_by!r}")
    key = _KEYS[group_by]
    params = {"user_id": user_id, "since": since, "until": until}
    rows = await conn.execute(
        text(
            f"SELECT {key} AS k, {_FIGURES} FROM ledger {_WHERE}"  # noqa: S608 - fixed texts
            " GROUP BY 1 ORDER BY 1"
        ),
        params,
    )
    out = [{_KEY_NAMES[group_by]: r.k, **_figures(r)} for r in rows]
    totals = (
        await conn.execute(text(f"SELECT {_FIGURES} FROM ledger {_WHERE}"), params)  # noqa: S608
    ).one()
    return {"rows": out, "totals": _figures(totals)}


_RUN_COST = text(
    "SELECT coalesce(sum(cost_usd), 0) AS cost, count(*) AS calls FROM ledger"
    " WHERE run_id = :run_id"
)


async def run_cost(conn: AsyncConnection, run_id: str) -> tuple[Decimal, int]:
    """What a run cost over all its attempts, and its billable calls (the console's
    timeline)."""
    row = (await conn.execute(_RUN_COST, {"run_id": run_id})).one()
    return Decimal(row.cost), int(row.calls)
