"""Bounded-pool drill 1 in the suite: the handler's downstream is out for 6 s (60 s in
`make chaos`); in flight stays within KODA_MAX_INFLIGHT, retries and queue age rise
within their bounds, and koda recovers by itself once the downstream heals.

6 s is enough for every bound to be reached: the failing runs spend their three
attempts (0.5 s base backoff) within it, and the slow ones (a second a chunk) keep the
three slots full, so runs queue behind them."""

from __future__ import annotations

from koda_runtime.settings import Settings
from tests.chaos.drills import downstream_outage


def test_downstream_outage_stays_bounded_and_heals_by_itself(env: Settings) -> None:
    result = downstream_outage(env, 6.0, limit=3, users=12, runs_per_user=3)
    print(result.table())
    assert not result.problems, "\n".join(result.problems) + "\n" + result.table()
    assert result.max_in_flight == 3
    assert result.recovered_s < 60
