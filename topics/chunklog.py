"""The chunk topic as a replay log: rebuild every retained run's output from offset 0.

A run's records all live in its partition, so offsets order them. The fold
(:class:`ChunkLog`) reads, per key:

    <run_id>:<seq>    value       the event with that seq; a redelivered duplicate has
                                  the same key and value, so it changes nothing
    <run_id>:<seq>    tombstone   the event was compacted away
    <run_id>:final    value       the run's whole output (``run.final/1``), produced
                                  before its tombstones
    <run_id>:final    tombstone   the run was purged from the topic

A run's output is its final record's text when it has one, else the text of its chunk
events after the last ``reset``. That is right at every stage of the broker's log
cleaning: before cleaning a reader meets chunks, then the final record, then
tombstones; after it, the final record alone. Used by a gateway or a warehouse that
starts from nothing; :func:`read_chunk_log` reads the topic up to its current end.

A run has ended on the topic only when the topic holds its terminal event *and* every
event before it (seqs 0..terminal, contiguous): a worker that died between its
Postgres commit and its produce can leave a hole that its successor, or the
compactor's completeness pass, fills later, possibly after the terminal event. Until
then :attr:`RunLog.end` is None and :attr:`RunLog.missing` names the holes.

A record that is not koda's is counted in :attr:`ChunkLog.skipped` and changes
nothing: a key that is no chunk key, a value that does not decode (whatever the
decoder meets: bad UTF-8, JSON nested thousands deep, a missing field), or a value
whose run or seq is not its key's, or whose kind koda never writes. The fold never
raises for a record, so a bad one can neither stop a reader nor stand in for a run's
real event.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from koda_runtime.errors import RecordError
from koda_runtime.lifecycle.chunks import TERMINAL_KINDS, split_chunk_key, visible_output
from koda_runtime.settings import Settings
from koda_runtime.topics.catalogue import RUN_CHUNKS
from koda_runtime.topics.kafka.bounded import BoundedReader
from koda_runtime.topics.records.codec import (
    ChunkRecord,
    FinalRecord,
    decode_keyed_chunk,
    decode_keyed_final,
)

log = logging.getLogger(__name__)


@dataclass
class RunLog:
    """What the topic holds for one run."""

    run_id: str
    events: dict[int, ChunkRecord] = field(default_factory=dict)
    final: FinalRecord | None = None

    @property
    def output(self) -> str:
        """The run's answer: the final text, or the chunks after the last reset."""
        if self.final is not None:
            return self.final.content
        return visible_output((e.seq, e.kind, e.content) for e in self.events.values())

    @property
    def last_seq(self) -> int | None:
        """The seq of the run's terminal event, if the topic holds it (or its final)."""
        if self.final is not None:
            return self.final.last_seq
        ends = [seq for seq, e in self.events.items() if e.kind in TERMINAL_KINDS]
        return max(ends) if ends else None

    @property
    def missing(self) -> list[int]:
        """Seqs below the terminal event that the topic does not hold (empty if none)."""
        last = self.last_seq
        if self.final is not None or last is None:
            return []
        return [seq for seq in range(last) if seq not in self.events]

    @property
    def end(self) -> str | None:
        """The terminal kind (done, error, cancelled) once the topic holds all of the run:
        None while it has not ended, or while events before the terminal one are missing."""
        if self.final is not None:
            return self.final.end
        last = self.last_seq
        if last is None or self.missing:
            return None
        return self.events[last].kind

    @property
    def complete(self) -> bool:
        """The topic holds the whole run: its terminal event and every event before it."""
        return self.end is not None

    @property
    def compacted(self) -> bool:
        return self.final is not None


class ChunkLog:
    """Folds chunk-topic records, in offset order per partition, into :class:`RunLog` s.

    ``skipped`` counts records that are not koda's (bad key, a value that does not
    decode or is not its key's); ``skip_reasons`` counts them by reason.
    """

    def __init__(self) -> None:
        self.runs: dict[str, RunLog] = {}
        self.skipped = 0
        self.skip_reasons: dict[str, int] = {}

    def apply(self, key: bytes | None, value: bytes | None) -> None:
        """Fold one record in; a record that is not koda's is skipped, never raised."""
        try:
            self._apply(key, value)
        except RecordError as exc:
            self._skip(exc.reason)
        except Exception as exc:  # noqa: BLE001 - no record may stop the fold
            log.warning("chunk log: record skipped: %s: %s", type(exc).__name__, exc)
            self._skip("error")

    def _skip(self, reason: str) -> None:
        self.skipped += 1
        self.skip_reasons[reason] = self.skip_reasons.get(reason, 0) + 1

    def _apply(self, key: bytes | None, value: bytes | None) -> None:
        try:
            run_id, seq = split_chunk_key((key or b"").decode("utf-8", "replace"))
        except ValueError:
            raise RecordError("bad_key", "not a chunk-topic key") from None
        run = self.runs.get(run_id)
        if value is None:  # tombstone
            if run is not None:
                if seq is None:
                    run.final = None
                else:
                    run.events.pop(seq, None)
                if not run.events and run.final is None:
                    del self.runs[run_id]
            return
        final = decode_keyed_final(run_id, value) if seq is None else None
        chunk = decode_keyed_chunk(run_id, seq, value) if seq is not None else None
        run = run if run is not None else self.runs.setdefault(run_id, RunLog(run_id))
        if final is not None:
            run.final = final
        if chunk is not None and seq is not None:
            run.events[seq] = chunk


def read_chunk_log(settings: Settings, *, timeout_s: float = 60.0) -> ChunkLog:
    """Read the chunk topic from its log start to its end as of the call; return the fold.

    Raises TopicError when the topic is missing or the read makes no progress for
    ``timeout_s`` seconds.
    """
    topic = settings.names.topic(RUN_CHUNKS)
    reader = BoundedReader(settings, "chunk-reader", settings.names.group("chunk-reader"))
    log = ChunkLog()
    try:
        starts, ends = {}, {}
        for tp in reader.partitions(topic):
            starts[tp], ends[tp] = reader.watermarks(tp)
        reader.assign(starts, ends)
        for msg in reader.records(idle_timeout_s=timeout_s):
            log.apply(msg.key(), msg.value())
    finally:
        reader.close()
    return log
