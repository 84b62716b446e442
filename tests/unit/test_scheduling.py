"""The scheduling decisions (koda/scheduling.py) with an injected clock: pure, no services."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta
from itertools import islice

import pytest

from koda_runtime.scheduling import (
    MISSED_COUNT_LIMIT,
    CronSpec,
    Facts,
    Outcome,
    Overlap,
    Policy,
    QuietHours,
    ScheduleInvalid,
    SkipReason,
    plan,
)

BERLIN = "Europe/Berlin"
SPRING_2026 = date(2026, 3, 29)  # 02:00 CET -> 03:00 CEST
FALL_2026 = date(2026, 10, 25)  # 03:00 CEST -> 02:00 CET


def utc(
    year: int, month: int, day: int, hour: int = 0, minute: int = 0, second: int = 0
) -> datetime:
    return datetime(year, month, day, hour, minute, second, tzinfo=UTC)


def fires(spec: CronSpec, after: datetime, n: int) -> list[datetime]:
    return list(islice(spec.fires_after(after), n))


def test_a_daily_0230_in_berlin_fires_once_a_day_across_both_dst_changes() -> None:
    spec = CronSpec.parse("30 2 * * *", BERLIN)
    for change in (SPRING_2026, FALL_2026):
        got = fires(spec, utc(change.year, change.month, change.day - 3), 7)
        days = [spec.local(t).date() for t in got]
        assert days == [change + timedelta(days=i) for i in range(-3, 4)]
    # The skipped 02:30 fires at 03:30 CEST (read with the offset before the jump) ...
    spring = fires(spec, utc(2026, 3, 28, 12), 1)[0]
    assert spring == utc(2026, 3, 29, 1, 30)
    assert spec.local(spring).strftime("%H:%M%z") == "03:30+0200"
    # ... and the doubled 02:30 at its first occurrence only (CEST).
    fall = fires(spec, utc(2026, 10, 24, 12), 2)
    assert fall == [utc(2026, 10, 25, 0, 30), utc(2026, 10, 26, 1, 30)]


def test_an_instant_in_the_second_pass_of_the_repeated_hour_does_not_refire() -> None:
    spec = CronSpec.parse("30 2 * * *", BERLIN)
    # 02:40 CET on the fall-back day: 02:30 already fired in the first pass.
    assert fires(spec, utc(2026, 10, 25, 1, 40), 1) == [utc(2026, 10, 26, 1, 30)]
    assert fires(spec, utc(2026, 10, 25, 0, 40), 1) == [utc(2026, 10, 26, 1, 30)]


def test_an_every_hour_cron_follows_the_real_clock_through_dst() -> None:
    spec = CronSpec.parse("0 * * * *", BERLIN)
    spring = fires(spec, utc(2026, 3, 28, 23, 30), 4)
    assert spring == [utc(2026, 3, 29, h) for h in range(4)]  # each real hour once
    fall = fires(spec, utc(2026, 10, 24, 22, 30), 5)
    assert fall == [utc(2026, 10, 24, 23)] + [utc(2026, 10, 25, h) for h in range(4)]
    locals_ = [spec.local(t).strftime("%H%z") for t in fall]
    assert locals_ == ["01+0200", "02+0200", "02+0100", "03+0100", "04+0100"]


def test_every_minute_crosses_the_fall_back_without_gap_or_repeat() -> None:
    spec = CronSpec.parse("* * * * *", BERLIN)
    got = fires(spec, utc(2026, 10, 24, 23, 59), 180)
    assert got == [utc(2026, 10, 25, 0, 0) + timedelta(minutes=i) for i in range(180)]


def test_fires_are_whole_minutes_strictly_after_the_instant() -> None:
    spec = CronSpec.parse("*/15 * * * *", "UTC")
    assert fires(spec, utc(2026, 1, 1, 10, 15, 0), 2) == [
        utc(2026, 1, 1, 10, 30),
        utc(2026, 1, 1, 10, 45),
    ]
    assert fires(spec, datetime(2026, 1, 1, 10, 29, 59, 999, tzinfo=UTC), 1) == [
        utc(2026, 1, 1, 10, 30)
    ]


@pytest.mark.parametrize(
    ("cron", "zone", "field"),
    [
        ("61 * * * *", "UTC", "cron"),
        ("* * * *", "UTC", "cron"),
        ("* * * * * *", "UTC", "cron"),
        ("@daily", "UTC", "cron"),
        ("0 0 31 2 *", "UTC", "cron"),
        # Over 100 characters: refused before the "never fires" probe walks it.
        (",".join(str(m) for m in range(60)) + " * * * *", "UTC", "cron"),
        (5, "UTC", "cron"),
        ("* * * * *", "Mars/Olympus", "timezone"),
        ("* * * * *", "../../etc/passwd", "timezone"),
        # The host's own links: replicas on differently set hosts would disagree.
        ("* * * * *", "localtime", "timezone"),
        ("* * * * *", "posixrules", "timezone"),
        ("* * * * *", "right/Europe/Berlin", "timezone"),
        ("* * * * *", "posix/UTC", "timezone"),
        ("* * * * *", "", "timezone"),
        ("* * * * *", None, "timezone"),
    ],
)
def test_bad_cron_or_zone_names_the_field_and_shows_an_example(
    cron: object, zone: object, field: str
) -> None:
    with pytest.raises(ScheduleInvalid) as err:
        CronSpec.parse(cron, zone)
    assert err.value.field == field
    assert ("30 2 * * 1-5" if field == "cron" else "Europe/Berlin") in err.value.message


def _plan(spec: CronSpec, policy: Policy, first: datetime, now: datetime, **facts: object):
    return plan(spec, policy, first, now, Facts(**facts))  # type: ignore[arg-type]


def test_quiet_hours_across_midnight_skip_only_inside_the_window() -> None:
    spec = CronSpec.parse("0 * * * *", BERLIN)
    quiet = QuietHours(22 * 60, 7 * 60)
    policy = Policy(quiet_hours=quiet, overlap=Overlap.ALLOW, catchup_s=86400)
    # 19:00 local (CET) on one day to 09:00 the next.
    got = _plan(spec, policy, utc(2026, 1, 10, 18), utc(2026, 1, 11, 8))
    by_hour = {spec.local(d.minute).hour: d for d in got.decisions}
    assert [h for h, d in by_hour.items() if d.outcome is Outcome.FIRE] == [19, 20, 21, 7, 8, 9]
    skipped = [h for h, d in by_hour.items() if d.reason is SkipReason.QUIET_HOURS]
    assert skipped == [22, 23, 0, 1, 2, 3, 4, 5, 6]
    assert got.next_fire_at == utc(2026, 1, 11, 9)


def test_quiet_hours_within_one_day() -> None:
    quiet = QuietHours(12 * 60, 13 * 60 + 30)
    spec = CronSpec.parse("*/30 * * * *", "UTC")
    assert quiet.contains(spec.local(utc(2026, 1, 1, 12, 0)))
    assert quiet.contains(spec.local(utc(2026, 1, 1, 13, 29)))
    assert not quiet.contains(spec.local(utc(2026, 1, 1, 13, 30)))
    assert not quiet.contains(spec.local(utc(2026, 1, 1, 11, 59)))
    with pytest.raises(ScheduleInvalid):
        QuietHours(600, 600)


def test_a_spent_budget_skips_every_due_minute_and_the_schedule_moves_on() -> None:
    spec = CronSpec.parse("0 * * * *", "UTC")
    policy = Policy(overlap=Overlap.ALLOW, catchup_s=86400)
    got = _plan(spec, policy, utc(2026, 1, 1, 20), utc(2026, 1, 1, 22), over_budget=True)
    assert [(d.outcome, d.reason) for d in got.decisions] == [(Outcome.SKIP, SkipReason.BUDGET)] * 3
    assert got.fires == [] and got.next_fire_at == utc(2026, 1, 1, 23)
    # Pause and quiet hours still name themselves first.
    paused = _plan(
        spec, Policy(enabled=False), utc(2026, 1, 1, 20), utc(2026, 1, 1, 20), over_budget=True
    )
    assert [d.reason for d in paused.decisions] == [SkipReason.PAUSED]


def test_the_daily_cap_counts_the_users_runs_of_that_local_day() -> None:
    spec = CronSpec.parse("0 * * * *", "UTC")
    policy = Policy(daily_cap=3, overlap=Overlap.ALLOW, catchup_s=86400)
    got = _plan(
        spec,
        policy,
        utc(2026, 1, 1, 20),
        utc(2026, 1, 2, 2),
        runs_per_day={date(2026, 1, 1): 2, date(2026, 1, 2): 0},
    )
    outcomes = [(d.minute.hour, d.outcome, d.reason) for d in got.decisions]
    assert outcomes == [
        (20, Outcome.FIRE, None),  # the user's third run of 1 January
        (21, Outcome.SKIP, SkipReason.DAILY_CAP),
        (22, Outcome.SKIP, SkipReason.DAILY_CAP),
        (23, Outcome.SKIP, SkipReason.DAILY_CAP),
        (0, Outcome.FIRE, None),  # a new local day
        (1, Outcome.FIRE, None),
        (2, Outcome.FIRE, None),
    ]


def test_overlap_skip_while_the_previous_run_is_active_and_allow_fires_anyway() -> None:
    spec = CronSpec.parse("* * * * *", "UTC")
    first, now = utc(2026, 1, 1, 10, 0), utc(2026, 1, 1, 10, 2, 30)
    skip = _plan(spec, Policy(overlap=Overlap.SKIP), first, now, previous_active=True)
    assert [d.reason for d in skip.decisions] == [SkipReason.OVERLAP] * 3
    # Not active: the first fires, and the run it starts blocks the next ones.
    idle = _plan(spec, Policy(overlap=Overlap.SKIP), first, now, previous_active=False)
    assert [d.outcome for d in idle.decisions] == [Outcome.FIRE, Outcome.SKIP, Outcome.SKIP]
    allow = _plan(spec, Policy(overlap=Overlap.ALLOW), first, now, previous_active=True)
    assert [d.outcome for d in allow.decisions] == [Outcome.FIRE] * 3


def test_a_paused_schedule_skips_with_a_reason_and_moves_on() -> None:
    spec = CronSpec.parse("* * * * *", "UTC")
    got = _plan(spec, Policy(enabled=False), utc(2026, 1, 1, 10), utc(2026, 1, 1, 10, 1, 5))
    assert [d.reason for d in got.decisions] == [SkipReason.PAUSED] * 2
    assert got.fires == []
    assert got.next_fire_at == utc(2026, 1, 1, 10, 2)


def test_catch_up_replays_the_window_oldest_first_and_counts_older_minutes_missed() -> None:
    spec = CronSpec.parse("* * * * *", "UTC")
    policy = Policy(overlap=Overlap.ALLOW, catchup_s=120)
    # Down from 10:00 to 10:05:30: 10:00..10:03 are older than 120 s, 10:04, 10:05 not.
    got = _plan(spec, policy, utc(2026, 1, 1, 10, 0), utc(2026, 1, 1, 10, 5, 30))
    assert got.fires == [utc(2026, 1, 1, 10, 4), utc(2026, 1, 1, 10, 5)]
    assert got.missed == 4 and not got.missed_truncated
    assert got.next_fire_at == utc(2026, 1, 1, 10, 6)


def test_a_minute_exactly_at_the_window_edge_still_runs() -> None:
    spec = CronSpec.parse("* * * * *", "UTC")
    got = _plan(spec, Policy(catchup_s=60), utc(2026, 1, 1, 10, 0), utc(2026, 1, 1, 10, 1))
    assert got.fires[:1] == [utc(2026, 1, 1, 10, 0)]
    assert got.missed == 0


def test_catchup_zero_runs_only_the_current_minute() -> None:
    spec = CronSpec.parse("* * * * *", "UTC")
    got = _plan(spec, Policy(catchup_s=0), utc(2026, 1, 1, 9), utc(2026, 1, 1, 10, 0, 0))
    assert got.fires == [utc(2026, 1, 1, 10, 0)]
    assert got.missed == 60


def test_a_year_of_missed_minutes_is_bounded_work() -> None:
    spec = CronSpec.parse("* * * * *", "UTC")
    got = _plan(spec, Policy(catchup_s=60), utc(2025, 1, 1), utc(2026, 1, 1, 0, 0, 30))
    assert got.missed == MISSED_COUNT_LIMIT and got.missed_truncated
    assert got.fires == [utc(2025, 12, 31, 23, 59, 30) + timedelta(seconds=30)]
    assert got.next_fire_at == utc(2026, 1, 1, 0, 1)


def test_a_plan_cut_at_its_limit_continues_where_it_stopped() -> None:
    spec = CronSpec.parse("* * * * *", "UTC")
    policy = Policy(overlap=Overlap.ALLOW, catchup_s=3600)
    now = utc(2026, 1, 1, 11)
    got = plan(spec, policy, utc(2026, 1, 1, 10), now, Facts(), limit=10)
    assert got.fires == [utc(2026, 1, 1, 10, i) for i in range(10)]
    assert got.next_fire_at == utc(2026, 1, 1, 10, 10)


def test_nothing_due_keeps_the_next_fire() -> None:
    spec = CronSpec.parse("30 2 * * *", BERLIN)
    got = _plan(spec, Policy(), utc(2026, 1, 2, 1, 30), utc(2026, 1, 1, 12))
    assert got.decisions == () and got.next_fire_at == utc(2026, 1, 2, 1, 30)


def test_the_skip_reasons_apply_in_order() -> None:
    spec = CronSpec.parse("0 23 * * *", "UTC")
    everything = Policy(
        enabled=False, quiet_hours=QuietHours(22 * 60, 60), daily_cap=1, overlap=Overlap.SKIP
    )
    got = _plan(
        spec,
        everything,
        utc(2026, 1, 1, 23),
        utc(2026, 1, 1, 23, 0, 5),
        previous_active=True,
        runs_per_day={date(2026, 1, 1): 9},
    )
    assert [d.reason for d in got.decisions] == [SkipReason.PAUSED]
    for policy, reason in (
        (Policy(quiet_hours=QuietHours(22 * 60, 60), daily_cap=1), SkipReason.QUIET_HOURS),
        (Policy(daily_cap=1, overlap=Overlap.SKIP), SkipReason.OVERLAP),
        (Policy(daily_cap=1, overlap=Overlap.ALLOW), SkipReason.DAILY_CAP),
    ):
        got = _plan(
            spec,
            policy,
            utc(2026, 1, 1, 23),
            utc(2026, 1, 1, 23, 0, 5),
            previous_active=True,
            runs_per_day={date(2026, 1, 1): 9},
        )
        assert [d.reason for d in got.decisions] == [reason]


def test_day_bounds_follow_the_zone_including_a_23_hour_day() -> None:
    spec = CronSpec.parse("* * * * *", BERLIN)
    start, end = spec.day_bounds(SPRING_2026)
    assert start == utc(2026, 3, 28, 23) and end == utc(2026, 3, 29, 22)
