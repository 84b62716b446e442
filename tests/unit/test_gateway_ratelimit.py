from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from koda_runtime.gateway.ratelimit import TokenBuckets


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_burst_then_refused_with_whole_second_retry_after() -> None:
    clock = Clock()
    buckets = TokenBuckets(rate_per_s=0.5, burst=3, clock=clock)
    assert [buckets.take("u").allowed for _ in range(3)] == [True, True, True]
    refused = buckets.take("u")
    assert not refused.allowed
    assert refused.retry_after_s == 2  # one token at 0.5/s
    clock.now += 1.9
    assert not buckets.take("u").allowed
    clock.now += 0.2
    assert buckets.take("u").allowed


def test_retry_after_is_at_least_one_second_for_fast_rates() -> None:
    clock = Clock()
    buckets = TokenBuckets(rate_per_s=1000, burst=1, clock=clock)
    assert buckets.take("u").allowed
    refused = buckets.take("u")
    assert not refused.allowed and refused.retry_after_s == 1


def test_users_have_separate_buckets() -> None:
    buckets = TokenBuckets(rate_per_s=0.01, burst=1, clock=Clock())
    assert buckets.take("a").allowed
    assert not buckets.take("a").allowed
    assert buckets.take("b").allowed


def test_refill_never_exceeds_burst() -> None:
    clock = Clock()
    buckets = TokenBuckets(rate_per_s=10, burst=2, clock=clock)
    clock.now += 3600
    assert [buckets.take("u").allowed for _ in range(3)] == [True, True, False]


def test_least_recently_used_buckets_are_forgotten() -> None:
    buckets = TokenBuckets(rate_per_s=0.01, burst=1, max_users=2, clock=Clock())
    assert buckets.take("a").allowed
    assert buckets.take("b").allowed
    assert buckets.take("c").allowed  # evicts "a"
    assert buckets.take("a").allowed  # fresh bucket again
    assert not buckets.take("c").allowed


def test_bad_parameters_are_refused() -> None:
    with pytest.raises(ValueError):
        TokenBuckets(rate_per_s=0, burst=1)
    with pytest.raises(ValueError):
        TokenBuckets(rate_per_s=1, burst=0)


@given(
    rate=st.floats(min_value=0.1, max_value=50),
    burst=st.integers(min_value=1, max_value=20),
    gaps=st.lists(st.floats(min_value=0, max_value=2), min_size=1, max_size=200),
)
def test_admissions_never_exceed_burst_plus_refill(
    rate: float, burst: int, gaps: list[float]
) -> None:
    clock = Clock()
    start = clock.now
    buckets = TokenBuckets(rate_per_s=rate, burst=burst, clock=clock)
    allowed = 0
    for gap in gaps:
        clock.now += gap
        decision = buckets.take("u")
        allowed += decision.allowed
        if not decision.allowed:
            assert decision.retry_after_s >= 1
        assert allowed <= burst + (clock.now - start) * rate + 1e-9
