"""Pricing usage records the way the worker prices them in Postgres.

``run.event/1`` usage records carry token counts; the worker computes the cost at write
time from koda's ``prices`` table (the row in force for the model, else 0) into
``usage.cost_usd numeric(18,8)``. The replay reads that table once, read-only, and
applies the same rule at the record's ``at``, so the warehouse's money equals
Postgres's. A record that carries ``cost_usd`` itself is taken as it is.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass, field
from datetime import datetime
from decimal import ROUND_HALF_UP, Decimal

from sqlalchemy.exc import SQLAlchemyError

from koda_runtime.schemas.db import sync_engine
from koda_runtime.schemas.ledger import price_history
from koda_runtime.settings import Settings

log = logging.getLogger("koda.replay")

CENT_MICROS = Decimal("0.00000001")  # numeric(18,8): the scale of Postgres usage.cost_usd
PER_MTOK = Decimal(1_000_000)


@dataclass(frozen=True)
class Price:
    effective_from: datetime
    prompt_usd_per_mtok: Decimal
    completion_usd_per_mtok: Decimal


@dataclass
class PriceBook:
    """Prices per model, oldest first. ``loaded`` is False when koda's table was not read."""

    by_model: dict[str, list[Price]] = field(default_factory=dict)
    loaded: bool = True

    def cost(
        self, model: str, prompt_tokens: int, completion_tokens: int, at: datetime
    ) -> Decimal | None:
        """USD for one call at ``at``, rounded like numeric(18,8); 0 when no price is in
        force (the worker's rule); None when the book was not loaded."""
        if not self.loaded:
            return None
        prices = self.by_model.get(model, [])
        i = bisect.bisect_right([p.effective_from for p in prices], at)
        if i == 0:
            return Decimal(0).quantize(CENT_MICROS)
        p = prices[i - 1]
        raw = (
            prompt_tokens * p.prompt_usd_per_mtok + completion_tokens * p.completion_usd_per_mtok
        ) / PER_MTOK
        return raw.quantize(CENT_MICROS, rounding=ROUND_HALF_UP)


def load_prices(settings: Settings) -> PriceBook:
    """Read koda's price table (one SELECT); an unloaded book when Postgres cannot be read.

    Never fails the replay: without prices, ``usage.cost_usd`` stays null and the
    summary says why.
    """
    engine = sync_engine(settings, pool_size=1)
    try:
        with engine.connect() as conn:
            rows = price_history(conn)
    except SQLAlchemyError as exc:
        log.warning("event=prices_unavailable error=%s", type(exc).__name__)
        return PriceBook(loaded=False)
    finally:
        engine.dispose()
    book = PriceBook()
    for model, since, prompt, completion in rows:
        book.by_model.setdefault(model, []).append(
            Price(since, Decimal(prompt), Decimal(completion))
        )
    return book
