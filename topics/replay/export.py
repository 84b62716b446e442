"""What the topics do not carry, read from koda's Postgres in the same replay.

The runs record is a trigger (``run.requested/1``: ids and times, no input), and merges,
schedules and memories are on no topic at all, so a replay that reads the runs topic
also reads them from koda's Postgres, read-only, and upserts them like every other row:

    runs.input, metadata, input_version  → run_inputs  (key run_id)
    run_merges                           → run_merges  (key run_id, input_version)
    schedules                            → schedules   (key schedule_id)
    memories (without their embeddings)  → memories    (key memory_id)

Each table is read in keyset pages of :data:`PAGE` rows (by its primary key), each page
one sink transaction, so a large table never sits in memory whole and a rerun upserts
the same rows on the same keys (idempotent). ``--from-timestamp`` exports the rows
created (schedules: updated) at or after it; a run's merges move its input, so a run
merged into since then comes too. A following replay exports again every
:data:`~koda_runtime.topics.replay.erased.REFRESH_S` what changed since the last export
began, less :data:`OVERLAP_S` (a transaction that began before and committed after).

The rows of an erased user (erased.py) are dropped. A row deleted from Postgres later
(a memory forgotten, a schedule deleted) stays in the warehouse, as a tombstoned chunk
does. Failure mode: a page boundary that skips or repeats a row; keyset pages by the
primary key cannot.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Protocol

from sqlalchemy import Connection
from sqlalchemy.exc import SQLAlchemyError

from koda_runtime.schemas import memories, schedules
from koda_runtime.schemas.db import sync_engine
from koda_runtime.schemas.runs import export as runs_export
from koda_runtime.settings import Settings
from koda_runtime.topics.replay import tables as t
from koda_runtime.topics.replay.batch import RowBatch, run_day
from koda_runtime.topics.replay.erased import Erased
from koda_runtime.topics.replay.errors import SourceError

PAGE = 5000
OVERLAP_S = 600.0


class Page(Protocol):
    """One page of a table: the rows after key ``after``, created (or changed) at or
    after ``since``, at most ``limit``, by primary key (read by its table group's
    module in schemas/)."""

    def __call__(
        self, conn: Connection, *, after: str, since: datetime | None, limit: int
    ) -> Sequence[Any]: ...


@dataclass(frozen=True)
class Source:
    """One exported table: how a page of it is read (``page(conn, after=, since=,
    limit=)``) and how a result row becomes a warehouse row (None: an erased user's,
    dropped)."""

    table: t.Table
    page: Page
    row: Callable[[Any, Erased], tuple[Any, ...] | None]


def _inputs_row(r: Any, erased: Erased) -> tuple[Any, ...] | None:
    if erased.user(r.user_id):
        return None
    day = run_day(r.id, r.created_at.date())
    return (r.id, day, r.user_id, r.session_id, r.created_at, r.input, r.metadata, r.version)


def _merges_row(r: Any, erased: Erased) -> tuple[Any, ...] | None:
    if erased.user(r.user_id) or r.run_id in erased.runs:
        return None
    day = run_day(r.run_id, r.created_at.date())
    return (r.run_id, r.input_version, day, r.user_id, r.input, r.created_at)


def _schedules_row(r: Any, erased: Erased) -> tuple[Any, ...] | None:
    if erased.user(r.user_id):
        return None
    return (r.id, r.created_at.date(), *tuple(r)[1:])


def _memories_row(r: Any, erased: Erased) -> tuple[Any, ...] | None:
    if erased.user(r.user_id):
        return None
    return (r.id, r.created_at.date(), r.user_id, r.text, r.embedder, r.run_id, r.created_at)


SOURCES = (
    Source(t.RUN_INPUTS, runs_export.inputs_page, _inputs_row),
    Source(t.RUN_MERGES, runs_export.merges_page, _merges_row),
    Source(t.SCHEDULES, schedules.export_page, _schedules_row),
    Source(t.MEMORIES, memories.export_page, _memories_row),
)


def export_batches(
    settings: Settings, erased: Erased, since: datetime | None, page: int = PAGE
) -> Iterator[RowBatch]:
    """The exported tables as batches of at most ``page`` rows each (rows created or
    changed at or after ``since``; None: every row). Raises SourceError when koda's
    Postgres cannot be read."""
    engine = sync_engine(settings, pool_size=1)
    try:
        with engine.connect() as conn:
            for source in SOURCES:
                after = ""
                while True:
                    rows = source.page(conn, after=after, since=since, limit=page)
                    conn.rollback()  # no transaction held open between pages
                    if not rows:
                        break
                    after = rows[-1].id
                    batch = RowBatch()
                    for r in rows:
                        row = source.row(r, erased)
                        if row is None:
                            erased.dropped += 1
                        else:
                            batch.add(source.table, row)
                    batch.records = len(rows)
                    yield batch
                    if len(rows) < page:
                        break
    except SQLAlchemyError as exc:
        raise SourceError(
            f"cannot export from koda's Postgres ({type(exc).__name__}); check "
            "KODA_DATABASE_URL and that `koda db upgrade` has run"
        ) from None
    finally:
        engine.dispose()


def refresh_since(started: datetime) -> datetime:
    """Where the next export of a following replay starts: the last one's start, less
    :data:`OVERLAP_S`."""
    return started - timedelta(seconds=OVERLAP_S)
