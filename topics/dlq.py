"""Replay dead letters: re-publish their original records to the runs topic.

``koda dlq replay`` reads ``<env>.koda.runs-dlq`` from an offset up to its end
(as of the start; no consumer group joins or commits) and produces each dead
letter's original key, value and headers to ``<env>.koda.runs``, with the same
partitioner as the gateway, so a user's record lands in the user's partition.

What a replay can and cannot do: the worker skips runs that are already
terminal in Postgres (redelivery is routine), so a run that failed after its
attempts stays failed; replay re-drives records that never reached a run, e.g.
``unknown_schema_version`` after deploying a worker that reads the new version,
or ``unknown_run`` after the run's row was restored. Dead letters whose original
was truncated (over 512 KiB) cannot be replayed and are counted as skipped.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition

from koda.errors import RecordError, TopicError
from koda.kafka import consumer_config, producer_config
from koda.settings import Settings
from schemas.dead_letters import decode_dead_letter
from topics.catalogue import RUNS, RUNS_DLQ

ROLE = "dlq-replay"
TIMEOUT_S = 30.0


@dataclass
class ReplayReport:
    """What a replay did; ``next_offset`` per DLQ partition resumes a later replay."""

    read: int = 0
    replayed: int = 0
    skipped: Counter[str] = field(default_factory=Counter)
    next_offset: dict[int, int] = field(default_factory=dict)


def replay_dead_letters(
    settings: Settings,
    *,
    reasons: Collection[str] = (),
    from_offset: int = 0,
    limit: int | None = None,
    dry_run: bool = False,
    on_letter: Callable[[str], None] | None = None,
) -> ReplayReport:
    """Re-publish dead letters from ``from_offset`` on (every DLQ partition) to the end.

    ``reasons`` keeps only letters with one of those reasons (empty: all);
    ``limit`` stops after that many replayed; ``dry_run`` produces nothing.
    ``on_letter`` receives one line per letter read, for the CLI.
    """
    names = settings.names
    dlq, runs = names.topic(RUNS_DLQ), names.topic(RUNS)
    report = ReplayReport()
    consumer = Consumer(consumer_config(settings, ROLE, names.group(ROLE)))
    producer = (
        None
        if dry_run
        else Producer(producer_config(settings, ROLE) | {"allow.auto.create.topics": False})
    )
    failures: list[str] = []

    def delivered(err: KafkaError | None, _msg: Any) -> None:
        if err is not None:
            failures.append(err.str())

    try:
        ends = _ranges(consumer, dlq, from_offset)
        consumer.assign([TopicPartition(dlq, p, start) for p, (start, _) in ends.items()])
        pending = {p for p, (start, end) in ends.items() if start < end}
        report.next_offset = {p: start for p, (start, _) in ends.items()}
        deadline = time.monotonic() + TIMEOUT_S
        while pending and time.monotonic() < deadline:
            if limit is not None and report.replayed >= limit:
                break
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            error = msg.error()
            if error is not None:
                raise TopicError(f"cannot read {dlq}: {error.str()}")
            p, offset = msg.partition() or 0, msg.offset() or 0
            report.next_offset[p] = offset + 1
            if offset + 1 >= ends[p][1]:
                pending.discard(p)
            report.read += 1
            deadline = time.monotonic() + TIMEOUT_S
            verdict = _replay_one(msg.value(), runs, reasons, producer, delivered)
            if verdict == "replayed":
                report.replayed += 1
            else:
                report.skipped[verdict] += 1
            if on_letter is not None:
                on_letter(f"{dlq}[{p}]@{offset}: {verdict}")
        if pending and not (limit is not None and report.replayed >= limit):
            raise TopicError(f"timed out reading {dlq}; replayed {report.replayed} so far")
        if producer is not None and producer.flush(TIMEOUT_S):
            raise TopicError(f"some replayed records were not delivered to {runs} in time")
        if failures:
            raise TopicError(f"{len(failures)} replayed records failed: {failures[0]}")
    except KafkaException as exc:
        raise TopicError(f"dead-letter replay failed: {exc}") from exc
    finally:
        consumer.close()
    return report


def _ranges(consumer: Consumer, topic: str, from_offset: int) -> dict[int, tuple[int, int]]:
    """``{partition: (first offset to read, end offset)}`` of ``topic`` as of now."""
    meta = consumer.list_topics(topic, timeout=TIMEOUT_S).topics.get(topic)
    if meta is None or meta.error is not None:
        raise TopicError(f"topic {topic} is not available: run `koda topics apply`")
    ranges = {}
    for p in sorted(meta.partitions):
        low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=TIMEOUT_S)
        ranges[p] = (max(low, from_offset), high)
    return ranges


def _replay_one(
    value: bytes | None,
    runs_topic: str,
    reasons: Collection[str],
    producer: Producer | None,
    delivered: Callable[[KafkaError | None, Any], None],
) -> str:
    try:
        letter = decode_dead_letter(value)
    except RecordError:
        return "skipped: not a dead letter"
    if reasons and letter.reason not in reasons:
        return f"skipped: reason {letter.reason}"
    if letter.truncated:
        return "skipped: original truncated"
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
