"""The replay loop: read a batch of records, write it in one sink transaction, then
(for a named job) commit the offsets, and say how far it got.

Order per batch, and why: (1) the sink commits the batch's rows, (2) the job's group
commits the next offsets. A crash after (1) and before (2) re-reads that batch on
restart, which changes nothing (every write is an upsert on a natural key); the
reverse order could lose rows. The sink is opened before Kafka is touched, so an
unreachable sink fails at once, with nothing read.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from koda_runtime.settings import Settings
from koda_runtime.topics.catalogue import RUN_EVENTS
from koda_runtime.topics.kafka.bounded import TP, BoundedReader
from koda_runtime.topics.replay import tables as t
from koda_runtime.topics.replay.positions import Earliest, StartSpec, format_offsets, select_topics
from koda_runtime.topics.replay.prices import PriceBook, load_prices
from koda_runtime.topics.replay.progress import Progress, ReplaySummary
from koda_runtime.topics.replay.reader import Plan, open_reader, plan
from koda_runtime.topics.replay.rows import RecordDecoder, RowBatch
from koda_runtime.topics.replay.sinks import DEFAULT_URL, Sink, open_sink

log = logging.getLogger("koda.replay")

POLL_RECORDS = 1000
POLL_TIMEOUT_S = 0.2


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
    batch_records: int = 5000
    batch_seconds: float = 1.0
    max_rate: float | None = None
    save_offsets: Path | None = None


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

    def run(self) -> ReplaySummary:
        if self.sink is not None:
            self.sink.open()
        try:
            prices = PriceBook(loaded=False)
            names = self.settings.names
            if self.sink is not None and names.topic(RUN_EVENTS) in self.topics:
                prices = load_prices(self.settings)
                self.summary.prices_loaded = prices.loaded
            reader = open_reader(self.settings, self.options.job)
            try:
                self._loop(reader, RecordDecoder(names, prices))
            finally:
                reader.close()
        finally:
            if self.sink is not None:
                self.sink.close()
            self.progress.finish()
        if self.options.save_offsets is not None:
            _write_atomically(self.options.save_offsets, format_offsets(self.summary.positions))
        return self.summary

    def _loop(self, reader: BoundedReader, decoder: RecordDecoder) -> None:
        opts, summary = self.options, self.summary
        planned = plan(reader, self.topics, opts.start, job=opts.job is not None)
        summary.resumed_partitions = planned.resumed
        reader.assign(planned.starts, None if opts.follow else planned.ends)
        positions = summary.positions
        positions.update(planned.starts)
        committed = dict(planned.committed)  # the job's group commits every partition once
        batch, batch_born = RowBatch(), time.monotonic()
        started = time.monotonic()
        while reader.open and not self.stop.is_set():
            msgs = reader.poll(POLL_RECORDS, POLL_TIMEOUT_S)
            decoder.add_many(msgs, batch)
            summary.per_topic.update(msg.topic() or "" for msg in msgs)
            positions.update(reader.positions)
            summary.records = sum(summary.per_topic.values())
            now = time.monotonic()
            if not len(batch):
                batch_born = now
            if len(batch) >= opts.batch_records or (
                len(batch) and (not reader.open or now - batch_born >= opts.batch_seconds)
            ):
                self._flush(batch, reader, committed)
                batch, batch_born = RowBatch(), now
            summary.seconds = now - started
            self.progress.update(summary, self._lag(reader, planned, positions))
            self._throttle(started)
        summary.stopped = self.stop.is_set() and bool(reader.open) and not opts.follow
        self._flush(batch, reader, committed)
        summary.seconds = time.monotonic() - started
        self.progress.update(summary, self._lag(reader, planned, positions), force=True)

    def _flush(self, batch: RowBatch, reader: BoundedReader, committed: dict[TP, int]) -> None:
        """Write the batch (one transaction), then commit the job's offsets."""
        summary = self.summary
        if len(batch):
            if self.sink is None:
                written = {name: len(rows) for name, rows in batch.rows.items() if rows}
                runs = set(batch.chunk_runs) | batch.final_runs
                if runs:
                    written[t.OUTPUTS.name] = len(runs)
            else:
                written = self.sink.write(batch)
            summary.rows.update(written)
            summary.raw.update(batch.raw)
            summary.tombstones += batch.tombstones
            summary.batches += 1
        if self.options.job is None or self.sink is None:
            return
        moved = {tp: o for tp, o in summary.positions.items() if committed.get(tp) != o}
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
