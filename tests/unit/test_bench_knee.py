"""The W2 knee search, its "sustainable" rule and the goals verdicts (pure code)."""

from __future__ import annotations

from tests.bench import knee
from tests.bench.common import Table
from tests.bench.goals import GOALS, goals_table


def step_at(
    rate: float, slope: float, unfinished: int = 0, lags_ms: tuple[float, float] = (0.0, 0.0)
) -> knee.Step:
    return knee.Step(rate, slope, *lags_ms, unfinished, 10, [0.01], [0.1], rate)


def machine(capacity: float) -> tuple[list[float], object]:
    """A fake step whose backlog grows above ``capacity`` chunks/s."""
    tried: list[float] = []

    def step(rate: float) -> knee.Step:
        tried.append(rate)
        over = max(0.0, rate - capacity) / rate
        return step_at(rate, over)

    return tried, step


def test_search_brackets_then_bisects_to_the_highest_sustainable_rate() -> None:
    tried, step = machine(2_600)
    found, steps = knee.search(step, 1_000, 2.0, 3, 40_000)  # type: ignore[arg-type]
    assert tried[:3] == [1_000, 2_000, 4_000]  # grows until a step fails
    assert 2_000 <= found <= 2_600 and all(s.rate == r for s, r in zip(steps, tried, strict=True))
    assert found == max(s.rate for s in steps if s.sustainable)


def test_search_goes_down_when_the_first_rate_is_too_high() -> None:
    tried, step = machine(300)
    found, _ = knee.search(step, 1_000, 2.0, 2, 40_000)  # type: ignore[arg-type]
    assert tried[:3] == [1_000, 500, 250]
    assert 250 <= found <= 300


def test_a_climbing_lag_or_an_unfinished_run_is_not_sustainable() -> None:
    assert step_at(100, knee.SLOPE_LIMIT).sustainable
    assert not step_at(100, knee.SLOPE_LIMIT * 1.01).sustainable
    assert not step_at(100, 0.0, unfinished=1).sustainable
    assert step_at(100, -0.5, lags_ms=(400, 200)).sustainable  # a warm-up's bump draining


def test_a_step_far_behind_its_schedule_is_not_sustainable_even_as_it_drains() -> None:
    limit = knee.LAG_LIMIT_S * 1000
    assert step_at(100, 0.0, lags_ms=(limit, limit)).sustainable
    # Seen at 6,000 chunks/s: from a drained start the warm-up built a 9 s backlog,
    # which then fell; its negative slope made the step pass and the 80 % step overload.
    assert not step_at(100, -0.16, lags_ms=(8_960, 6_496)).sustainable
    assert not step_at(100, 0.0, lags_ms=(200, limit + 1)).sustainable


def test_slope_is_the_least_squares_fit() -> None:
    assert knee.slope([(0, 1.0), (1, 1.5), (2, 2.0)]) == 0.5
    assert knee.slope([(5, 1.0)]) == 0.0


def test_goals_are_judged_from_the_median_and_missing_figures_are_not_met() -> None:
    t = Table("x", ["a"])
    t.figures = {"w2_lat99": [90.0, 200.0, 140.0], "w3_rps_32": [1_400.0, 1_600.0, 1_450.0]}
    rendered = goals_table([t], None, False).render()
    verdicts = {g.figure: g.judge(t.figures)[1] for g in GOALS}
    assert verdicts["w2_lat99"] == "met"  # median 140 <= 150, though one rep was 200
    assert verdicts["w3_rps_32"] == "NOT MET"  # median 1,450 < 1,500
    assert verdicts["replay_ratio"] == "not measured"
    assert f"1 of {len(GOALS)} goals met" in rendered
