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

from confluent_kafka import KafkaError, Message

from koda.errors import TopicError
from koda.settings import Settings
from topics.catalogue import RUN_EVENTS
from topics.replay import tables as t
from topics.replay.positions import Earliest, StartSpec, format_offsets, select_topics
from topics.replay.prices import PriceBook, load_prices
from topics.replay.progress import Progress, ReplaySummary
from topics.replay.reader import TP, Plan, TopicReader, partition_of
from topics.replay.rows import RecordDecoder, RowBatch
from topics.replay.sinks import DEFAULT_URL, Sink, open_sink

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
            reader = TopicReader(self.settings, self.topics, self.options.job)
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

    def _loop(self, reader: TopicReader, decoder: RecordDecoder) -> None:
        opts, summary = self.options, self.summary
        plan = reader.plan(opts.start)
        summary.resumed_partitions = plan.resumed
        reader.assign(plan)
        positions = summary.positions
        positions.update(plan.starts)
        committed = dict(plan.committed)  # the job's group commits every partition once
        open_tps = {tp for tp in plan.starts if opts.follow or plan.starts[tp] < plan.ends[tp]}
        for tp in set(plan.starts) - open_tps:
            reader.pause(tp)
        batch, batch_born = RowBatch(), time.monotonic()
        started = time.monotonic()

        def close(tp: TP) -> None:
            if tp in open_tps and not opts.follow:
                open_tps.discard(tp)
                reader.pause(tp)

        while open_tps and not self.stop.is_set():
            for msg in reader.poll(POLL_RECORDS, POLL_TIMEOUT_S):
                tp = partition_of(msg)
                event = self._event(msg, tp)
                if event is not None:
                    if event == "end" and tp in open_tps:
                        # Everything before the end was delivered ahead of this event.
                        end = msg.offset() or 0
                        if not opts.follow:
                            end = min(end, plan.ends[tp])
                        positions[tp] = max(positions[tp], end)
                        if not opts.follow and positions[tp] >= plan.ends[tp]:
                            close(tp)
                    continue
                if tp not in open_tps:
                    continue  # fetched before its partition reached the end
                offset = msg.offset() or 0
                if not opts.follow and offset >= plan.ends[tp]:
                    close(tp)
                    continue
                decoder.add(msg, batch)
                summary.per_topic[tp[0]] += 1
                positions[tp] = offset + 1
                if not opts.follow and offset + 1 >= plan.ends[tp]:
                    close(tp)
            summary.records = sum(summary.per_topic.values())
            now = time.monotonic()
            if not len(batch):
                batch_born = now
            if len(batch) >= opts.batch_records or (
                len(batch) and (not open_tps or now - batch_born >= opts.batch_seconds)
            ):
                self._flush(batch, reader, committed)
                batch, batch_born = RowBatch(), now
            summary.seconds = now - started
            self.progress.update(summary, self._lag(reader, plan, positions, open_tps))
            self._throttle(started)
        summary.stopped = self.stop.is_set() and bool(open_tps) and not opts.follow
        self._flush(batch, reader, committed)
        summary.seconds = time.monotonic() - started
        self.progress.update(summary, self._lag(reader, plan, positions, open_tps), force=True)

    def _event(self, msg: Message, tp: TP) -> str | None:
        """None for a record; ``end`` for a partition's end; ``error`` for an error that
        librdkafka retries (logged). A fatal error is raised."""
        err = msg.error()
        if err is None:
            return None
        if err.code() == KafkaError._PARTITION_EOF:
            return "end"
        if err.fatal():
            raise TopicError(f"reading {tp[0] or 'the topics'} failed: {err.str()}")
        log.warning("event=replay_read_error topic=%s partition=%d error=%s", *tp, err.str())
        return "error"

    def _flush(self, batch: RowBatch, reader: TopicReader, committed: dict[TP, int]) -> None:
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

    def _lag(
        self, reader: TopicReader, plan: Plan, positions: dict[TP, int], open_tps: set[TP]
    ) -> dict[TP, int]:
        if not self.options.follow:
            return {tp: plan.ends[tp] - positions[tp] for tp in open_tps}
        lag = {}
        for tp in open_tps:
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
