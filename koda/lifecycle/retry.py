"""Retry policy: at most ``max_attempts`` attempts, jittered exponential backoff."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class RetryPolicy:
    """``base_s`` doubles per attempt, capped at ``cap_s``; full jitter in [0.5, 1.0]."""

    max_attempts: int = 3
    base_s: float = 0.5
    cap_s: float = 10.0

    def exhausted(self, attempt: int) -> bool:
        """True when ``attempt`` (1-based, the one that just failed) was the last allowed."""
        return attempt >= self.max_attempts

    def backoff_s(self, attempt: int, rng: random.Random | None = None) -> float:
        """Seconds to wait after failed ``attempt`` (1-based) before the next one."""
        r = rng or random
        raw = min(self.cap_s, self.base_s * (2 ** max(0, attempt - 1)))
        return float(raw * (0.5 + r.random() * 0.5))  # noqa: S311 - jitter, not crypto
