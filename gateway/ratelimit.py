"""Per-user token buckets: ``rate_per_s`` tokens a second, at most ``burst`` saved up.

State is in this process only: with N gateway replicas behind a balancer a user
gets up to N times the rate. That bounds abuse per replica, which is the job of
this limiter; a shared quota belongs in front of the gateways.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class _Bucket:
    tokens: float
    updated: float


@dataclass(frozen=True)
class Decision:
    """``allowed``, or refused with ``retry_after_s`` (whole seconds, >= 1)."""

    allowed: bool
    retry_after_s: int = 0


class TokenBuckets:
    """One token bucket per user, kept for at most ``max_users`` recent users.

    A forgotten user starts again with a full bucket, which is what an idle user
    would have anyway: buckets are evicted least-recently-used, and a user seen
    within the last ``burst / rate_per_s`` seconds is rarely the oldest.
    """

    def __init__(
        self,
        rate_per_s: float,
        burst: int,
        *,
        max_users: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if rate_per_s <= 0 or burst < 1:
            raise ValueError("rate_per_s must be > 0 and burst >= 1")
        self.rate_per_s = rate_per_s
        self.burst = burst
        self._max_users = max_users
        self._clock = clock
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()

    def take(self, user_id: str) -> Decision:
        """Spend one token of ``user_id``'s bucket if there is one."""
        now = self._clock()
        bucket = self._buckets.pop(user_id, None)
        if bucket is None:
            bucket = _Bucket(tokens=float(self.burst), updated=now)
        else:
            elapsed = max(0.0, now - bucket.updated)
            bucket.tokens = min(float(self.burst), bucket.tokens + elapsed * self.rate_per_s)
            bucket.updated = now
        self._buckets[user_id] = bucket
        if len(self._buckets) > self._max_users:
            self._buckets.popitem(last=False)
        if bucket.tokens >= 1.0:
            bucket.tokens -= 1.0
            return Decision(True)
        wait_s = (1.0 - bucket.tokens) / self.rate_per_s
        return Decision(False, retry_after_s=max(1, math.ceil(wait_s)))
