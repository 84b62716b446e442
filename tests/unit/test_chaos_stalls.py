"""The chaos run's liveness watch (tests/chaos/stalls.py): what counts as a stall."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

from tests.chaos.stalls import StallWatch

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


def row(p: int, at_s: float, moved_s: float | None, oldest_s: float | None, waiting: int) -> object:
    def ts(s: float | None) -> datetime | None:
        return None if s is None else T0 + timedelta(seconds=s)

    return SimpleNamespace(
        partition=p, at=ts(at_s), moved_at=ts(moved_s), oldest=ts(oldest_s), waiting=waiting
    )


def test_a_partition_waiting_with_nothing_moving_past_the_limit_is_a_stall_until_it_moves() -> None:
    w = StallWatch(limit_s=120)
    assert not w.sample([row(3, 100, 0, 10, 0)], {3: "w1"})
    opened = w.sample([row(3, 200, 0, 10, 4)], {3: "w1"})
    assert [s.partition for s in opened] == [3]
    assert not w.sample([row(3, 230, 0, 10, 4)], {3: "w2"})  # still the same stall
    w.sample([row(3, 260, 250, 10, 3)], {3: "w2"})  # a run started at 250: it moved
    (stall,) = w.stalls
    assert stall.until == T0 + timedelta(seconds=250)
    assert stall.owners == {"w1", "w2"}
    assert stall.seconds(T0) == 240
    assert w.violations() and "partition 3 stalled 240s" in w.violations()[0]


def test_a_busy_partition_or_one_idle_before_its_run_came_is_not_a_stall() -> None:
    w = StallWatch(limit_s=120)
    # Moving every few seconds with a backlog: never a stall.
    for t in range(0, 600, 5):
        assert not w.sample([row(1, t + 3, t, 0, 50)], {})
    # Idle for an hour, then a run that waits 30 s: measured from the run, not the hour.
    assert not w.sample([row(2, 3630, 0, 3600, 0)], {})
    assert w.longest_idle_s == 30
    assert not w.stalls
    assert w.violations() == []


def test_no_pending_run_means_no_wait() -> None:
    w = StallWatch(limit_s=120)
    w.sample([row(5, 1000, 0, None, 0)], {})
    assert w.longest_idle_s == 0 and not w.stalls
