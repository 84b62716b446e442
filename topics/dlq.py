"""Dead letters: read them (``koda dlq list``, ``show``) and re-publish their originals to
the runs topic (``koda dlq replay``).

A dead letter's id is its place on ``<env>.koda.runs-dlq``: ``<partition>:<offset>``
(``17`` alone means partition 0). Reading goes from an offset up to the end as of the
start; the consumer assigns partitions itself, so no consumer group joins or commits.

``replay`` produces each chosen letter's original key, value and headers to
``<env>.koda.runs`` with the gateway's partitioner, so a user's record lands in the
user's partition. What a replay can and cannot do: the worker skips runs that are
already terminal in Postgres (the run's row, created once per idempotency key, is the
truth), so replaying a letter twice, or a letter of a run that since finished, runs
nothing twice; a run that failed after its attempts stays failed. Replay re-drives
records that never reached a run, e.g. ``unknown_schema_version`` after deploying a
worker that reads the new version, or ``unknown_run`` after the run's row was
restored. Letters whose original was truncated (a value over 512 KiB, a key over
1 KiB, headers over 16 KiB or 64 of them: schemas/records.py) cannot be replayed and
are counted as skipped, by the parts that were cut.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Generator
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Producer

from koda_runtime.errors import DeadLetterError, RecordError, TopicError
from koda_runtime.kafka import producer_config
from koda_runtime.settings import Settings
from koda_runtime.topics.catalogue import RUNS, RUNS_DLQ
from koda_runtime.topics.kafka.bounded import BoundedReader
from koda_runtime.topics.records.dead_letters import DeadLetter, decode_dead_letter

ROLE = "dlq-replay"
TIMEOUT_S = 30.0


@dataclass(frozen=True, order=True)
class LetterId:
    """Where a dead letter is on the DLQ topic."""

    partition: int
    offset: int

    def __str__(self) -> str:
        return f"{self.partition}:{self.offset}"

    @classmethod
    def parse(cls, text: str) -> LetterId:
        """``P:O`` or ``O`` (partition 0); raises DeadLetterError naming the value."""
        head, sep, tail = text.strip().rpartition(":")
        part, off = (head, tail) if sep else ("0", tail)
        if not part.isdigit() or not off.isdigit():
            raise DeadLetterError(
                f"dead letter id {text!r}: use <partition>:<offset> as `koda dlq list` prints it"
            )
        return cls(int(part), int(off))


@dataclass(frozen=True)
class LetterAt:
    """One DLQ record: ``letter`` is None when the value is not a dead letter."""

    id: LetterId
    letter: DeadLetter | None
    timestamp_ms: int


@dataclass
class ReplayReport:
    """What a replay did; ``next_offset`` per DLQ partition resumes a later replay."""

    read: int = 0
    replayed: int = 0
    skipped: Counter[str] = field(default_factory=Counter)
    next_offset: dict[int, int] = field(default_factory=dict)


def read_letters(
    settings: Settings,
    *,
    from_offset: int = 0,
    only: LetterId | None = None,
    next_offset: dict[int, int] | None = None,
) -> Generator[LetterAt, None, None]:
    """Every DLQ record from ``from_offset`` (each partition) to the end as of the call,
    or just ``only``. ``next_offset`` (when given) is kept at the offset after the last
    record read per partition. Raises DeadLetterError when ``only`` is not on the topic."""
    dlq = settings.names.topic(RUNS_DLQ)
    reader = BoundedReader(settings, ROLE, settings.names.group(ROLE), timeout_s=TIMEOUT_S)
    try:
        ranges = {}
        for tp in reader.partitions(dlq):
            low, high = reader.watermarks(tp)
            ranges[tp] = (max(low, from_offset), high)
        if only is not None:
            low_high = ranges.get((dlq, only.partition))
            low = low_high[0] if low_high else from_offset
            if low_high is None or not low <= only.offset < low_high[1]:
                raise DeadLetterError(f"no dead letter {only} on {dlq}: see `koda dlq list`")
            ranges = {(dlq, only.partition): (only.offset, only.offset + 1)}
        reader.assign(
            {tp: r[0] for tp, r in ranges.items()}, {tp: r[1] for tp, r in ranges.items()}
        )
        if next_offset is not None:
            next_offset.update({p: start for (_, p), start in reader.positions.items()})
        for msg in reader.records(idle_timeout_s=TIMEOUT_S):
            p, offset = msg.partition() or 0, msg.offset() or 0
            if next_offset is not None:
                next_offset[p] = offset + 1
            try:
                letter: DeadLetter | None = decode_dead_letter(msg.value())
            except RecordError:
                letter = None
            yield LetterAt(LetterId(p, offset), letter, msg.timestamp()[1])
    finally:
        reader.close()


def replay_dead_letters(
    settings: Settings,
    *,
    reasons: Collection[str] = (),
    from_offset: int = 0,
    only: LetterId | None = None,
    limit: int | None = None,
    dry_run: bool = False,
    on_letter: Callable[[str], None] | None = None,
) -> ReplayReport:
    """Re-publish dead letters from ``from_offset`` on (every DLQ partition) to the end,
    or the one letter ``only``.

    ``reasons`` keeps only letters with one of those reasons (empty: all);
    ``limit`` stops after that many replayed; ``dry_run`` produces nothing.
    ``on_letter`` receives one line per letter read, for the CLI.
    """
    names = settings.names
    runs = names.topic(RUNS)
    report = ReplayReport()
    producer = None if dry_run else Producer(producer_config(settings, ROLE))
    failures: list[str] = []

    def delivered(err: KafkaError | None, _msg: Any) -> None:
        if err is not None:
            failures.append(err.str())

    letters = read_letters(
        settings, from_offset=from_offset, only=only, next_offset=report.next_offset
    )
    try:
        for at in letters:
            report.read += 1
            verdict = _replay_one(at.letter, runs, reasons, producer, delivered)
            if verdict == "replayed":
                report.replayed += 1
            else:
                report.skipped[verdict] += 1
            if on_letter is not None:
                on_letter(f"{names.topic(RUNS_DLQ)}[{at.id.partition}]@{at.id.offset}: {verdict}")
            if limit is not None and report.replayed >= limit:
                break
        if producer is not None and producer.flush(TIMEOUT_S):
            raise TopicError(f"some replayed records were not delivered to {runs} in time")
        if failures:
            raise TopicError(f"{len(failures)} replayed records failed: {failures[0]}")
    except KafkaException as exc:
        raise TopicError(f"dead-letter replay failed: {exc}") from exc
    finally:
        letters.close()
    return report


def _replay_one(
    letter: DeadLetter | None,
    runs_topic: str,
    reasons: Collection[str],
    producer: Producer | None,
    delivered: Callable[[KafkaError | None, Any], None],
) -> str:
    if letter is None:
        return "skipped: not a dead letter"
    if reasons and letter.reason not in reasons:
        return f"skipped: reason {letter.reason}"
    if letter.truncated:
        parts = letter.cut_parts
        return "skipped: original truncated" + (f" ({', '.join(parts)})" if parts else "")
    if letter.topic != runs_topic:
        return f"skipped: from {letter.topic}"
    if producer is not None:
        producer.produce(
            runs_topic,
            key=letter.key,
            value=letter.value,
            headers=list(letter.headers),
            on_delivery=delivered,
        )
        producer.poll(0)
    return "replayed"
