"""Liveness of the chaos run: no partition may sit on waiting runs while nothing moves.

Every few seconds the harness reads, per runs partition, how many runs have waited
``pending`` for longer than the limit and when a run of that partition last started or
ended (Postgres's clock for both). A partition with such runs and no start or end for
longer than ``limit_s`` is *stalled* from its last start or end until its next one. A
stall is a violation: the guarantees at the end would still hold (the run is not
lost), but its user waited for nothing, which is what a fetch left paused, a chain
waiting for good or a cursor left behind looks like from outside.

The limit is far above any fault's own effect (a PostgreSQL cut lasts the handoff
ceiling and a few seconds, a broker comes back within its start timeout while the
other replicas lead), so a stall is a finding and not an injected outage.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

STALL_LIMIT_S = 120.0

_SAMPLE = """
SELECT partition,
       count(*) FILTER (WHERE status = 'pending'
                          AND created_at < now() - make_interval(secs => :limit_s)) AS waiting,
       min(created_at) FILTER (WHERE status = 'pending') AS oldest,
       max(GREATEST(started_at, finished_at)) AS moved_at,
       now() AS at
  FROM runs
 WHERE partition IS NOT NULL
 GROUP BY partition
"""


@dataclass
class Stall:
    partition: int
    since: datetime  # the partition's last start or end before it stalled
    until: datetime | None = None  # its next start or end (None: still stalled)
    owners: set[str] = field(default_factory=set)

    def seconds(self, now: datetime) -> float:
        return ((self.until or now) - self.since).total_seconds()


@dataclass
class StallWatch:
    limit_s: float = STALL_LIMIT_S
    stalls: list[Stall] = field(default_factory=list)
    open: dict[int, Stall] = field(default_factory=dict)
    last_at: datetime | None = None
    samples: int = 0
    longest_idle_s: float = 0.0  # the longest seen: runs pending, nothing started or ended

    def sample(self, rows: list[Any], owners: dict[int, str]) -> list[Stall]:
        """Take one sample (rows of :data:`_SAMPLE`); returns the stalls it opened."""
        opened: list[Stall] = []
        for r in rows:
            self.last_at = r.at
            stall = self.open.get(r.partition)
            if stall is not None and r.moved_at is not None and r.moved_at > stall.since:
                stall.until = r.moved_at
                del self.open[r.partition]
                stall = None
            if r.oldest is None:
                continue
            # Idle since its last start or end, or since its oldest pending run came in,
            # whichever is later (a partition idle before that run was not waiting).
            since = r.oldest if r.moved_at is None else max(r.moved_at, r.oldest)
            idle_s = (r.at - since).total_seconds()
            self.longest_idle_s = max(self.longest_idle_s, idle_s)
            if stall is not None:
                stall.owners.add(owners.get(r.partition, "?"))
                continue
            if r.waiting and idle_s > self.limit_s:
                stall = Stall(r.partition, since, owners={owners.get(r.partition, "?")})
                self.open[r.partition] = stall
                self.stalls.append(stall)
                opened.append(stall)
        self.samples += 1
        return opened

    def look(self, db: Any) -> list[Stall]:
        rows = db.query(_SAMPLE, limit_s=self.limit_s)
        owners = {p: w for p, (_e, w) in db.epochs().items()}
        return self.sample(rows, owners)

    def longest_s(self) -> float | None:
        if self.samples == 0:
            return None
        if not self.stalls or self.last_at is None:
            return self.longest_idle_s
        return max(self.longest_idle_s, *(s.seconds(self.last_at) for s in self.stalls))

    def violations(self) -> list[str]:
        now = self.last_at
        if now is None:
            return []
        return [
            f"partition {s.partition} stalled {s.seconds(now):.0f}s from {s.since:%H:%M:%S}"
            f" ({'still' if s.until is None else 'until ' + format(s.until, '%H:%M:%S')};"
            f" held by {', '.join(sorted(s.owners))}): runs waited while none started or ended"
            for s in self.stalls
        ]
