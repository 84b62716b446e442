"""When a schedule fires, and whether a fire runs: pure code, no I/O, the clock injected.

A schedule is a 5-field cron expression read on the wall clock of an IANA time zone.
:class:`CronSpec` turns it into the UTC minutes at which it fires; :func:`plan` decides,
for every scheduled minute that is due, whether it fires, is skipped (with a reason) or
was missed, and where the next fire is. The scheduler process (scheduler/) supplies the
facts from Postgres and acts on the plan; nothing here reads a clock or a database.

Daylight saving, per time zone (the rule Debian's cron follows):

* A cron whose hour field is ``*`` (every hour) follows the real clock: in a skipped
  hour nothing fires (those minutes never happen), and in a repeated hour it fires in
  both passes (each pass is a real hour).
* A cron with fixed hours fires once per matching local time: a local time that does not
  exist (spring-forward, e.g. 02:30 in Europe/Berlin on the last Sunday of March) fires
  at the same instant it would have without the jump, i.e. read with the offset in
  force before it (02:30 CET = 03:30 CEST); a local time that happens twice (fall-back)
  fires at its first occurrence only. So a daily 02:30 fires exactly once every day.

Two local times that land on one UTC minute fire once: the UTC minute is the fire's
identity (``sched:<schedule_id>:<UTC minute>``).
"""

from __future__ import annotations

import functools
import heapq
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, time, timedelta
from enum import Enum
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import croniter
from croniter.croniter import CroniterError

from koda_runtime.errors import KodaError

EXAMPLE_CRON = "30 2 * * 1-5"
EXAMPLE_TIMEZONE = "Europe/Berlin"
MINUTE = timedelta(minutes=1)
# No zone moves its clock by more than 2 h at once; scanning from 3 h back sees every
# transition whose skipped or repeated local times could still be ahead of an instant.
_LOOKBACK = timedelta(hours=3)
# A cron longer than this is refused before it is parsed (the "never fires" probe walks
# the horizon below inside the request; a long list of values makes each step dearer).
MAX_CRON_CHARS = 100
# A cron that matches no time within this horizon never fires (e.g. "0 0 31 2 *").
HORIZON_YEARS = 8
# Names the zone database holds that are not a place: ``localtime`` and ``posixrules``
# are whatever the host links them to, so two replicas (or the gateway that accepted a
# schedule and the scheduler that fires it) could read one schedule on two clocks;
# ``posix/`` and ``right/`` are copies of the zones (``right/`` counts leap seconds for
# readers that honour them, unlike Python).
_HOST_ZONES = frozenset({"localtime", "posixrules"})
_HOST_ZONE_TREES = ("posix/", "right/")
# Missed fires beyond this many are counted as this many (a year of a per-minute
# schedule is not enumerated to be thrown away).
MISSED_COUNT_LIMIT = 10_000


class ScheduleInvalid(KodaError):
    """A schedule field is invalid; ``field`` names it, the message shows a valid example."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


def _offset(tz: ZoneInfo, instant: datetime) -> timedelta:
    off = instant.astimezone(tz).utcoffset()
    assert off is not None
    return off


@dataclass(frozen=True)
class Transition:
    """The zone's UTC offset changes from ``before`` to ``after`` at ``at`` (UTC)."""

    at: datetime
    before: timedelta
    after: timedelta


@functools.lru_cache(maxsize=4096)
def _transitions(zone: str, year: int) -> tuple[Transition, ...]:
    """Every offset change of ``zone`` in the UTC calendar ``year``, to the second."""
    tz = ZoneInfo(zone)
    t = datetime(year, 1, 1, tzinfo=UTC)
    end = datetime(year + 1, 1, 1, tzinfo=UTC)
    off = _offset(tz, t)
    found: list[Transition] = []
    while t < end:
        step = min(t + timedelta(days=1), end)
        new = _offset(tz, step)
        if new != off:
            lo, hi = int(t.timestamp()), int(step.timestamp())
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if _offset(tz, datetime.fromtimestamp(mid, UTC)) == off:
                    lo = mid
                else:
                    hi = mid
            found.append(Transition(datetime.fromtimestamp(hi, UTC), off, new))
            off = new
        t = step
    return tuple(found)


def _next_transition(zone: str, after: datetime, until: datetime) -> Transition | None:
    for year in range(after.year, until.year + 1):
        for tr in _transitions(zone, year):
            if after < tr.at:
                return tr if tr.at <= until else None
    return None


def _naive(instant: datetime, offset: timedelta) -> datetime:
    return (instant + offset).replace(tzinfo=None)


def _utc(local: datetime, offset: timedelta) -> datetime:
    return (local - offset).replace(tzinfo=UTC)


@dataclass(frozen=True)
class CronSpec:
    """A validated 5-field cron expression on the wall clock of an IANA zone."""

    expression: str
    timezone: str
    follows_clock: bool = field(compare=False)

    @classmethod
    def parse(cls, expression: object, timezone: object) -> CronSpec:
        """Validate both; ScheduleInvalid names ``cron`` or ``timezone`` with an example.

        Valid pairs are remembered (a scheduler parses the same few crons all day)."""
        if isinstance(expression, str) and isinstance(timezone, str):
            return _parse(expression, timezone)
        return cls._parse(expression, timezone)

    @classmethod
    def _parse(cls, expression: object, timezone: object) -> CronSpec:
        if isinstance(expression, str) and len(expression) > MAX_CRON_CHARS:
            raise ScheduleInvalid(
                "cron",
                f"cron is {len(expression)} characters, over {MAX_CRON_CHARS}; "
                f'e.g. "{EXAMPLE_CRON}"',
            )
        if not isinstance(expression, str) or len(expression.split()) != 5:
            raise ScheduleInvalid(
                "cron",
                "cron must be a 5-field cron expression (minute hour day-of-month month "
                f'day-of-week), e.g. "{EXAMPLE_CRON}" (02:30 on weekdays)',
            )
        expression = " ".join(expression.split())
        try:
            expanded = croniter(expression).expanded
        except (CroniterError, ValueError, KeyError) as exc:
            raise ScheduleInvalid(
                "cron", f'cron {expression!r} is not valid ({exc}); e.g. "{EXAMPLE_CRON}"'
            ) from None
        if not isinstance(timezone, str) or not timezone or len(timezone) > 64:
            raise ScheduleInvalid(
                "timezone", f'timezone must be an IANA time zone name, e.g. "{EXAMPLE_TIMEZONE}"'
            )
        if timezone in _HOST_ZONES or timezone.startswith(_HOST_ZONE_TREES):
            raise ScheduleInvalid(
                "timezone",
                f"timezone {timezone!r} depends on the host's zone files, not on a place; "
                f'name the zone itself, e.g. "{EXAMPLE_TIMEZONE}" or "UTC"',
            )
        try:
            ZoneInfo(timezone)
        except (ZoneInfoNotFoundError, ValueError, OSError):
            raise ScheduleInvalid(
                "timezone",
                f'timezone {timezone[:64]!r} is not an IANA time zone; e.g. "{EXAMPLE_TIMEZONE}"'
                ' or "UTC"',
            ) from None
        hours = expanded[1]
        spec = cls(expression, timezone, follows_clock=hours == ["*"] or len(hours) == 24)
        probe = datetime(2000, 1, 1, tzinfo=UTC)
        if next(spec.fires_after(probe), None) is None:
            raise ScheduleInvalid("cron", f'cron {expression!r} never fires; e.g. "{EXAMPLE_CRON}"')
        return spec

    @property
    def zone(self) -> ZoneInfo:
        return ZoneInfo(self.timezone)

    def fires_after(self, after: datetime) -> Iterator[datetime]:
        """The UTC instants (whole minutes) the schedule fires at, strictly after ``after``,
        ascending, each once; ends after the horizon (``HORIZON_YEARS``)."""
        tz = self.zone
        until = after + timedelta(days=365 * HORIZON_YEARS)
        start = after - _LOOKBACK
        previous: Transition | None = None
        last: datetime | None = None
        while start < until:
            tr = _next_transition(self.timezone, start, until)
            seg_end = tr.at if tr is not None else until
            # Matching starts at ``after``; the look-back only finds the transition.
            for instant in self._segment(tz, max(start, after), seg_end, previous):
                if instant > after and (last is None or instant > last):
                    last = instant
                    yield instant
            previous, start = tr, seg_end
            if tr is None:
                return

    def _segment(
        self, tz: ZoneInfo, start: datetime, end: datetime, entered: Transition | None
    ) -> Iterator[datetime]:
        """Fires in [start, end), a stretch of constant offset entered through ``entered``."""
        off = _offset(tz, start)
        regular = self._matches(_naive(start, off) - MINUTE, _naive(end, off), off)
        if entered is None or self.follows_clock:
            yield from regular
            return
        if entered.after > entered.before:  # spring-forward: local times were skipped
            gap_from = max(_naive(entered.at, entered.before), _naive(start, entered.before))
            gap_to = _naive(entered.at, off)
            skipped = self._matches(gap_from - MINUTE, gap_to, entered.before)
            yield from heapq.merge(regular, skipped)
            return
        # Fall-back: local times before this moment's local time plus the shift were
        # already seen under the earlier offset; they fire only the first time.
        repeated_until = _utc(_naive(entered.at, entered.before), off)
        yield from (t for t in regular if t >= repeated_until)

    def _matches(self, after: datetime, before: datetime, off: timedelta) -> Iterator[datetime]:
        """UTC instants of the local times in (after, before) matching the cron, read at ``off``."""
        it = croniter(self.expression, after)
        while True:
            try:
                local = it.get_next(datetime)
            except CroniterError:  # no match left within croniter's own search bound
                return
            if local >= before:
                return
            yield _utc(local, off)

    def local(self, instant: datetime) -> datetime:
        return instant.astimezone(self.zone)

    def day_bounds(self, day: date) -> tuple[datetime, datetime]:
        """The UTC span [start, end) of the local calendar ``day``."""
        tz = self.zone
        start = datetime.combine(day, time(0), tzinfo=tz).astimezone(UTC)
        end = datetime.combine(day + timedelta(days=1), time(0), tzinfo=tz).astimezone(UTC)
        return start, end


@functools.lru_cache(maxsize=4096)
def _parse(expression: str, timezone: str) -> CronSpec:
    return CronSpec._parse(expression, timezone)


@functools.lru_cache(maxsize=4096)
def _first_after(spec: CronSpec, after: datetime) -> datetime | None:
    return next(spec.fires_after(after), None)


def minute_floor(instant: datetime) -> datetime:
    """``instant`` truncated to its UTC minute."""
    return instant.astimezone(UTC).replace(second=0, microsecond=0)


@dataclass(frozen=True)
class QuietHours:
    """A local-time window [start, end) in minutes of the day; start > end crosses midnight."""

    start: int
    end: int

    def __post_init__(self) -> None:
        if not (0 <= self.start < 1440 and 0 <= self.end < 1440) or self.start == self.end:
            raise ScheduleInvalid(
                "quiet_hours",
                'quiet_hours needs two different times, e.g. {"start": "22:00", "end": "07:00"}',
            )

    def contains(self, local: datetime) -> bool:
        minute = local.hour * 60 + local.minute
        if self.start < self.end:
            return self.start <= minute < self.end
        return minute >= self.start or minute < self.end

    @staticmethod
    def text(minute: int) -> str:
        return f"{minute // 60:02d}:{minute % 60:02d}"


class Overlap(str, Enum):
    SKIP = "skip"  # skip a fire while the schedule's previous run is not terminal
    ALLOW = "allow"


class Outcome(str, Enum):
    FIRE = "fire"
    SKIP = "skip"
    MISSED = "missed"


class SkipReason(str, Enum):
    PAUSED = "paused"
    QUIET_HOURS = "quiet_hours"
    OVERLAP = "overlap"
    DAILY_CAP = "daily_cap"
    BUDGET = "budget"


@dataclass(frozen=True)
class Policy:
    """What decides whether a due minute runs (defaults: README.md, "Scheduled runs")."""

    enabled: bool = True
    quiet_hours: QuietHours | None = None
    daily_cap: int = 1440
    overlap: Overlap = Overlap.SKIP
    catchup_s: int = 900


@dataclass(frozen=True)
class Facts:
    """What Postgres says, read before planning.

    ``runs_per_day``: the owner's scheduled runs per local day (the schedule's zone) for
    the days of the due minutes; ``previous_active``: the schedule's latest run before
    the first due minute is not terminal; ``over_budget``: one of the owner's cost budgets
    is spent (a scheduled run is a new run like any other, refused the same way).
    """

    runs_per_day: Mapping[date, int] = field(default_factory=dict)
    previous_active: bool = False
    over_budget: bool = False


@dataclass(frozen=True)
class Decision:
    minute: datetime
    outcome: Outcome
    reason: SkipReason | None = None


@dataclass(frozen=True)
class Plan:
    """Decisions for the due minutes, oldest first, and the next fire after them.

    ``missed`` counts minutes outside the catch-up window (at most MISSED_COUNT_LIMIT;
    ``missed_truncated`` says the real number is larger). ``next_fire_at`` is None when
    the cron fires no more within the horizon.
    """

    decisions: tuple[Decision, ...]
    missed: int
    missed_truncated: bool
    next_fire_at: datetime | None

    @property
    def fires(self) -> list[datetime]:
        return [d.minute for d in self.decisions if d.outcome is Outcome.FIRE]


def due_minutes(
    spec: CronSpec, first: datetime, now: datetime, catchup_s: int, *, limit: int
) -> tuple[list[datetime], int, bool]:
    """Due minutes from ``first`` (a fire time) to ``now`` inside the catch-up window (at most
    ``limit``), and how many before it were missed (bounded by MISSED_COUNT_LIMIT).

    Remembered per arguments: the schedules of one pass often share all of them."""
    due, missed, truncated = _due_minutes(spec, first, now, catchup_s, limit)
    return list(due), missed, truncated


@functools.lru_cache(maxsize=1024)
def _due_minutes(
    spec: CronSpec, first: datetime, now: datetime, catchup_s: int, limit: int
) -> tuple[tuple[datetime, ...], int, bool]:
    window_start = now - timedelta(seconds=catchup_s)
    missed, truncated = 0, False
    current: datetime | None = first
    fires = spec.fires_after(first)
    while current is not None and current < window_start:
        missed += 1
        if missed >= MISSED_COUNT_LIMIT:
            truncated = True
            fires = spec.fires_after(window_start - timedelta(microseconds=1))
            current = next(fires, None)
            while current is not None and current < window_start:
                current = next(fires, None)
            break
        current = next(fires, None)
    due: list[datetime] = []
    while current is not None and current <= now and len(due) < limit:
        due.append(current)
        current = next(fires, None)
    return tuple(due), missed, truncated


def plan(
    spec: CronSpec,
    policy: Policy,
    first: datetime,
    now: datetime,
    facts: Facts,
    *,
    limit: int = 1000,
) -> Plan:
    """Decide every due minute from ``first`` (the persisted next fire) up to ``now``.

    Minutes older than the catch-up window are missed (never run late). Inside it each
    minute, oldest first, is skipped for the first reason that applies: ``paused``,
    ``quiet_hours`` (its local time is in the window), ``overlap`` (policy skip and the
    schedule's previous run, possibly fired just before in this plan, is not terminal),
    ``daily_cap`` (the owner already has that many scheduled runs that local day),
    ``budget`` (one of the owner's cost budgets is spent); otherwise it fires. At most
    ``limit`` minutes are decided; the next plan continues.
    """
    due, missed, truncated = due_minutes(spec, first, now, policy.catchup_s, limit=limit)
    per_day = dict(facts.runs_per_day)
    active = facts.previous_active
    decisions: list[Decision] = []
    for minute in due:
        local = spec.local(minute)
        reason: SkipReason | None = None
        if not policy.enabled:
            reason = SkipReason.PAUSED
        elif policy.quiet_hours is not None and policy.quiet_hours.contains(local):
            reason = SkipReason.QUIET_HOURS
        elif policy.overlap is Overlap.SKIP and active:
            reason = SkipReason.OVERLAP
        elif per_day.get(local.date(), 0) >= policy.daily_cap:
            reason = SkipReason.DAILY_CAP
        elif facts.over_budget:
            reason = SkipReason.BUDGET
        if reason is not None:
            decisions.append(Decision(minute, Outcome.SKIP, reason))
            continue
        decisions.append(Decision(minute, Outcome.FIRE))
        per_day[local.date()] = per_day.get(local.date(), 0) + 1
        active = True
    # A plan cut at ``limit`` goes on after its last minute; otherwise after ``now``.
    after = due[-1] if len(due) >= limit else now
    next_fire = _first_after(spec, after)
    return Plan(tuple(decisions), missed, truncated, next_fire)


def days_of(spec: CronSpec, minutes: list[datetime]) -> list[date]:
    """The distinct local days of ``minutes``, for :class:`Facts`."""
    return sorted({spec.local(m).date() for m in minutes})
