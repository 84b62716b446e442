"""What a person sees: a progress line while replaying, and a summary at the end.

The progress line goes to stderr: rewritten in place (``\\r``) on a terminal, a new line
every 5 s otherwise (logs, CI). It shows records read, records/s over the last
interval, and the remaining lag: the total, and the partitions furthest behind.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TextIO

TP = tuple[str, int]
SHOWN_PARTITIONS = 4


@dataclass
class ReplaySummary:
    """What a replay did. ``rows`` counts upserted rows per table (re-reads included)."""

    sink: str | None
    topics: list[str]
    start: str
    job: str | None
    dry_run: bool
    records: int = 0
    per_topic: Counter[str] = field(default_factory=Counter)
    rows: Counter[str] = field(default_factory=Counter)
    raw: Counter[str] = field(default_factory=Counter)
    tombstones: int = 0
    batches: int = 0
    seconds: float = 0.0
    resumed_partitions: int = 0
    stopped: bool = False
    prices_loaded: bool = True
    erased: int = 0  # records and exported rows of erased users, dropped
    positions: dict[TP, int] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        """Records per second over the whole replay."""
        return self.records / self.seconds if self.seconds > 0 else 0.0

    def lines(self) -> list[str]:
        """The summary, for people."""
        verb = "counted" if self.dry_run else "replayed"
        where = "" if self.dry_run or self.sink is None else f" into {self.sink}"
        state = " (stopped early)" if self.stopped else ""
        out = [
            f"{verb} {self.records:,} records in {self.seconds:.1f} s "
            f"({self.rate:,.0f} records/s){where}{state}; from {self.start}",
        ]
        for topic in self.topics:
            out.append(f"  {topic:<40} {self.per_topic[topic]:>10,} records")
        label = "rows (would write)" if self.dry_run else "rows upserted"
        tables = ", ".join(f"{name} {n:,}" for name, n in sorted(self.rows.items()))
        out.append(f"  {label}: {tables or 'none'}")
        if self.raw:
            reasons = ", ".join(f"{r} {n}" for r, n in sorted(self.raw.items()))
            out.append(f"  kept raw in raw_records: {sum(self.raw.values())} ({reasons})")
        if self.tombstones:
            out.append(
                f"  tombstones: {self.tombstones:,} (compacted chunk keys;"
                " rows already read are kept)"
            )
        if self.erased:
            out.append(f"  dropped as erased users' data: {self.erased:,} records and rows")
        if not self.prices_loaded:
            out.append("  usage.cost_usd left null: koda's price table could not be read")
        if self.job is not None:
            resumed = (
                f"resumed {self.resumed_partitions} partitions; " if self.resumed_partitions else ""
            )
            out.append(
                f"  job {self.job}: {resumed}progress committed;"
                f" rerun with --job {self.job} to continue"
            )
        return out


class Progress:
    """Throttled progress output; ``enabled=False`` prints nothing."""

    def __init__(
        self, stream: TextIO | None = None, *, enabled: bool = True, every_s: float | None = None
    ) -> None:
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = self.stream.isatty()
        self.every_s = every_s if every_s is not None else (0.5 if self.tty else 5.0)
        self._last = time.monotonic()
        self._last_records = 0
        self._written = False

    def update(self, summary: ReplaySummary, lag: Mapping[TP, int], *, force: bool = False) -> None:
        now = time.monotonic()
        if not self.enabled or (not force and now - self._last < self.every_s):
            return
        rate = (summary.records - self._last_records) / max(now - self._last, 1e-6)
        self._last, self._last_records = now, summary.records
        line = f"replay {summary.records:,} records  {rate:,.0f} records/s  {lag_text(lag)}"
        if self.tty:
            self.stream.write("\r" + line[:200].ljust(100))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
        self._written = True

    def finish(self) -> None:
        if self.enabled and self.tty and self._written:
            self.stream.write("\n")
            self.stream.flush()


def lag_text(lag: Mapping[TP, int]) -> str:
    """``lag 1,234 (run-chunks/3 800, runs/0 400, ...)``: the partitions furthest behind."""
    behind = sorted(((n, tp) for tp, n in lag.items() if n > 0), reverse=True)
    total = sum(n for n, _ in behind)
    if not behind:
        return "lag 0"
    shown = ", ".join(f"{short(t)}/{p} {n:,}" for n, (t, p) in behind[:SHOWN_PARTITIONS])
    more = f", +{len(behind) - SHOWN_PARTITIONS} more" if len(behind) > SHOWN_PARTITIONS else ""
    return f"lag {total:,} ({shown}{more})"


def short(topic: str) -> str:
    """A topic's last name part (``dev.koda.run-chunks`` → ``run-chunks``)."""
    return topic.rsplit(".", 1)[-1]
