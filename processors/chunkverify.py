"""``koda chunks verify``: does the chunk topic hold every chunk Postgres holds?

For every run that reached a terminal state since a given time, the topic (read from
offset 0 to its current end, :func:`koda_runtime.topics.chunklog.read_chunk_log`) must hold each of
the run's messages under ``<run_id>:<seq>`` with Postgres's kind, content and attempt,
or, once compacted, a ``<run_id>:final`` record whose ``last_seq`` is the run's last.
A run that misses anything is a gap; the command prints one line per such run and
exits 1. Postgres is the truth: the repair is ``koda chunks repair`` (or waiting for
the compactor's completeness pass, or for a worker that meets the run again).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import Engine

from koda_runtime.schemas.db import sync_engine
from koda_runtime.schemas.runs import upkeep
from koda_runtime.settings import Settings
from koda_runtime.topics.chunklog import ChunkLog, read_chunk_log

PAGE = 500


@dataclass(frozen=True)
class RunGap:
    """What the topic lacks of one run: ``missing`` seqs, ``differing`` ones."""

    run_id: str
    messages: int
    missing: list[int] = field(default_factory=list)
    differing: list[int] = field(default_factory=list)

    def describe(self) -> str:
        parts = []
        if self.missing:
            parts.append(f"missing seqs {seq_ranges(self.missing)}")
        if self.differing:
            parts.append(f"differing seqs {seq_ranges(self.differing)}")
        what = "; ".join(parts)
        return f"run {self.run_id}: {what} ({len(self.missing)} of {self.messages} absent)"


@dataclass
class VerifyReport:
    runs: int = 0
    chunks: int = 0
    gaps: list[RunGap] = field(default_factory=list)

    @property
    def chunks_missing(self) -> int:
        return sum(len(g.missing) for g in self.gaps)


def verify_chunks(
    settings: Settings, since: datetime, *, engine: Engine | None = None, timeout_s: float = 120.0
) -> VerifyReport:
    """Compare the topic with Postgres for runs finished at or after ``since``."""
    own = engine is None
    db = engine if engine is not None else sync_engine(settings)
    try:
        with db.connect() as conn:
            ids = upkeep.finished_since(conn, since)
        # The topic is read after the run list: a run listed has ended, so everything it
        # will ever have in Postgres was there before this read started.
        log = read_chunk_log(settings, timeout_s=timeout_s)
        report = VerifyReport()
        for start in range(0, len(ids), PAGE):
            page = ids[start : start + PAGE]
            with db.connect() as conn:
                by_run = upkeep.messages_by_run(conn, page)
            for run_id in page:
                messages = [(m.seq, m.kind, m.content, m.attempt) for m in by_run[run_id]]
                report.runs += 1
                report.chunks += len(messages)
                gap = compare_run(log, run_id, messages)
                if gap is not None:
                    report.gaps.append(gap)
        return report
    finally:
        if own:
            db.dispose()


def compare_run(
    log: ChunkLog, run_id: str, messages: list[tuple[int, str, str, int]]
) -> RunGap | None:
    """The gap between Postgres's ``messages`` (seq, kind, content, attempt) of one run
    and what the topic holds of it, or None when the topic holds all of it."""
    if not messages:
        return None
    topic = log.runs.get(run_id)
    if topic is not None and topic.final is not None:
        last = messages[-1][0]
        if topic.final.last_seq >= last:
            return None
        return RunGap(
            run_id, len(messages), [m[0] for m in messages if m[0] > topic.final.last_seq]
        )
    events = topic.events if topic is not None else {}
    missing = [seq for seq, *_ in messages if seq not in events]
    differing = [
        seq
        for seq, kind, content, attempt in messages
        if seq in events
        and (events[seq].kind, events[seq].content, events[seq].attempt) != (kind, content, attempt)
    ]
    if not missing and not differing:
        return None
    return RunGap(run_id, len(messages), missing, differing)


def seq_ranges(seqs: Iterable[int]) -> str:
    """``[1, 2, 3, 7]`` as ``1-3,7``."""
    out: list[str] = []
    ordered = sorted(seqs)
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        out.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(out)
