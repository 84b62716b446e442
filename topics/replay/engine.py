"""The replay loop: read a batch of records, write it in one sink transaction, then
(for a named job) commit the offsets, and say how far it got.

Order per batch, and why: (1) the sink commits the batch's rows, (2) the job's group
commits the next offsets. A crash after (1) and before (2) re-reads that batch on
restart, which changes nothing (every write is an upsert on a natural key); the
reverse order could lose rows. A batch is written on a thread of its own while the
next is read (writer.py): one at a time, in order, and its offsets only after it. The
sink opens (on a thread, while koda's Postgres is read) before Kafka is touched, so an
unreachable sink fails at once, with nothing read.

Speed (``make bench-replay``): a poll never asks for more records than are left before
a bounded replay's ends (a larger ask waits out its whole timeout); a reader of one
topic does not ask each record its topic; the erased filter runs only when some run is
erased (a set lookup, or one Arrow ``is_in`` per poll), and the Postgres export only
when the runs topic is replayed.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from pathlib import Path

from koda_runtime.settings import Settings
from koda_runtime.topics.catalogue import RUN_EVENTS, RUNS
from koda_runtime.topics.kafka.bounded import TP, BoundedReader
from koda_runtime.topics.replay import tables as t
from koda_runtime.topics.replay.batch import read_all
from koda_runtime.topics.replay.erased import REFRESH_S, Erased, read_erased
from koda_runtime.topics.replay.export import export_batches, refresh_since
from koda_runtime.topics.replay.positions import (
    Earliest,
    FromTimestamp,
    StartSpec,
    format_offsets,
    select_topics,
)
from koda_runtime.topics.replay.prices import PriceBook, load_prices
from koda_runtime.topics.replay.progress import Progress, ReplaySummary
from koda_runtime.topics.replay.quiet_gc import held_back
from koda_runtime.topics.replay.reader import Plan, open_reader, plan
from koda_runtime.topics.replay.rows import RecordDecoder, RowBatch
from koda_runtime.topics.replay.sinks import DEFAULT_URL, Sink, open_sink
from koda_runtime.topics.replay.writer import BatchWriter

log = logging.getLogger("koda.replay")

# A poll of chunk records is one DuckDB query (chunk_polls.py), whose planning alone
# takes some 3 ms: polls of 40,000 (a batch) replayed faster than polls of 20,000 in each
# of 6 repetitions alternating the two in one process (make bench-replay's topic).
POLL_RECORDS = 40_000
POLL_TIMEOUT_S = 0.2
# Records per sink transaction: each pays a commit and an outputs query over the run's
# stored chunks, so fewer, larger ones replay faster (make bench-replay measures it:
# 40,000 gave 0.21 of the raw consume rate where 20,000 gave 0.17).
BATCH_RECORDS = 40_000
# A sink that defers the outputs rebuild (sinks/duckdb.py) gets it from the last batch
# of a bounded replay, and every OUTPUTS_S seconds of a following one.
OUTPUTS_S = 2.0
# A bounded replay cuts its last full batch early, so that the batch left for the end,
# which nothing overlaps (the reader is done), is this fraction of a batch at most.
TAIL_FRACTION = 8


@dataclass(frozen=True)
class ReplayOptions:
    """What to replay and where. ``batch_records`` records (or ``batch_seconds`` s of
    them) make one sink transaction; ``max_rate`` caps records/s (None: no cap)."""

    topics: tuple[str, ...] = ()
    start: StartSpec = Earliest()
    sink_url: str = DEFAULT_URL
    job: str | None = None
    follow: bool = False
    dry_run: bool = False
    batch_records: int = BATCH_RECORDS
    batch_seconds: float = 1.0
    max_rate: float | None = None
    save_offsets: Path | None = None
    # With the runs topic: also export run inputs, merges, schedules and memories from
    # koda's Postgres (export.py).
    with_postgres: bool = True


class Replay:
    """One replay run; :meth:`run` returns its summary."""

    def __init__(
        self,
        settings: Settings,
        options: ReplayOptions,
        *,
        progress: Progress | None = None,
        stop: threading.Event | None = None,
    ) -> None:
        self.settings = settings
        self.options = options
        self.progress = progress or Progress(enabled=False)
        self.stop = stop or threading.Event()
        self.topics = select_topics(settings.names, options.topics)
        if options.job is not None:
            settings.names.replay_group(options.job)  # a bad job name fails here, clearly
        self.sink: Sink | None = open_sink(options.sink_url, settings.names)
        self.summary = ReplaySummary(
            sink=self.sink.display,
            topics=self.topics,
            start=options.start.describe(),
            job=options.job,
            dry_run=options.dry_run,
        )
        if options.dry_run:
            self.sink = None
        self.erased = Erased()
        self._defers = self.sink is not None and self.sink.defer_outputs
        # Runs may wait for an outputs rebuild (a killed replay's, or a batch's handed over).
        self._dirty = self._defers

    def run(self) -> ReplaySummary:
        with held_back():  # quiet_gc.py: the collector walked the whole heap, 22 % of a replay
            return self._run()

    def _run(self) -> ReplaySummary:
        names = self.settings.names
        decoder, erased = self._start()
        try:
            if erased and names.topic(RUNS) in self.topics:
                self._scan_runs(erased)
            self.erased = erased
            reader = open_reader(self.settings, self.options.job)
            try:
                self._loop(reader, decoder)
            finally:
                decoder.close()
                reader.close()
                self.summary.erased = erased.dropped
        finally:
            if self.sink is not None:
                self.sink.close()
            self.progress.finish()
        if self.options.save_offsets is not None:
            _write_atomically(self.options.save_offsets, format_offsets(self.summary.positions))
        return self.summary

    def _start(self) -> tuple[RecordDecoder, Erased]:
        """The decoder and the erased users, with the sink open. The sink opens on a
        thread while koda's Postgres is read (prices, erasures) and the chunk decoder
        starts; Kafka is touched only after, so a sink that cannot open still fails at
        once, with nothing read, and its error comes before any other."""
        sink, names = self.sink, self.settings.names
        with ThreadPoolExecutor(1, thread_name_prefix="koda-replay-open") as pool:
            opening = pool.submit(sink.open) if sink is not None else None
            try:
                prices = PriceBook(loaded=False)
                if sink is not None and names.topic(RUN_EVENTS) in self.topics:
                    prices = load_prices(self.settings)
                    self.summary.prices_loaded = prices.loaded
                erased = Erased(*read_erased(self.settings))
                arrow = sink is not None and sink.arrow_chunks
                decoder = RecordDecoder(names, prices, arrow_chunks=arrow, erased=erased)
            except BaseException:
                if opening is not None:
                    if opening.exception() is not None:  # waits for the opening to end
                        opening.result()  # the sink's error first
                    sink.close()  # type: ignore[union-attr]
                self.progress.finish()
                raise
            if opening is not None:
                try:
                    opening.result()
                except BaseException:
                    decoder.close()
                    raise
        return decoder, erased

    def _scan_runs(self, erased: Erased) -> None:
        """The erased runs of the runs topic, read before any record is replayed (see
        erased.py): a record keyed by an erased user is decoded, no other."""
        reader = open_reader(self.settings, None)
        try:
            planned = plan(reader, [self.settings.names.topic(RUNS)], Earliest(), job=False)
            reader.assign(planned.starts, planned.ends)
            while reader.open and not self.stop.is_set():
                msgs = reader.poll(POLL_RECORDS, POLL_TIMEOUT_S)
                for key, value in zip(read_all(msgs, "key"), read_all(msgs, "value"), strict=True):
                    erased.runs_record(key, value)
        finally:
            reader.close()

    def _exports(self) -> bool:
        opts = self.options
        return opts.with_postgres and self.settings.names.topic(RUNS) in self.topics

    def _export(self, w: BatchWriter, positions: dict[TP, int], since: datetime | None) -> None:
        """Export from Postgres (export.py), each page its own batch; ``positions`` are
        those of the last batch handed over, so no offset moves past unwritten rows."""
        for batch in export_batches(self.settings, self.erased, since):
            if self.stop.is_set():
                return
            w.submit(batch, positions)

    def _loop(self, reader: BoundedReader, decoder: RecordDecoder) -> None:
        opts, summary = self.options, self.summary
        planned = plan(reader, self.topics, opts.start, job=opts.job is not None)
        summary.resumed_partitions = planned.resumed
        reader.assign(planned.starts, None if opts.follow else planned.ends)
        positions = summary.positions
        positions.update(planned.starts)
        committed = dict(planned.committed)  # the job's group commits every partition once
        batch, batch_born = self._batch(), time.monotonic()
        started = outputs_at = time.monotonic()
        tail = 0 if opts.follow else opts.batch_records // TAIL_FRACTION
        # The reader returns records of the partitions it was assigned only: with one
        # topic, every record's topic is known without asking each one.
        only = self.topics[0] if len(self.topics) == 1 else None
        exported_at = datetime.now(UTC)
        with BatchWriter(self._write, partial(self._commit, reader, committed), self._done) as w:
            if self._exports():
                since = None
                if isinstance(opts.start, FromTimestamp):
                    since = datetime.fromtimestamp(opts.start.ms / 1000, UTC)
                exported_at = datetime.now(UTC)
                self._export(w, dict(positions), since)
            refreshed = time.monotonic()
            while reader.open and not self.stop.is_set():
                left = None if opts.follow else self._left(reader, planned, positions)
                size = self._poll_size(len(batch), (left or 0) - tail, left)
                msgs = reader.poll(size, POLL_TIMEOUT_S)
                if only is None:
                    decoder.add_many(msgs, batch)
                    summary.per_topic.update(read_all(msgs, "topic"))  # a record has its topic
                else:
                    decoder.add_many(msgs, batch, only)
                    summary.per_topic[only] += len(msgs)
                positions.update(reader.positions)
                summary.records = sum(summary.per_topic.values())
                now = time.monotonic()
                if not len(batch):
                    batch_born = now
                left = self._left(reader, planned, positions) if tail else 0
                if len(batch) >= opts.batch_records or (
                    len(batch)
                    and (
                        not reader.open
                        or now - batch_born >= opts.batch_seconds
                        or (tail and 0 < left <= tail < len(batch))
                    )
                ):
                    self._submit(w, batch, positions)  # written while the next is read
                    batch, batch_born = self._batch(), now
                if opts.follow:
                    w.settle_written()  # its offsets now, not at the next batch
                if opts.follow and self._dirty and now - outputs_at >= OUTPUTS_S:
                    self._submit(w, batch, positions, flush=True)
                    batch, batch_born, outputs_at = self._batch(), now, now
                if opts.follow and now - refreshed >= REFRESH_S:
                    self._submit(w, batch, positions)  # the rows read so far, before the export's
                    batch, batch_born = self._batch(), now
                    self.erased.update(*read_erased(self.settings))
                    if self._exports():
                        since, exported_at = refresh_since(exported_at), datetime.now(UTC)
                        self._export(w, dict(positions), since)
                    refreshed = time.monotonic()
                summary.seconds = now - started
                self.progress.update(summary, self._lag(reader, planned, positions))
                self._throttle(started)
            summary.stopped = self.stop.is_set() and bool(reader.open) and not opts.follow
            decoder.close()  # nothing more to decode: its DuckDB closes while batches are written
            # The last batch rebuilds every dirty run, those a killed replay left included.
            self._submit(w, batch, positions, flush=True)
            w.finish()
        summary.seconds = time.monotonic() - started
        self.progress.update(summary, self._lag(reader, planned, positions), force=True)

    def _batch(self) -> RowBatch:
        batch = RowBatch()
        batch.defer_outputs = self._defers
        return batch

    def _submit(
        self, w: BatchWriter, batch: RowBatch, positions: dict[TP, int], *, flush: bool = False
    ) -> None:
        """Hand ``batch`` to the writer; ``flush``: it rebuilds the deferred outputs (an
        empty one is written for it)."""
        if flush and self._defers:
            batch.defer_outputs, batch.flush_outputs = False, True
            self._dirty = False
        elif len(batch) and batch.defer_outputs:
            self._dirty = True
        w.submit(batch, positions)

    def _poll_size(self, batched: int, before_tail: int = 0, left: int | None = None) -> int:
        """Records to ask for: what the batch still takes (a batch is never larger than
        ``batch_records``), no more than ``before_tail`` (the records before the last,
        short batch of a bounded replay) when that is positive, no more than ``left``
        (the offsets before a bounded replay's ends), and at most a second's worth under
        ``max_rate``. A poll asking for more records than the partitions still hold
        waits its whole timeout: the last polls of a bounded replay did (0.4 s of a
        1.4 s replay of 200,000 records)."""
        opts = self.options
        size = min(POLL_RECORDS, max(1, opts.batch_records - batched))
        if before_tail > 0:
            size = min(size, before_tail)
        if left is not None:
            size = min(size, max(1, left))
        return size if opts.max_rate is None else min(size, max(1, int(opts.max_rate)))

    @staticmethod
    def _left(reader: BoundedReader, plan: Plan, positions: dict[TP, int]) -> int:
        """Offsets still to read before the ends (records, less compaction's gaps)."""
        return sum(max(0, plan.ends[tp] - positions[tp]) for tp in reader.open)

    def _write(self, batch: RowBatch) -> dict[str, int]:
        """One batch in one sink transaction (on the writer's thread); rows per table."""
        if self.sink is None:
            written = {name: len(rows) for name, rows in batch.rows.items() if rows}
            runs = set(batch.chunk_runs) | batch.final_runs
            if runs:
                written[t.OUTPUTS.name] = len(runs)
            return written
        return self.sink.write(batch)

    def _done(self, batch: RowBatch, written: dict[str, int]) -> None:
        summary = self.summary
        summary.rows.update(written)
        summary.raw.update(batch.raw)
        summary.tombstones += batch.tombstones
        summary.batches += 1

    def _commit(
        self, reader: BoundedReader, committed: dict[TP, int], positions: dict[TP, int]
    ) -> None:
        """Commit the job's offsets of a batch the sink has committed."""
        if self.options.job is None or self.sink is None:
            return
        moved = {tp: o for tp, o in positions.items() if committed.get(tp) != o}
        reader.commit(moved)
        committed.update(moved)
        log.debug("event=replay_committed job=%s partitions=%d", self.options.job, len(moved))

    def _lag(self, reader: BoundedReader, plan: Plan, positions: dict[TP, int]) -> dict[TP, int]:
        if not self.options.follow:
            return {tp: plan.ends[tp] - positions[tp] for tp in reader.open}
        lag = {}
        for tp in reader.open:
            high = reader.high_watermark(tp)
            lag[tp] = max(0, (high if high is not None else plan.ends[tp]) - positions[tp])
        return lag

    def _throttle(self, started: float) -> None:
        if self.options.max_rate is None:
            return
        ahead = self.summary.records / self.options.max_rate - (time.monotonic() - started)
        if ahead > 0:
            time.sleep(min(ahead, 1.0))  # a rate cap, not a wait for a condition


def run_replay(
    settings: Settings,
    options: ReplayOptions,
    *,
    progress: Progress | None = None,
    stop: threading.Event | None = None,
) -> ReplaySummary:
    """Replay ``options.topics`` into ``options.sink_url``; see :class:`ReplayOptions`."""
    return Replay(settings, options, progress=progress, stop=stop).run()


def _write_atomically(path: Path, text: str) -> None:
    aside = path.with_name(f".{path.name}.tmp")
    aside.write_text(text, encoding="utf-8")
    os.replace(aside, path)
